// Int8 activations without x86 vectors: the portable unit (plain C++) and the ARM NEON units (`smmla`
// where KVLM_I8MM, `sdot` where KVLM_DOTPROD, else `smull` + `sadalp`), every format (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1,
// Q4_K, Q5_K, Q6_K), on the AVX-512 contract (kernels_int8_panel.h, kernels_kquant.h): the same bits
// as the AVX2 and AVX-512 kernels. Included by kernels_int8.h on the units without AVX2.
//
// A weight row's units (the 32 weights that meet x's block ib) are decoded once per row into signed
// int8 w = u - offset (Q4_0: -8..7, Q5_0: -16..15, Q6_K: -32..31 before its sub-scales, Q8_0 as
// stored; Q4_1, Q5_1, Q4_K, Q5_K: 0..31), with the unit's float factors dw, mw computed with the same
// float32 operations as the x86 kernels (Q4_K / Q5_K: dw = d * float(sc), mw = (-dmin) * float(m)).
// Then, per row of x and unit, the integer sums of elements 0..15 and 16..31 (exact in int32 in any
// order: |w q| <= 128 * 127), isum = lo + hi (Q6_K: sl * lo + sh * hi), and the contract's float
// sequence: acc = fma(float(isum) * dw, xd, acc) over ib in order, mn = fma(mw, xs, mn), y = acc + mn.
// The weight offsets enter w itself, not a -8 / -16 / -32 * sum(q) term: integers, so the same isum.
//
// Work order (below): 4 weight rows in flight, each x block reused across them, tiles of 2 rows of x
// (smmla on the i8mm unit: 2 rows of x times 2 weight rows per instruction). Not measured on ARM hardware.
// (arm_neon.h and math.h: included by kernels_impl.h, outside the anonymous namespace.)

// One unit of a weight row: signed weights and factors (sl, sh: Q6_K's sub-scales, else 1).
struct PUnit {
    int8_t w[32];
    float dw, mw;
    int32_t sl, sh;
};

template <int QT> struct PFmt;  // BE elements and BB bytes per block, MIN: has a min term
template <> struct PFmt<T_Q4_0> { static constexpr int BE = 32, BB = 18; static constexpr bool MIN = false; };
template <> struct PFmt<T_Q4_1> { static constexpr int BE = 32, BB = 20; static constexpr bool MIN = true; };
template <> struct PFmt<T_Q8_0> { static constexpr int BE = 32, BB = 34; static constexpr bool MIN = false; };
template <> struct PFmt<T_Q5_0> { static constexpr int BE = 32, BB = 22; static constexpr bool MIN = false; };
template <> struct PFmt<T_Q5_1> { static constexpr int BE = 32, BB = 24; static constexpr bool MIN = true; };
template <> struct PFmt<T_Q4_K> { static constexpr int BE = 256, BB = 144; static constexpr bool MIN = true; };
template <> struct PFmt<T_Q5_K> { static constexpr int BE = 256, BB = 176; static constexpr bool MIN = true; };
template <> struct PFmt<T_Q6_K> { static constexpr int BE = 256, BB = 210; static constexpr bool MIN = false; };

