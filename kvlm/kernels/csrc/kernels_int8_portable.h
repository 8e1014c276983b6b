// Int8 activations without x86 vectors: the portable unit (plain C++) and the ARM NEON units (`sdot`
// where __ARM_FEATURE_DOTPROD, else `smull` + `sadalp`), every format (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1,
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
// Work order: a weight row at a time (decoded into a per-thread buffer of K / 32 units), every row of
// x against it. No column panels yet (docs/kernels.md: NEON, not measured on ARM hardware).
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

// The exact integer sums of elements 0..15 and 16..31 of w . q.
KVLM_INLINE void dot32(const int8_t* w, const int8_t* q, int32_t* lo, int32_t* hi) {
#if defined(KVLM_NEON)
    const int8x16_t w0 = vld1q_s8(w), w1 = vld1q_s8(w + 16), q0 = vld1q_s8(q), q1 = vld1q_s8(q + 16);
#if defined(KVLM_DOTPROD)
    *lo = vaddvq_s32(vdotq_s32(vdupq_n_s32(0), w0, q0));
    *hi = vaddvq_s32(vdotq_s32(vdupq_n_s32(0), w1, q1));
#else
    const int32x4_t l = vpadalq_s16(vpaddlq_s16(vmull_s8(vget_low_s8(w0), vget_low_s8(q0))),
                                    vmull_high_s8(w0, q0));
    const int32x4_t h = vpadalq_s16(vpaddlq_s16(vmull_s8(vget_low_s8(w1), vget_low_s8(q1))),
                                    vmull_high_s8(w1, q1));
    *lo = vaddvq_s32(l), *hi = vaddvq_s32(h);
#endif
#else
    int32_t a = 0, b = 0;
    for (int e = 0; e < 16; e++) a += (int32_t)w[e] * q[e], b += (int32_t)w[e + 16] * q[e + 16];
    *lo = a, *hi = b;
#endif
}

// Rows [n0, n1) of W against the M rows of x: a weight row decoded once, every row of x against it.
template <int QT>
void gemm_port_t(const uint8_t* w, int64_t rs, int64_t K, const int8_t* xq, const float* xd, const float* xs,
                 const int32_t* xi, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
    (void)xi;
    constexpr int SUB = PFmt<QT>::BE / 32;
    const int64_t nb = K / 32;
    PUnit* u = thread_buffer<PUnit>(nb);
    if (u == nullptr) return;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t* row = w + n * rs;
        for (int64_t b = 0; b < nb / SUB; b++) decode_block<QT>(row + b * PFmt<QT>::BB, u + b * SUB);
        for (int64_t m = 0; m < M; m++) {
            const int8_t* q = xq + m * K;
            float acc = 0.0f, mn = 0.0f;
            for (int64_t ib = 0; ib < nb; ib++) {
                int32_t lo, hi;
                dot32(u[ib].w, q + 32 * ib, &lo, &hi);
                const int32_t isum = QT == T_Q6_K ? u[ib].sl * lo + u[ib].sh * hi : lo + hi;
                const float f = (float)isum * u[ib].dw;  // rounded on its own, then one fma
                acc = fmaf(f, xd[8 * (m * nb + ib)], acc);
                if constexpr (PFmt<QT>::MIN) mn = fmaf(u[ib].mw, xs[m * nb + ib], mn);
            }
            y[m * ldy + n] = PFmt<QT>::MIN ? acc + mn : acc;
        }
    }
}