// The units of block `b` (one for the 32-element formats, 8 for the K-quants) into u[0 ..].
template <int QT>
KVLM_INLINE void decode_block(const uint8_t* b, PUnit* u) {
    if constexpr (QT == T_Q8_0) {
        u->dw = f16(b), u->mw = 0.0f, u->sl = u->sh = 1;
        memcpy(u->w, b + 2, 32);
    } else if constexpr (QT == T_Q4_0 || QT == T_Q4_1) {
        const int qs = QT == T_Q4_0 ? 2 : 4, off = QT == T_Q4_0 ? 8 : 0;
        u->dw = f16(b), u->mw = QT == T_Q4_1 ? f16(b + 2) : 0.0f, u->sl = u->sh = 1;
        for (int e = 0; e < 16; e++) {
            u->w[e] = (int8_t)((b[qs + e] & 15) - off);
            u->w[e + 16] = (int8_t)((b[qs + e] >> 4) - off);
        }
    } else if constexpr (QT == T_Q5_0 || QT == T_Q5_1) {
        const int qh_at = QT == T_Q5_0 ? 2 : 4, off = QT == T_Q5_0 ? 16 : 0;
        u->dw = f16(b), u->mw = QT == T_Q5_1 ? f16(b + 2) : 0.0f, u->sl = u->sh = 1;
        uint32_t qh;
        memcpy(&qh, b + qh_at, 4);
        const uint8_t* qs = b + qh_at + 4;
        for (int e = 0; e < 16; e++) {
            u->w[e] = (int8_t)(((qs[e] & 15) | (((qh >> e) & 1) << 4)) - off);
            u->w[e + 16] = (int8_t)(((qs[e] >> 4) | (((qh >> (e + 16)) & 1) << 4)) - off);
        }
    } else if constexpr (QT == T_Q4_K || QT == T_Q5_K) {
        const float d = f16(b), ndmin = 0.0f - f16(b + 2);
        for (int s = 0; s < 8; s++) {
            int sc, m;
            scale_min_k4(s, b + 4, sc, m);
            PUnit* p = u + s;
            p->dw = d * (float)sc, p->mw = ndmin * (float)m, p->sl = p->sh = 1;
            const uint8_t* q = b + (QT == T_Q4_K ? 16 : 48) + 32 * (s / 2);
            for (int e = 0; e < 32; e++) {
                int v = (q[e] >> (4 * (s & 1))) & 15;
                if constexpr (QT == T_Q5_K) v |= ((b[16 + e] >> s) & 1) << 4;
                p->w[e] = (int8_t)v;
            }
        }
    } else {  // Q6_K: sub-block s = 4 h + c, low 4 bits from ql, high 2 from qh, int8 scales per 16
        const float d = f16(b + 208);
        const int8_t* scales = (const int8_t*)(b + 192);
        for (int s = 0; s < 8; s++) {
            const int h = s / 4, c = s % 4;
            const uint8_t* ql = b + 64 * h + (c & 1) * 32;
            const uint8_t* qh = b + 128 + 32 * h;
            PUnit* p = u + s;
            p->dw = d, p->mw = 0.0f, p->sl = scales[2 * s], p->sh = scales[2 * s + 1];
            for (int e = 0; e < 32; e++)
                p->w[e] = (int8_t)((((ql[e] >> ((c >> 1) * 4)) & 15) | (((qh[e] >> (2 * c)) & 3) << 4)) - 32);
        }
    }
}

// ---- Work order: PNR weight rows in flight, a tile of MR rows of x against them ----------------------
// A group of PNR = 4 weight rows is decoded once into this thread's buffer (row r's units at u[r * nb ..];
// rows past the matrix's end are zero units, computed and not stored), with their factors gathered per
// unit index (PGroup: lane r = row r). Then for each tile of MR rows of x (2, the tail 1) the units go
// in order ib = 0 .. nb-1: one x block is loaded once and reused across the 4 rows, the 4 rows' integer
// sums land in one int32x4 (lane = row), and the float sequence runs on 4 lanes at once. Every output
// keeps the contract's own sequence (its isum, then fma over ib in order): the lanes never mix, so the
// bits are those of a row at a time whatever M, the tile or the split.
constexpr int PNR = 4;
struct PGroup {
    float dw[PNR], mw[PNR];
    int32_t sl[PNR], sh[PNR];
};

template <int QT>
KVLM_INLINE void decode_group(const uint8_t* w, int64_t rs, int64_t n, int nr, int64_t nb, PUnit* u, PGroup* g) {
    constexpr int SUB = PFmt<QT>::BE / 32;
    for (int r = 0; r < PNR; r++) {
        PUnit* ur = u + r * nb;
        if (r >= nr) {
            memset((void*)ur, 0, nb * sizeof(PUnit));  // w = 0, dw = mw = 0, sl = sh = 0
            continue;
        }
        const uint8_t* row = w + (n + r) * rs;
        for (int64_t b = 0; b < nb / SUB; b++) decode_block<QT>(row + b * PFmt<QT>::BB, ur + b * SUB);
    }
    for (int64_t ib = 0; ib < nb; ib++)
        for (int r = 0; r < PNR; r++) {
            const PUnit& p = u[r * nb + ib];
            g[ib].dw[r] = p.dw, g[ib].mw[r] = p.mw, g[ib].sl[r] = p.sl, g[ib].sh[r] = p.sh;
        }
}

#if defined(KVLM_NEON)

// Lane j of the sum of the four rows' partial vectors: [sum a, sum b, sum c, sum d] (exact integers).
KVLM_INLINE int32x4_t rowsum4(int32x4_t a, int32x4_t b, int32x4_t c, int32x4_t d) {
    return vpaddq_s32(vpaddq_s32(a, b), vpaddq_s32(c, d));
}
// Partial int32 sums of 16 products w[e] q[e] (their lanes add up to the exact dot product).
KVLM_INLINE int32x4_t dot16(int8x16_t w, int8x16_t q) {
#if defined(KVLM_DOTPROD)
    return vdotq_s32(vdupq_n_s32(0), w, q);
#else
    return vpadalq_s16(vpaddlq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(q))), vmull_high_s8(w, q));
#endif
}
template <int QT>
KVLM_INLINE int32x4_t combine(int32x4_t lo, int32x4_t hi, const PGroup& g) {
    if constexpr (QT == T_Q6_K) return vmlaq_s32(vmulq_s32(vld1q_s32(g.sl), lo), vld1q_s32(g.sh), hi);
    return vaddq_s32(lo, hi);
}

#if defined(KVLM_I8MM)
KVLM_INLINE int8x16_t zip_lo(int8x16_t a, int8x16_t b) {  // [a 0..7, b 0..7]
    return vreinterpretq_s8_s64(vzip1q_s64(vreinterpretq_s64_s8(a), vreinterpretq_s64_s8(b)));
}
KVLM_INLINE int8x16_t zip_hi(int8x16_t a, int8x16_t b) {  // [a 8..15, b 8..15]
    return vreinterpretq_s8_s64(vzip2q_s64(vreinterpretq_s64_s8(a), vreinterpretq_s64_s8(b)));
}
#endif

// isum[m] (lane r = weight row r) of unit ib for the MR rows of x at q[m].
template <int QT, int MR>
KVLM_INLINE void isums(const PUnit* u, int64_t nb, const PGroup& g, const int8_t* const* q, int32x4_t* isum) {
#if defined(KVLM_I8MM)
    if constexpr (MR == 2) {
        // smmla: (2 x 8 int8 of x rows) times (8 x 2 of two weight rows) -> 2 x 2 int32, lanes
        // [m0 r, m0 r', m1 r, m1 r']; two per 16 elements, one pair of weight rows at a time.
        const int8x16_t a0 = vld1q_s8(q[0]), a1 = vld1q_s8(q[0] + 16), b0 = vld1q_s8(q[1]), b1 = vld1q_s8(q[1] + 16);
        const int8x16_t x0 = zip_lo(a0, b0), x1 = zip_hi(a0, b0), x2 = zip_lo(a1, b1), x3 = zip_hi(a1, b1);
        int32x4_t lo[2], hi[2];
        for (int p = 0; p < 2; p++) {
            const int8_t* wa = u[(2 * p) * nb].w;
            const int8_t* wb = u[(2 * p + 1) * nb].w;
            const int8x16_t c0 = vld1q_s8(wa), c1 = vld1q_s8(wa + 16), d0 = vld1q_s8(wb), d1 = vld1q_s8(wb + 16);
            const int32x4_t z = vdupq_n_s32(0);
            lo[p] = vmmlaq_s32(vmmlaq_s32(z, x0, zip_lo(c0, d0)), x1, zip_hi(c0, d0));
            hi[p] = vmmlaq_s32(vmmlaq_s32(z, x2, zip_lo(c1, d1)), x3, zip_hi(c1, d1));
        }
        isum[0] = combine<QT>(vcombine_s32(vget_low_s32(lo[0]), vget_low_s32(lo[1])),
                              vcombine_s32(vget_low_s32(hi[0]), vget_low_s32(hi[1])), g);
        isum[1] = combine<QT>(vcombine_s32(vget_high_s32(lo[0]), vget_high_s32(lo[1])),
                              vcombine_s32(vget_high_s32(hi[0]), vget_high_s32(hi[1])), g);
        return;
    }
#endif
    int8x16_t w0[PNR], w1[PNR];
    for (int r = 0; r < PNR; r++) w0[r] = vld1q_s8(u[r * nb].w), w1[r] = vld1q_s8(u[r * nb].w + 16);
    for (int m = 0; m < MR; m++) {
        const int8x16_t q0 = vld1q_s8(q[m]), q1 = vld1q_s8(q[m] + 16);
        const int32x4_t lo = rowsum4(dot16(w0[0], q0), dot16(w0[1], q0), dot16(w0[2], q0), dot16(w0[3], q0));
        const int32x4_t hi = rowsum4(dot16(w1[0], q1), dot16(w1[1], q1), dot16(w1[2], q1), dot16(w1[3], q1));
        isum[m] = combine<QT>(lo, hi, g);
    }
}

// Rows m0 .. m0+MR-1 of x against the group's 4 weight rows: y[m][n + r] for r < nr.
template <int QT, int MR>
KVLM_INLINE void tile(const PUnit* u, const PGroup* g, int64_t nb, int64_t K, const int8_t* xq, const float* xd,
                      const float* xs, int64_t m0, float* y, int64_t ldy, int64_t n, int nr) {
    float32x4_t acc[MR], mn[MR];
    const int8_t* q[MR];
    for (int m = 0; m < MR; m++) acc[m] = mn[m] = vdupq_n_f32(0.0f), q[m] = xq + (m0 + m) * K;
    for (int64_t ib = 0; ib < nb; ib++) {
        int32x4_t isum[MR];
        isums<QT, MR>(u + ib, nb, g[ib], q, isum);
        const float32x4_t dw = vld1q_f32(g[ib].dw);
        for (int m = 0; m < MR; m++) {
            const float32x4_t f = vmulq_f32(vcvtq_f32_s32(isum[m]), dw);  // rounded on its own, then one fma
            acc[m] = vfmaq_f32(acc[m], f, vdupq_n_f32(xd[8 * ((m0 + m) * nb + ib)]));
            if constexpr (PFmt<QT>::MIN)
                mn[m] = vfmaq_f32(mn[m], vld1q_f32(g[ib].mw), vdupq_n_f32(xs[(m0 + m) * nb + ib]));
            q[m] += 32;
        }
    }
    for (int m = 0; m < MR; m++) {
        float out[PNR];
        vst1q_f32(out, PFmt<QT>::MIN ? vaddq_f32(acc[m], mn[m]) : acc[m]);
        for (int r = 0; r < nr; r++) y[(m0 + m) * ldy + n + r] = out[r];
    }
}

#else  // plain C++: the same order, lane by lane

template <int QT, int MR>
KVLM_INLINE void tile(const PUnit* u, const PGroup* g, int64_t nb, int64_t K, const int8_t* xq, const float* xd,
                      const float* xs, int64_t m0, float* y, int64_t ldy, int64_t n, int nr) {
    float acc[MR][PNR] = {}, mn[MR][PNR] = {};
    for (int64_t ib = 0; ib < nb; ib++)
        for (int m = 0; m < MR; m++) {
            const int8_t* q = xq + (m0 + m) * K + 32 * ib;
            const float d = xd[8 * ((m0 + m) * nb + ib)];
            for (int r = 0; r < PNR; r++) {
                const int8_t* w = u[r * nb + ib].w;
                int32_t lo = 0, hi = 0;
                for (int e = 0; e < 16; e++) lo += (int32_t)w[e] * q[e], hi += (int32_t)w[e + 16] * q[e + 16];
                const int32_t isum = QT == T_Q6_K ? g[ib].sl[r] * lo + g[ib].sh[r] * hi : lo + hi;
                const float f = (float)isum * g[ib].dw[r];  // rounded on its own, then one fma
                acc[m][r] = fmaf(f, d, acc[m][r]);
                if constexpr (PFmt<QT>::MIN) mn[m][r] = fmaf(g[ib].mw[r], xs[(m0 + m) * nb + ib], mn[m][r]);
            }
        }
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < nr; r++) y[(m0 + m) * ldy + n + r] = PFmt<QT>::MIN ? acc[m][r] + mn[m][r] : acc[m][r];
}

#endif

// Rows [n0, n1) of W against the M rows of x: groups of 4 weight rows, tiles of 2 rows of x (then 1).
template <int QT>
void gemm_port_t(const uint8_t* w, int64_t rs, int64_t K, const int8_t* xq, const float* xd, const float* xs,
                 const int32_t* xi, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
    (void)xi;
    const int64_t nb = K / 32;
    PUnit* u = thread_buffer<PUnit>(PNR * nb);
    PGroup* g = thread_buffer<PGroup>(nb);
    if (u == nullptr || g == nullptr) return;
    for (int64_t n = n0; n < n1; n += PNR) {
        const int nr = (int)(n1 - n < PNR ? n1 - n : PNR);
        decode_group<QT>(w, rs, n, nr, nb, u, g);
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) tile<QT, 2>(u, g, nb, K, xq, xd, xs, m, y, ldy, n, nr);
        if (m < M) tile<QT, 1>(u, g, nb, K, xq, xd, xs, m, y, ldy, n, nr);
    }
}
