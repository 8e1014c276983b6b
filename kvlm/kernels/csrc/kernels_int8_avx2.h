// AVX2 int8-activation matmul for every int8 format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K):
// column panels of 8 output columns per ymm, on the AVX-512 kernels' contract (kernels_int8_panel.h,
// kernels_kquant.h), so AVX2 and AVX-512 give the same bits. Included by kernels_kquant.h on the AVX2
// unit (after the KQ / I8Fmt traits). Numerics: reference.qmatmul_int8_ref; bit for bit:
// reference.qmatmul_int8_contract.
//
// Order contract of output (m, n), whatever M, the tile, the panel lane or the thread split (the same
// as AVX-512's): a unit ib is the 32 weights of row n that meet x's block ib, with its exact int32 sum
//     isum_ib = sum_i w_i q_i      (Q4_0 / Q5_0: u - 8 / u - 16 as -8 / -16 sum(q); Q6_K: per 16-element
//                                   half (sum u q - 32 sum q) times its int8 sub-scale)
//     acc = 0;  for ib = 0 .. K/32 - 1:  acc = fma(float(isum_ib) * dw_ib, xd_ib, acc)
//     formats with a min (Q4_1, Q5_1, Q4_K, Q5_K): mn = 0; for ib: mn = fma(mw_ib, xs_ib, mn); y = acc + mn
//     others: y = acc.
// The integer sums are exact whatever order the instructions take them in, so the AVX2 kernel is free to
// sum bytes in int16 (maddubs) before widening (madd): G products per int16 lane, G chosen per format so
// no lane can overflow (|u| <= 15 / 31 / 63 / 128 for Q4 / Q5 / Q6 / Q8 and |q| <= 127:
// 2 * 15 * 127 * 8 < 2^15, 2 * 31 * 127 * 4, 2 * 63 * 127 * 2, 2 * 128 * 127 * 1).
//
// Layout. A panel is 8 weight rows; load_rows8 puts rows a and a + 4's 16 bytes at one offset in the two
// 128-bit lanes of z[a]. A unit of the panel is lo[4] (elements 0..15) and hi[4] (16..31) in that layout.
// Few rows of x (M <= FLY_ROWS2, decode): x's 16 bytes are broadcast to both lanes, each row's 4 partial
// sums per z added up by sum_rows8 (no transpose), the unit used at once: 8 weight rows stream side by
// side, the panel after next prefetched a slice per block (Q6_K at one row of x reads whole weight rows in two
// streams instead: q6_stream8, below). More rows (prefill): each unit is transposed
// once (v[j] lane c = row c's elements 4j .. 4j + 3) into a per-thread buffer (its fill prefetching the
// panel after next the same way), and tiles of ROW_TILE2 rows of x run against it with x's 4 bytes broadcast: 8 maddubs + 1 to 8 madd per 256 products
// (Q8_0 without AVX-VNNI: int16 pairs instead, gemm_w8).

namespace {

// AVX-VNNI (the avx2-vnni unit: Intel client CPUs since Alder Lake, Zen 5): vpdpbusd on ymm sums 4 byte
// products into each int32 lane in one instruction, where AVX2 takes maddubs (pairs into int16) and madd
// (int16 pairs into int32). Both give the exact integer, so the two units' outputs are the same bits.
#if defined(KVLM_AVX_VNNI)
constexpr bool VNNI8 = true;
#else
constexpr bool VNNI8 = false;
#endif

// int32 lanes += 4-byte dot products of u (unsigned bytes) with s (signed bytes). Without VNNI, maddubs's
// int16 pairs cannot saturate here: |u| <= 128 and |s| <= 127 (2 * 128 * 127 < 2^15).
KVLM_INLINE __m256i dot8(__m256i acc, __m256i u, __m256i s) {
#if defined(KVLM_AVX_VNNI)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// Rows a and a + 4's 16 bytes at `off` in the low and high 128-bit lanes of z[a]: two broadcast loads and a
// blend (pure loads and an any-pipe op, where vinserti128 takes one of Zen's two shuffle pipes, which the
// decode loop is short of).
KVLM_INLINE void load_rows8(const uint8_t* const* rows, int64_t off, __m256i z[4]) {
    for (int a = 0; a < 4; a++)
        z[a] = _mm256_blend_epi32(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(rows[a] + off))),
                                  _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(rows[a + 4] + off))),
                                  0xf0);
}

// 4 x 4 transpose of dwords inside each 128-bit lane: t[j] lane c = row c's dword j.
KVLM_INLINE void transpose8(const __m256i z[4], __m256i t[4]) {
    const __m256i t0 = _mm256_unpacklo_epi32(z[0], z[1]), t1 = _mm256_unpackhi_epi32(z[0], z[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(z[2], z[3]), t3 = _mm256_unpackhi_epi32(z[2], z[3]);
    t[0] = _mm256_unpacklo_epi64(t0, t2), t[1] = _mm256_unpackhi_epi64(t0, t2);
    t[2] = _mm256_unpacklo_epi64(t1, t3), t[3] = _mm256_unpackhi_epi64(t1, t3);
}

// s[a] lane l: 4 partial sums of row a + 4l -> lane c: row c's total (exact: integers).
KVLM_INLINE __m256i sum_rows8(const __m256i s[4]) {
    const __m256i t0 = _mm256_add_epi32(_mm256_unpacklo_epi32(s[0], s[1]), _mm256_unpackhi_epi32(s[0], s[1]));
    const __m256i t1 = _mm256_add_epi32(_mm256_unpacklo_epi32(s[2], s[3]), _mm256_unpackhi_epi32(s[2], s[3]));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1));
}

// The low 16 bits of each int32 lane as a float16 -> 8 floats.
KVLM_INLINE __m256 half_lo8(__m256i v) {
    v = _mm256_and_si256(v, _mm256_set1_epi32(0xffff));
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}

// Lane c: the 4 bytes at rows[c] + off. Eight broadcast loads and seven blends: vpgatherdd took ~40% of
// the decode loop's time on Zen 4 (a block's scales are one gather per 144 weight bytes in Q4_0).
KVLM_INLINE __m256i dwords8(const uint8_t* const* rows, int64_t off) {
    const auto b = [&](int c) {
        int32_t v;
        memcpy(&v, rows[c] + off, 4);
        return _mm256_set1_epi32(v);
    };
    const __m256i a = _mm256_blend_epi32(_mm256_blend_epi32(b(0), b(1), 0x02), _mm256_blend_epi32(b(2), b(3), 0x08), 0x0c);
    const __m256i c = _mm256_blend_epi32(_mm256_blend_epi32(b(4), b(5), 0x20), _mm256_blend_epi32(b(6), b(7), 0x80), 0xc0);
    return _mm256_blend_epi32(a, c, 0xf0);
}

// The float16 at rows[c] + off (hi: at off + 2), lane c.
KVLM_INLINE __m256 halves8(const uint8_t* const* rows, int64_t off, bool hi) {
    const __m256i g = dwords8(rows, off);
    return half_lo8(hi ? _mm256_srli_epi32(g, 16) : g);
}

KVLM_INLINE __m256i nib8(__m256i z, int sh) { return _mm256_and_si256(_mm256_srli_epi16(z, sh), _mm256_set1_epi8(15)); }

// Bytes 16 where (z & bit) != 0, else 0.
KVLM_INLINE __m256i bit16(__m256i z, __m256i bit) {
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(z, bit), bit), _mm256_set1_epi8(16));
}

template <int QT>
constexpr int block_bytes8() {
    if constexpr (QT == T_Q4_0 || QT == T_Q4_1 || QT == T_Q8_0) return I8Fmt<QT>::BB;
    else return KQ<QT>::BB;
}

template <int QT>
struct F2 {
    static constexpr bool KQUANT = QT == T_Q4_K || QT == T_Q5_K || QT == T_Q6_K;
    static constexpr int BB = block_bytes8<QT>();
    static constexpr int SUB = KQUANT ? 8 : 1;  // units per block
    static constexpr bool MIN = QT == T_Q4_1 || QT == T_Q5_1 || QT == T_Q4_K || QT == T_Q5_K;
    static constexpr int OFF = QT == T_Q4_0 ? -8 : QT == T_Q5_0 ? -16 : 0;  // isum += OFF * sum(q)
    static constexpr bool SIGNED = QT == T_Q8_0;  // |w| against x with w's sign
    // Q8_0 on AVX-VNNI: w + 128 (unsigned) against x, the sum started at -128 sum(q): no sign flips (vpdpbusd
    // does not saturate, where maddubs would: 2 * 255 * 127 > 2^15)
    static constexpr bool U128 = SIGNED && VNNI8;
    static constexpr bool Q6 = QT == T_Q6_K;
    static constexpr int G = QT == T_Q8_0 ? 1 : Q6 ? 2 : QT == T_Q5_0 || QT == T_Q5_1 || QT == T_Q5_K ? 4 : 8;
};

// One unit of 8 rows (load_rows8's layout) and its factors.
struct Unit8 {
    __m256i lo[4], hi[4];
    __m256 dw, mw;
    __m256i sl, sh;  // Q6_K's sub-scales (int32 lanes)
};

// Per block of 8 rows, what its units share (K-quants).
struct Head8 {
    __m256 dw[8], mw[8];
    __m256i qh[8];  // Q5_K: qh bytes 0..15 (qh[0..3]) and 16..31 (qh[4..7])
    __m256i sc[4];  // Q6_K: lane c = row c's int8 scales 4j .. 4j + 3 (sc[j])
    // Q6_K's quant bytes in load_rows8's layout, 16 bytes a chunk, loaded once per block: each chunk serves
    // 2 units (ql) or 4 (qh). Q4_K / Q5_K load their 32 bytes in unit8 instead (units 2k and 2k + 1 each
    // load them, from L1): kept here, 32 ymm went through the stack and back, and M = 1 ran 1.13-1.17x
    // slower on hot weights (Zen 5, AVX2 and AVX-VNNI).
    __m256i raw[12][4];
};

// Where the quant bytes start: Q4_K / Q5_K: the 128 quant bytes (unit8); Q6_K: ql (128 bytes) then qh (64),
// head8's 12 raw[] chunks.
template <int QT>
constexpr int RAW_AT = QT == T_Q4_K ? 16 : QT == T_Q5_K ? 48 : 0;

// A Q4_K / Q5_K super-block's 8 unit factors for 8 rows, from t[0] = d | dmin << 16 and t[1..3] = the scale bytes
// 0..3, 4..7, 8..11 (lane c: row c): dw[j] = d sc_j, mw[j] = -(dmin m_j), the same float ops as kernels_kquant.h's
// k4_scales_t.
KVLM_INLINE void k4_scales8(const __m256i t[4], __m256* dw, __m256* mw) {
    const __m256 d = half_lo8(t[0]);
    const __m256 ndmin = _mm256_sub_ps(_mm256_setzero_ps(), half_lo8(_mm256_srli_epi32(t[0], 16)));
    const __m256i m63 = _mm256_set1_epi32(63), m15 = _mm256_set1_epi32(15), m3 = _mm256_set1_epi32(3);
    for (int j = 0; j < 8; j++) {
        __m256i sc, mn;
        if (j < 4) {
            sc = _mm256_and_si256(_mm256_srli_epi32(t[1], 8 * j), m63);
            mn = _mm256_and_si256(_mm256_srli_epi32(t[2], 8 * j), m63);
        } else {
            const int k = j - 4;
            sc = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(t[3], 8 * k), m15),
                                 _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(t[1], 8 * k + 6), m3), 4));
            mn = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(t[3], 8 * k + 4), m15),
                                 _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(t[2], 8 * k + 6), m3), 4));
        }
        dw[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
        mw[j] = _mm256_mul_ps(ndmin, _mm256_cvtepi32_ps(mn));
    }
}

template <int QT>
KVLM_INLINE void head8(const uint8_t* const* rows, int64_t off, Head8* h) {
    if constexpr (QT == T_Q6_K)
        for (int i = 0; i < 12; i++) load_rows8(rows, off + RAW_AT<QT> + 16 * i, h->raw[i]);
    if constexpr (QT == T_Q4_K || QT == T_Q5_K) {
        __m256i z[4], t[4];
        load_rows8(rows, off, z);
        transpose8(z, t);
        k4_scales8(t, h->dw, h->mw);
        if constexpr (QT == T_Q5_K) {
            load_rows8(rows, off + 16, h->qh);
            load_rows8(rows, off + 32, h->qh + 4);
        }
    } else if constexpr (QT == T_Q6_K) {
        __m256i z[4];
        load_rows8(rows, off + 192, z);
        transpose8(z, h->sc);
        h->dw[0] = halves8(rows, off + 206, true);  // d at 208..209: read from 206, inside the block
    }
}

// Unit s of the 8 rows' block at `off`.
template <int QT>
KVLM_INLINE void unit8(const uint8_t* const* rows, int64_t off, int s, const Head8& h, Unit8* u) {
    (void)s;
    if constexpr (QT == T_Q4_0 || QT == T_Q4_1) {
        __m256i z[4];
        load_rows8(rows, off + I8Fmt<QT>::QOFF, z);  // byte i: element i (low nibble), i + 16 (high)
        for (int a = 0; a < 4; a++) u->lo[a] = nib8(z[a], 0), u->hi[a] = nib8(z[a], 4);
        const __m256i g = dwords8(rows, off);  // d (and Q4_1's m)
        u->dw = half_lo8(g);
        if constexpr (QT == T_Q4_1) u->mw = half_lo8(_mm256_srli_epi32(g, 16));
    } else if constexpr (QT == T_Q8_0) {
        load_rows8(rows, off + 2, u->lo);
        load_rows8(rows, off + 18, u->hi);
        u->dw = halves8(rows, off, false);
    } else if constexpr (QT == T_Q5_0 || QT == T_Q5_1) {
        // qh (4 bytes) at QH, nibbles at QH + 4; each lane's first dword is its row's qh, spread to bytes
        // (byte e of a lane: qh byte e / 8) and tested against bit e % 8.
        constexpr int QH = QT == T_Q5_0 ? 2 : 4;
        __m256i q[4], z[4];
        load_rows8(rows, off + QH, q);
        load_rows8(rows, off + QH + 4, z);
        const __m256i bits = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        const __m256i spread_lo = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
        const __m256i spread_hi = _mm256_broadcastsi128_si256(_mm_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
        for (int a = 0; a < 4; a++) {
            u->lo[a] = _mm256_or_si256(nib8(z[a], 0), bit16(_mm256_shuffle_epi8(q[a], spread_lo), bits));
            u->hi[a] = _mm256_or_si256(nib8(z[a], 4), bit16(_mm256_shuffle_epi8(q[a], spread_hi), bits));
        }
        const __m256i g = dwords8(rows, off);  // d (and Q5_1's m)
        u->dw = half_lo8(g);
        if constexpr (QT == T_Q5_1) u->mw = half_lo8(_mm256_srli_epi32(g, 16));
    } else if constexpr (QT == T_Q4_K || QT == T_Q5_K) {
        __m256i zl[4], zh[4];  // quant bytes 32 (s / 2) ..
        load_rows8(rows, off + RAW_AT<QT> + 32 * (s / 2), zl);
        load_rows8(rows, off + RAW_AT<QT> + 32 * (s / 2) + 16, zh);
        for (int a = 0; a < 4; a++) u->lo[a] = nib8(zl[a], 4 * (s & 1)), u->hi[a] = nib8(zh[a], 4 * (s & 1));
        if constexpr (QT == T_Q5_K) {
            const __m256i bit = _mm256_set1_epi8((char)(1 << s));
            for (int a = 0; a < 4; a++) {
                u->lo[a] = _mm256_or_si256(u->lo[a], bit16(h.qh[a], bit));
                u->hi[a] = _mm256_or_si256(u->hi[a], bit16(h.qh[4 + a], bit));
            }
        }
        u->dw = h.dw[s], u->mw = h.mw[s];
    } else {  // Q6_K: sub-block s = 32 hh + (c: 0..3), low 4 bits from ql, high 2 bits from qh; u = q (0..63)
        const int hh = s / 4, c = s % 4;
        const __m256i *l0 = h.raw[4 * hh + 2 * (c & 1)], *l1 = h.raw[4 * hh + 2 * (c & 1) + 1];  // ql 64 hh + 32 (c & 1)
        const __m256i *h0 = h.raw[8 + 2 * hh], *h1 = h.raw[9 + 2 * hh];                        // qh 32 hh
        // qh bits 2c, 2c + 1 to bits 4, 5 (a 16-bit shift; what crosses into the other byte is masked off)
        const __m256i m30 = _mm256_set1_epi8(0x30);
        const auto high2 = [&](__m256i v) {
            return _mm256_and_si256(c < 3 ? _mm256_slli_epi16(v, 4 - 2 * c) : _mm256_srli_epi16(v, 2), m30);
        };
        for (int a = 0; a < 4; a++) {
            u->lo[a] = _mm256_or_si256(nib8(l0[a], (c >> 1) * 4), high2(h0[a]));
            u->hi[a] = _mm256_or_si256(nib8(l1[a], (c >> 1) * 4), high2(h1[a]));
        }
        const __m256i sc = h.sc[s / 2];  // scales 2s (elements 0..15) and 2s + 1 (16..31): bytes 2 (s % 2), + 1
        u->sl = _mm256_srai_epi32(_mm256_slli_epi32(sc, 24 - 16 * (s % 2)), 24);
        u->sh = _mm256_srai_epi32(_mm256_slli_epi32(sc, 16 - 16 * (s % 2)), 24);
        u->dw = h.dw[0];
    }
}

// A unit's weight bytes as dot8's unsigned operand: Q8_0's |w| (its sign moves to x) or w + 128 (U128);
// the other formats' u as they are.
template <int QT>
KVLM_INLINE __m256i unsigned8(__m256i v) {
    if constexpr (F2<QT>::U128) return _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));
    else if constexpr (F2<QT>::SIGNED) return _mm256_abs_epi8(v);
    else return v;
}

// The integer start of a row's unit sum (lo: all 32 elements, or Q6_K's 0..15; hi: Q6_K's 16..31).
template <int QT>
KVLM_INLINE __m256i init_lo8(const ActRows& a, const int32_t* l16, int64_t r) {
    if constexpr (F2<QT>::Q6) return _mm256_set1_epi32(-32 * l16[r]);
    else if constexpr (F2<QT>::U128) return _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_set1_epi32(a.xi[r]), 7));
    else if constexpr (F2<QT>::OFF != 0)  // OFF * xi as a broadcast load and a shift (OFF = -8 or -16)
        return _mm256_sub_epi32(_mm256_setzero_si256(),
                                _mm256_slli_epi32(_mm256_set1_epi32(a.xi[r]), F2<QT>::OFF == -8 ? 3 : 4));
    else return _mm256_setzero_si256();
}
KVLM_INLINE __m256i init_hi8(const ActRows& a, const int32_t* l16, int64_t r) {
    return _mm256_set1_epi32(-32 * (a.xi[r] - l16[r]));
}

// The float part of the contract for one unit of one row of x (ActRows index r).
KVLM_INLINE void finish8(__m256i isum, __m256 dw, const ActRows& a, int64_t r, __m256* acc) {
    *acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(isum), dw), _mm256_set1_ps(a.xd[8 * r]), *acc);
}

// Few rows: unit ib of MT rows of x (from the first row of `a`) against the 8 rows in place.
template <int QT, int MT>
KVLM_INLINE void direct8(const Unit8& u, const ActRows& a, const int32_t* l16, int64_t ib, __m256* acc, __m256* mn) {
    using F = F2<QT>;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i al[4], ah[4];  // the unsigned bytes
    for (int j = 0; j < 4; j++) {
        al[j] = unsigned8<QT>(u.lo[j]);
        ah[j] = unsigned8<QT>(u.hi[j]);
    }
    for (int i = 0; i < MT; i++) {
        const int64_t r = i * a.nb + ib;
        const int8_t* xp = a.xq + i * a.K + 32 * ib;
        const __m256i xl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)xp));
        const __m256i xh = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(xp + 16)));
        __m256i isum;
        if constexpr (F::Q6) {
            __m256i sl[4], sh[4];
            for (int j = 0; j < 4; j++)
                sl[j] = dot8(_mm256_setzero_si256(), al[j], xl), sh[j] = dot8(_mm256_setzero_si256(), ah[j], xh);
            const __m256i lo = _mm256_add_epi32(init_lo8<QT>(a, l16, r), sum_rows8(sl));
            const __m256i hi = _mm256_add_epi32(init_hi8(a, l16, r), sum_rows8(sh));
            isum = _mm256_add_epi32(_mm256_mullo_epi32(lo, u.sl), _mm256_mullo_epi32(hi, u.sh));
        } else {
            __m256i s[4];
            for (int j = 0; j < 4; j++) {
                if constexpr (F::SIGNED && !F::U128)
                    s[j] = dot8(dot8(_mm256_setzero_si256(), al[j], _mm256_sign_epi8(xl, u.lo[j])), ah[j],
                                _mm256_sign_epi8(xh, u.hi[j]));
                else if constexpr (VNNI8)
                    s[j] = dot8(dot8(_mm256_setzero_si256(), al[j], xl), ah[j], xh);
                else  // 2 products per int16 lane (G >= 2)
                    s[j] = _mm256_madd_epi16(
                        _mm256_add_epi16(_mm256_maddubs_epi16(al[j], xl), _mm256_maddubs_epi16(ah[j], xh)), ones);
            }
            isum = _mm256_add_epi32(init_lo8<QT>(a, l16, r), sum_rows8(s));
        }
        finish8(isum, u.dw, a, r, acc + i);
        if constexpr (F::MIN) mn[i] = _mm256_fmadd_ps(u.mw, _mm256_set1_ps(a.xs[r]), mn[i]);
    }
}

// Many rows: a unit transposed once (v[j] lane c = row c's elements 4j .. 4j + 3; Q8_0: signed).
// Q6_K's sub-scales as int16 pairs, for madd in place of the widening madd by ones (tile_unit8): sl, sh
// dword c = row c's scale in both halves; so dword c = (sl_c, sh_c).
struct Panel8 {
    __m256i v[8];
    __m256 dw, mw;
    __m256i sl, sh, so;
};

// Each int32 lane's low 16 bits twice (a small signed value as an int16 pair).
KVLM_INLINE __m256i pair16(__m256i v) {
    return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(v, 16));
}

template <int QT>
KVLM_INLINE void prep8(const Unit8& u, Panel8* p) {
    transpose8(u.lo, p->v);
    transpose8(u.hi, p->v + 4);
    p->dw = u.dw, p->mw = u.mw;
    if constexpr (F2<QT>::Q6) {
        p->sl = pair16(u.sl), p->sh = pair16(u.sh);
        p->so = _mm256_or_si256(_mm256_and_si256(u.sl, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(u.sh, 16));
    }
}

// Unit ib of rows m0 .. m0 + MT - 1 against NP prepared panels side by side (p[q]: panel q's unit ib; NP = 2:
// 16 output columns, each broadcast of x serving 2 maddubs): x's 4 bytes broadcast per v[j], G products summed
// in int16, then widened. acc[i * NP + q]: row m0 + i, panel q.
template <int QT, int MT, int NP>
KVLM_INLINE void tile_unit8(const Panel8* const* p, const ActRows& a, const int32_t* l16, int64_t m0, int64_t ib,
                            __m256* acc) {
    using F = F2<QT>;
    const __m256i ones = _mm256_set1_epi16(1);
    // Q6_K: one int32 sum a row, its sub-scales applied in the widening madd (an int16 lane holds G = 2
    // maddubs: |4 u q| <= 4 * 63 * 127 < 2^15), and its start -32 (sl sum_lo q + sh sum_hi q) as one madd of
    // the pair (sum_lo q, sum_hi q) (|.| <= 16 * 127) against `so`: the same integer as direct8's
    // sl (lo) + sh (hi), with no mullo and no second sum to keep in registers (1.15x at M = 512, 1 thread, Zen 5).
    __m256i lo[MT * NP];
    for (int i = 0; i < MT; i++)
        for (int q = 0; q < NP; q++) {
            const int64_t r = (m0 + i) * a.nb + ib;
            if constexpr (F::Q6) {
                const uint32_t lo16 = (uint32_t)l16[r] & 0xffff, hi16 = (uint32_t)(a.xi[r] - l16[r]) << 16;
                const __m256i x2 = _mm256_set1_epi32((int32_t)(lo16 | hi16));
                lo[i * NP + q] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(x2, p[q]->so), 5));
            } else {
                lo[i * NP + q] = init_lo8<QT>(a, l16, r);
            }
        }
    const int8_t* xb = a.xq + m0 * a.K + 32 * ib;
    // AVX-VNNI: one vpdpbusd per 4 products, straight into the row's int32 sum (all 8 j in one group), or
    // for Q6_K into an int32 sum per 16-element half (j0 = 0, 4), then times its sub-scale (vpmulld).
    constexpr bool DP = VNNI8 && !F::Q6, DP6 = VNNI8 && F::Q6;
    constexpr int G = DP ? 8 : DP6 ? 4 : F::G;
    for (int j0 = 0; j0 < 8; j0 += G) {
        __m256i s16[MT * NP];  // int16 sums of G products a lane (DP6: int32 sums)
#pragma GCC unroll 8
        for (int j = j0; j < j0 + G; j++) {
            __m256i w[NP];
            for (int q = 0; q < NP; q++) w[q] = unsigned8<QT>(p[q]->v[j]);
            for (int i = 0; i < MT; i++) {
                int32_t q4;
                memcpy(&q4, xb + i * a.K + 4 * j, 4);
                const __m256i x = _mm256_set1_epi32(q4);
                for (int q = 0; q < NP; q++) {
                    const __m256i xs = F::SIGNED && !F::U128 ? _mm256_sign_epi8(x, p[q]->v[j]) : x;
                    if constexpr (DP) {
                        lo[i * NP + q] = dot8(lo[i * NP + q], w[q], xs);
                        continue;
                    }
                    if constexpr (DP6) {
                        s16[i * NP + q] = dot8(j == j0 ? _mm256_setzero_si256() : s16[i * NP + q], w[q], xs);
                        continue;
                    }
                    const __m256i d = _mm256_maddubs_epi16(w[q], xs);
                    __m256i& t = s16[i * NP + q];
                    t = j == j0 ? d : _mm256_add_epi16(t, d);
                    // Keeps GCC from re-associating the int16 sums into a tree that computes all the
                    // products first and spills most of them (1.3x slower at M = 512; the sum is the same).
                    __asm__("" : "+x"(t));
                }
            }
        }
        if constexpr (DP6)
            for (int i = 0; i < MT; i++)
                for (int q = 0; q < NP; q++) {  // sl / sh hold the sub-scale in both int16 halves
                    const __m256i f = _mm256_srai_epi32(j0 < 4 ? p[q]->sl : p[q]->sh, 16);
                    lo[i * NP + q] = _mm256_add_epi32(lo[i * NP + q], _mm256_mullo_epi32(s16[i * NP + q], f));
                }
        else if constexpr (!DP)
            for (int i = 0; i < MT; i++)
                for (int q = 0; q < NP; q++) {
                    const __m256i f = F::Q6 ? (j0 < 4 ? p[q]->sl : p[q]->sh) : ones;
                    lo[i * NP + q] = _mm256_add_epi32(lo[i * NP + q], _mm256_madd_epi16(s16[i * NP + q], f));
                }
    }
    for (int k = 0; k < MT * NP; k++) finish8(lo[k], p[k % NP]->dw, a, (m0 + k / NP) * a.nb + ib, acc + k);
}

// Row i's 8 outputs (live of them: a tail panel's extra lanes are dropped) at y + i * ldy.
template <int QT, int MT>
KVLM_INLINE void store8(const __m256* acc, const __m256* mn, float* y, int64_t ldy, int live) {
    for (int i = 0; i < MT; i++) {
        const __m256 v = F2<QT>::MIN ? _mm256_add_ps(acc[i], mn[i]) : acc[i];
        if (live == 8) {
            _mm256_storeu_ps(y + i * ldy, v);
        } else {
            float t[8];
            _mm256_storeu_ps(t, v);
            memcpy(y + i * ldy, t, 4 * live);
        }
    }
}

// Prefetch slice b of the range [ahead, ahead + nb * STEP) into L2: the panel PF_PANELS ahead, a slice per
// block, so the 8 rows read side by side arrive in time (the hardware prefetcher follows few of 8
// interleaved streams). A fixed ceil(STEP / 64) lines from the slice's first line cover it (the next
// slice's first line is at most that far on) with no branch. Callers skip it once `ahead` passes the
// range's end; the last slice's lines may reach past it: a prefetch is only a hint, it never faults.
template <int64_t STEP>
KVLM_INLINE void prefetch_slice8(const uint8_t* ahead, int64_t b) {
    const uint8_t* p = (const uint8_t*)((uintptr_t)(ahead + b * STEP) & ~(uintptr_t)63);
#pragma GCC unroll 32
    for (int64_t l = 0; l < (STEP + 63) / 64; l++) _mm_prefetch((const char*)(p + 64 * l), _MM_HINT_T1);
}

constexpr int64_t FLY_ROWS2 = 4;  // up to this many rows of x: units used in place, else the panel buffer
// Rows per pass over the buffer, with NP panels side by side.
template <int NP>
constexpr int64_t ROW_TILE2 = 4;
// Panels side by side in the many-row mode: 2 (1.25x to 1.35x at M = 512 on Q4_0 / Q4_K against 1); Q8_0 1 (x
// signed per panel spills: 0.94x to 0.98x with 2); Q6_K 1 (2 measured alike since its sums are one per row).
template <int QT>
constexpr int PANELS2 = QT == T_Q6_K || QT == T_Q8_0 ? 1 : 2;
constexpr int64_t PF_PANELS = 2;  // decode prefetches the panel this many ahead (1, 4, 8: measured alike)

// The first PF_PANELS panels of columns [n0, n1) into L2 (the panel loops prefetch PF_PANELS ahead from there).
KVLM_INLINE void prefetch_first_panels8(const uint8_t* w, int64_t rs, int64_t n0, int64_t n1) {
    for (const uint8_t* p = (const uint8_t*)((uintptr_t)(w + n0 * rs) & ~(uintptr_t)63);
         p < w + (n1 < n0 + 8 * PF_PANELS ? n1 : n0 + 8 * PF_PANELS) * rs; p += 64)
        _mm_prefetch((const char*)p, _MM_HINT_T1);
}

// The 8 weight rows of the panel at column n (a tail panel's lanes past n1 repeat its last row); returns how
// many of its columns are live.
KVLM_INLINE int panel_rows8(const uint8_t* w, int64_t rs, int64_t n, int64_t n1, const uint8_t** rows) {
    const int live = n1 - n < 8 ? (int)(n1 - n) : 8;
    for (int c = 0; c < 8; c++) rows[c] = w + (n + (c < live ? c : live - 1)) * rs;
    return live;
}

// Few rows: every unit decoded and used at once, for MT rows of x.
template <int QT, int MT>
void fly8(const uint8_t* const* rows, const uint8_t* ahead, const uint8_t* end, const ActRows& a,
          const int32_t* l16, float* y, int64_t ldy, int live) {
    using F = F2<QT>;
    __m256 acc[MT], mn[MT];
    for (int i = 0; i < MT; i++) acc[i] = mn[i] = _mm256_setzero_ps();
    Head8 h;
    Unit8 u;
    u.mw = _mm256_setzero_ps(), u.sl = u.sh = _mm256_setzero_si256();
    for (int64_t b = 0; b < a.nb / F::SUB; b++) {
        if (ahead < end) prefetch_slice8<8 * F::BB>(ahead, b);
        head8<QT>(rows, b * F::BB, &h);
        // Unrolled: a K-quant unit's shift counts, raw[] chunks and branches (s & 1, Q6_K's c) become constants.
#pragma GCC unroll 8
        for (int s = 0; s < F::SUB; s++) {
            unit8<QT>(rows, b * F::BB, s, h, &u);
            direct8<QT, MT>(u, a, l16, b * F::SUB + s, acc, mn);
        }
    }
    store8<QT, MT>(acc, mn, y, ldy, live);
}

// Rows m0 .. m0 + MT - 1 against NP prepared panels (buf + q * nb: panel q, its outputs at y + 8 q, live[q]
// of them), the min terms in their own pass: the same fma sequence per output as direct8's, with fewer
// registers live in the integer loop.
template <int QT, int MT, int NP>
void tile8(const Panel8* buf, const ActRows& a, const int32_t* l16, int64_t m0, float* y, int64_t ldy, const int* live) {
    __m256 acc[MT * NP], mn[MT * NP];
    for (int k = 0; k < MT * NP; k++) acc[k] = mn[k] = _mm256_setzero_ps();
    for (int64_t ib = 0; ib < a.nb; ib++) {
        const Panel8* p[NP];
        for (int q = 0; q < NP; q++) p[q] = buf + q * a.nb + ib;
        tile_unit8<QT, MT, NP>(p, a, l16, m0, ib, acc);
    }
    if constexpr (F2<QT>::MIN)
        for (int q = 0; q < NP; q++)
            for (int64_t ib = 0; ib < a.nb; ib++)
                for (int i = 0; i < MT; i++)
                    mn[i * NP + q] = _mm256_fmadd_ps(buf[q * a.nb + ib].mw, _mm256_set1_ps(a.xs[(m0 + i) * a.nb + ib]),
                                                     mn[i * NP + q]);
    for (int q = 0; q < NP; q++) {
        __m256 aq[MT], mq[MT];
        for (int i = 0; i < MT; i++) aq[i] = acc[i * NP + q], mq[i] = mn[i * NP + q];
        store8<QT, MT>(aq, mq, y + m0 * ldy + 8 * q, ldy, live[q]);
    }
}

// All M rows against NP prepared panels: tiles of ROW_TILE2<NP> rows, then the rest.
template <int QT, int NP>
void tiles8(const Panel8* buf, const ActRows& a, const int32_t* l16, int64_t M, float* y, int64_t ldy, const int* live) {
    constexpr int64_t T = ROW_TILE2<NP>;
    int64_t m = 0;
    for (; m + T <= M; m += T) tile8<QT, T, NP>(buf, a, l16, m, y, ldy, live);
    switch (M - m) {
        case 1: tile8<QT, 1, NP>(buf, a, l16, m, y, ldy, live); break;
        case 2: tile8<QT, 2, NP>(buf, a, l16, m, y, ldy, live); break;
        case 3: if constexpr (T > 3) tile8<QT, 3, NP>(buf, a, l16, m, y, ldy, live); break;
        default: break;
    }
}


// ---- Q8_0, many rows, plain AVX2: int16 pairs ------------------------------------------------------------
// Q8_0's weights are signed bytes, so tile_unit8 moves each product's sign to x before maddubs (unsigned x
// signed): abs, sign, maddubs, madd and an add per 32 products, with 2 KB of x per unit no register can keep.
// Here the panel is widened to int16 once (and x once per call): a pair of products is one madd (pmaddwd)
// into the int32 sum, 2 madd and 2 adds per 32 products, no sign flips, so 16 columns (2 panels) fit in
// registers against 4 rows. The sums are the same integers (|isum| <= 32 * 128 * 127) and finish8 takes them
// as before: the same bits. 1.1-1.3x on the default model's shapes at M = 512 (docs/kernels.md, "AVX2").
// AVX-VNNI keeps tile_unit8's w + 128 form (one vpdpbusd per 32 products).
struct PanelW8 {
    __m256i w[16];  // w[t] lane c: row c's elements 2 t and 2 t + 1 as an int16 pair
    __m256 dw;
};

// v[j] lane c = row c's bytes (e0 e1 e2 e3) = elements 4 j .. 4 j + 3 (prep8's transpose), each as two words
// (e0 | e1 << 8, e2 | e3 << 8): the even bytes sign-extended in their words (lo) and the odd ones (hi), then
// the pairs (e0, e1) and (e2, e3) blended from them.
KVLM_INLINE void prep_w8(const Unit8& u, PanelW8* p) {
    __m256i v[8];
    transpose8(u.lo, v);
    transpose8(u.hi, v + 4);
    for (int j = 0; j < 8; j++) {
        const __m256i lo = _mm256_srai_epi16(_mm256_slli_epi16(v[j], 8), 8);  // words: e0, e2
        const __m256i hi = _mm256_srai_epi16(v[j], 8);                        // words: e1, e3
        p->w[2 * j] = _mm256_blend_epi16(lo, _mm256_slli_epi32(hi, 16), 0xaa);
        p->w[2 * j + 1] = _mm256_blend_epi16(_mm256_srli_epi32(lo, 16), hi, 0xaa);
    }
    p->dw = u.dw;
}

// Unit ib of rows m0 .. m0 + MT - 1 against NP widened panels side by side; x16 = x as int16, rows K apart.
template <int MT, int NP>
KVLM_INLINE void tile_unit_w8(const PanelW8* const* p, const ActRows& a, const int16_t* x16, int64_t m0, int64_t ib,
                              __m256* acc) {
    __m256i s[MT * NP];
    for (int k = 0; k < MT * NP; k++) s[k] = _mm256_setzero_si256();
    const int16_t* xb = x16 + m0 * a.K + 32 * ib;
#pragma GCC unroll 16
    for (int t = 0; t < 16; t++) {
        __m256i w[NP];
        for (int q = 0; q < NP; q++) w[q] = p[q]->w[t];
        for (int i = 0; i < MT; i++) {
            int32_t x2;
            memcpy(&x2, xb + i * a.K + 2 * t, 4);
            const __m256i x = _mm256_set1_epi32(x2);
            for (int q = 0; q < NP; q++) {
                __m256i& sum = s[i * NP + q];
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(w[q], x));
                __asm__("" : "+x"(sum));  // one chain a sum, as tile_unit8's (else GCC spills a tree of products)
            }
        }
    }
    for (int k = 0; k < MT * NP; k++) finish8(s[k], p[k % NP]->dw, a, (m0 + k / NP) * a.nb + ib, acc + k);
}

template <int MT, int NP>
void tile_w8(const PanelW8* buf, const ActRows& a, const int16_t* x16, int64_t m0, float* y, int64_t ldy,
             const int* live) {
    __m256 acc[MT * NP];
    for (int k = 0; k < MT * NP; k++) acc[k] = _mm256_setzero_ps();
    for (int64_t ib = 0; ib < a.nb; ib++) {
        const PanelW8* p[NP];
        for (int q = 0; q < NP; q++) p[q] = buf + q * a.nb + ib;
        tile_unit_w8<MT, NP>(p, a, x16, m0, ib, acc);
    }
    for (int q = 0; q < NP; q++) {
        __m256 aq[MT];
        for (int i = 0; i < MT; i++) aq[i] = acc[i * NP + q];
        store8<T_Q8_0, MT>(aq, aq, y + m0 * ldy + 8 * q, ldy, live[q]);  // Q8_0 has no min term
    }
}

constexpr int64_t ROW_TILE_W8 = 4;
constexpr int PANELS_W8 = 2;

template <int NP>
void tiles_w8(const PanelW8* buf, const ActRows& a, const int16_t* x16, int64_t M, float* y, int64_t ldy,
              const int* live) {
    constexpr int64_t T = ROW_TILE_W8;
    int64_t m = 0;
    for (; m + T <= M; m += T) tile_w8<T, NP>(buf, a, x16, m, y, ldy, live);
    switch (M - m) {
        case 1: tile_w8<1, NP>(buf, a, x16, m, y, ldy, live); break;
        case 2: tile_w8<2, NP>(buf, a, x16, m, y, ldy, live); break;
        case 3: tile_w8<3, NP>(buf, a, x16, m, y, ldy, live); break;
        default: break;
    }
}

// ---- Q6_K at one row of x (decode): weight rows whole, two streams a panel -------------------------------
// fly8 reads a block of each of the 8 rows in turn: 8 streams side by side, the panel after next prefetched a
// slice per block. Here, as AVX-512's kq_stream (kernels_kquant.h): stream q reads rows 4 q .. 4 q + 3 whole,
// one after another, a super-block of each stream in turn, each prefetching its own bytes STREAM_AHEAD on
// (prefetch_stream, kernels_kquant.h).
// A row's super-block is 8 ymm of u in x's element order (u[s]: unit s, elements 32 s .. 32 s + 31, against
// x's block 8 b + s as stored); each unit's products go to 8 int32 lanes (maddubs, |2 u q| <= 2 * 63 * 127 <
// 2^15, then madd with its two int8 sub-scales as int16: sl on elements 0..15, sh on 16..31), the 8 units are
// reduced to one ymm (lane s: unit s) and the offset -32 (sl sum_lo q + sh sum_hi q) comes in as one madd of
// the row's 16 sub-scales with x's 16-element sums (x16). That is direct8's integer isum, kept per (row of x,
// super-block, weight row) in the thread's scratch S. Pass 2, per super-block: an 8 x 8 transpose (lane c:
// weight row c) and finish8 unit after unit, as direct8: the same integers and fma order, so the same bits.
// Why (1B/3B/8B shapes, 2 threads, the Xeon, `gbs.sh` against fly8, docs/kernels.md "Q6_K decode in two
// streams"): Q6_K at M = 1 1.03-1.38x from memory (avx2), 1.03-1.20x (avx2-vnni); at M = 2 and 3 0.91-1.00x
// (compute-bound there: fly8 keeps them). Q4_K the same way measured 0.99-1.01x from memory and 0.91x hot (its
// units are cheap in fly8's layout, and the per-row reduction costs shuffles), so Q4_K keeps fly8 on the file's
// layout; packed in panels it has its own kernel (kernels_kquant_panels_avx2.h).
constexpr int STREAM8_WAYS = 2;
struct alignas(32) YV {
    __m256i v;
};

// Lane s of the result: the sum of v[s]'s 8 int32 lanes.
KVLM_INLINE __m256i sum_units8(const __m256i v[8]) {
    __m256i t[4];
    for (int k = 0; k < 4; k++)
        t[k] = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2 * k], v[2 * k + 1]), _mm256_unpackhi_epi32(v[2 * k], v[2 * k + 1]));
    const __m256i u0 = _mm256_add_epi32(_mm256_unpacklo_epi64(t[0], t[1]), _mm256_unpackhi_epi64(t[0], t[1]));
    const __m256i u1 = _mm256_add_epi32(_mm256_unpacklo_epi64(t[2], t[3]), _mm256_unpackhi_epi64(t[2], t[3]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// 8 x 8 int32 transpose: t[j] lane c = z[c] lane j.
KVLM_INLINE void transpose88(const __m256i z[8], __m256i t[8]) {
    __m256i a[8], b[8];
    for (int k = 0; k < 4; k++) {
        a[2 * k] = _mm256_unpacklo_epi32(z[2 * k], z[2 * k + 1]);
        a[2 * k + 1] = _mm256_unpackhi_epi32(z[2 * k], z[2 * k + 1]);
    }
    for (int k = 0; k < 2; k++) {  // b[4 k + j], 128-bit lane L: rows 4 k .. 4 k + 3 of lane 4 L + j
        b[4 * k + 0] = _mm256_unpacklo_epi64(a[4 * k + 0], a[4 * k + 2]);
        b[4 * k + 1] = _mm256_unpackhi_epi64(a[4 * k + 0], a[4 * k + 2]);
        b[4 * k + 2] = _mm256_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
        b[4 * k + 3] = _mm256_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
    }
    for (int j = 0; j < 4; j++) {
        t[j] = _mm256_permute2x128_si256(b[j], b[4 + j], 0x20);
        t[j + 4] = _mm256_permute2x128_si256(b[j], b[4 + j], 0x31);
    }
}

// One Q6_K row's super-block at q as 8 ymm of u (0..63), u[s] = elements 32 s .. 32 s + 31 in order. Half hh:
// ql A = bytes 64 hh .. + 31, B = 64 hh + 32 .. + 63, qh H = 128 + 32 hh .. + 31; units 4 hh + 0..3 take A's
// and B's low nibbles, then their high nibbles, with H's bit pairs 0-1, 2-3, 4-5, 6-7 on top (16-bit shifts,
// the bits that cross bytes masked off).
KVLM_INLINE void q6_units8(const uint8_t* q, __m256i u[8]) {
    const __m256i m0f = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    for (int hh = 0; hh < 2; hh++) {
        const __m256i A = _mm256_loadu_si256((const __m256i*)(q + 64 * hh));
        const __m256i B = _mm256_loadu_si256((const __m256i*)(q + 64 * hh + 32));
        const __m256i H = _mm256_loadu_si256((const __m256i*)(q + 128 + 32 * hh));
        u[4 * hh + 0] = _mm256_or_si256(_mm256_and_si256(A, m0f), _mm256_and_si256(_mm256_slli_epi16(H, 4), m30));
        u[4 * hh + 1] = _mm256_or_si256(_mm256_and_si256(B, m0f), _mm256_and_si256(_mm256_slli_epi16(H, 2), m30));
        u[4 * hh + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), m0f), _mm256_and_si256(H, m30));
        u[4 * hh + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), m0f),
                                        _mm256_and_si256(_mm256_srli_epi16(H, 2), m30));
    }
}

void q6_stream8(const uint8_t* const* rows, const uint8_t* end, const ActRows& a, const YV* x16, YV* S, float* y,
                int live) {
    constexpr int64_t BB = KQ<T_Q6_K>::BB;
    constexpr int RW = 8 / STREAM8_WAYS;  // rows a stream
    const int64_t nsb = a.nb / 8;
    // unit s's madd factor: int16 lanes 0..7 its scale 2 s, lanes 8..15 scale 2 s + 1, picked by pshufb from
    // the 16 scales as int16 with both 128-bit halves holding scales 0..7 (s < 4) or 8..15
    const __m256i pick[4] = {
        _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3),
        _mm256_setr_epi8(4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7),
        _mm256_setr_epi8(8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11,
                         10, 11, 10, 11),
        _mm256_setr_epi8(12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 14, 15, 14, 15, 14, 15, 14, 15,
                         14, 15, 14, 15, 14, 15, 14, 15)};
    for (int r = 0; r < RW; r++) {
        for (int64_t b = 0; b < nsb; b++) {
            for (int q = 0; q < STREAM8_WAYS; q++) {
                const int c = RW * q + r;
                const uint8_t* cur = rows[c] + b * BB;
                prefetch_stream<BB>(cur, end);
                __m256i u[8];
                q6_units8(cur, u);
                const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(cur + 192)));
                const __m256i s16[2] = {_mm256_permute2x128_si256(sc, sc, 0x00), _mm256_permute2x128_si256(sc, sc, 0x11)};
                const int8_t* xb = a.xq + 256 * b;
                __m256i p[8];
                for (int k = 0; k < 8; k++)
                    p[k] = _mm256_madd_epi16(_mm256_maddubs_epi16(u[k], _mm256_loadu_si256((const __m256i*)(xb + 32 * k))),
                                             _mm256_shuffle_epi8(s16[k / 4], pick[k % 4]));
                const __m256i off = _mm256_madd_epi16(x16[b].v, sc);  // lane s: sl sum_lo q + sh sum_hi q
                S[b * 8 + c].v = _mm256_sub_epi32(sum_units8(p), _mm256_slli_epi32(off, 5));
            }
        }
    }
    __m256 acc = _mm256_setzero_ps(), mn = acc;
    for (int64_t b = 0; b < nsb; b++) {  // pass 2, super-block after super-block
        const __m256 dw = halves8(rows, b * BB + 206, true);  // d at 208..209, as head8 reads it
        __m256i z[8], t[8];
        for (int c = 0; c < 8; c++) z[c] = S[b * 8 + c].v;
        transpose88(z, t);
        for (int s = 0; s < 8; s++) finish8(t[s], dw, a, 8 * b + s, &acc);
    }
    store8<T_Q6_K, 1>(&acc, &mn, y, 0, live);
}

// q6_stream8's x16 for the row of x: per super-block 16 int16, lanes 2 s and 2 s + 1: unit s's sums of q over
// its elements 0..15 and 16..31 (|.| <= 16 * 127).
KVLM_INLINE void x16_sums(const ActRows& a, const int32_t* l16, YV* x16) {
    for (int64_t b = 0; b < a.nb / 8; b++) {
        alignas(32) int16_t v[16];
        for (int s = 0; s < 8; s++) {
            const int64_t r = 8 * b + s;
            v[2 * s] = (int16_t)l16[r], v[2 * s + 1] = (int16_t)(a.xi[r] - l16[r]);
        }
        x16[b].v = _mm256_load_si256((const __m256i*)v);
    }
}

// Q8_0 at more than FLY_ROWS2 rows on plain AVX2: gemm_avx2_t's buffer path with widened panels (PanelW8), W8_ROWS
// rows of x at a time (their int16 copy, 2 W8_ROWS K bytes a thread, stays in L2 at the default model's K; each
// chunk re-reads and re-widens the panels, which costs little next to 256 rows of products).
constexpr int64_t W8_ROWS = 256;

// False (nothing written) when its buffers cannot be had: the caller then takes the signed-byte tiles.
[[maybe_unused]] bool gemm_w8(const uint8_t* w, int64_t rs, const ActRows& a, int64_t M, float* y, int64_t ldy,
                              int64_t n0, int64_t n1) {
    constexpr int BB = F2<T_Q8_0>::BB;
    const int64_t K = a.K, nb = a.nb;
    PanelW8* buf = thread_buffer<PanelW8>(PANELS_W8 * nb);
    int16_t* x16 = thread_buffer<int16_t>((M < W8_ROWS ? M : W8_ROWS) * K);
    if (buf == nullptr || x16 == nullptr) return false;
    Head8 h;
    Unit8 u;
    for (int64_t m0 = 0; m0 < M; m0 += W8_ROWS) {
        const int64_t mc = M - m0 < W8_ROWS ? M - m0 : W8_ROWS;
        const ActRows am{a.xq + m0 * K, a.xd + 8 * m0 * nb, a.xs + m0 * nb, a.xi + m0 * nb, K, nb};
        for (int64_t e = 0; e < mc * K; e += 16)  // K is a multiple of 32
            _mm256_store_si256((__m256i*)(x16 + e), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(am.xq + e))));
        prefetch_first_panels8(w, rs, n0, n1);
        int filled = 0, lives[PANELS_W8];
        for (int64_t n = n0; n < n1; n += 8) {
            const uint8_t* rows[8];
            const int live = panel_rows8(w, rs, n, n1, rows);
            const uint8_t *ahead = w + (n + 8 * PF_PANELS) * rs, *end = w + n1 * rs;
            PanelW8* pb = buf + filled * nb;
            for (int64_t b = 0; b < nb; b++) {
                if (ahead < end) prefetch_slice8<8 * BB>(ahead, b);
                unit8<T_Q8_0>(rows, b * BB, 0, h, &u);
                prep_w8(u, pb + b);
            }
            lives[filled++] = live;
            if (filled == PANELS_W8 || n + 8 >= n1) {
                float* yf = y + m0 * ldy + n - 8 * (filled - 1);
                if (filled == 2) tiles_w8<2>(buf, am, x16, mc, yf, ldy, lives);
                else tiles_w8<1>(buf, am, x16, mc, yf, ldy, lives);
                filled = 0;
            }
        }
    }
    return true;
}

template <int QT>
void gemm_avx2_t(const uint8_t* w, int64_t rs, int64_t K, const int8_t* xq, const float* xd, const float* xs,
                 const int32_t* xi, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
    using F = F2<QT>;
    const ActRows a{xq, xd, xs, xi, K, K / 32};
    if constexpr (QT == T_Q8_0 && !VNNI8)
        if (M > FLY_ROWS2 && gemm_w8(w, rs, a, M, y, ldy, n0, n1)) return;  // int16 pairs (PanelW8)
    const int32_t* l16 = F::Q6 ? lo16_sums(a, M) : nullptr;
    if (F::Q6 && l16 == nullptr) return;
    // many rows: up to PANELS2 panels (8 columns each) transposed side by side, then every row against them
    Panel8* buf = M > FLY_ROWS2 ? thread_buffer<Panel8>(PANELS2<QT> * a.nb) : nullptr;
    // Q6_K at one row of x: q6_stream8's scratch, x16 (nb / 8) then S (nb / 8, 8)
    const bool stream = QT == T_Q6_K && M == 1;
    YV* zs = stream ? thread_buffer<YV>(a.nb / 8 * 9) : nullptr;
    if (stream && zs == nullptr) return;
    if (stream) x16_sums(a, l16, zs);
    int filled = 0, lives[2];
    prefetch_first_panels8(w, rs, n0, n1);  // then PF_PANELS ahead from there on, in both modes
    for (int64_t n = n0; n < n1; n += 8) {
        const uint8_t* rows[8];
        const int live = panel_rows8(w, rs, n, n1, rows);
        float* yp = y + n;
        const uint8_t *ahead = w + (n + 8 * PF_PANELS) * rs, *end = w + n1 * rs;
        if constexpr (QT == T_Q6_K) {
            if (stream) {  // Q6_K, one row: weight rows whole, two streams
                q6_stream8(rows, end, a, zs, zs + a.nb / 8, yp, live);
                continue;
            }
        }
        if (buf == nullptr) {  // few rows (or no buffer): 4 rows of x at a time
            for (int64_t m = 0; m < M; m += FLY_ROWS2) {
                const ActRows am{xq + m * K, xd + 8 * m * a.nb, xs + m * a.nb, xi + m * a.nb, K, a.nb};
                const int32_t* lm = l16 ? l16 + m * a.nb : nullptr;
                switch (M - m < FLY_ROWS2 ? M - m : FLY_ROWS2) {
                    case 1: fly8<QT, 1>(rows, ahead, end, am, lm, yp + m * ldy, ldy, live); break;
                    case 2: fly8<QT, 2>(rows, ahead, end, am, lm, yp + m * ldy, ldy, live); break;
                    case 3: fly8<QT, 3>(rows, ahead, end, am, lm, yp + m * ldy, ldy, live); break;
                    default: fly8<QT, 4>(rows, ahead, end, am, lm, yp + m * ldy, ldy, live); break;
                }
            }
            continue;
        }
        Panel8* pb = buf + filled * a.nb;
        Head8 h;
        Unit8 u;
        u.mw = _mm256_setzero_ps(), u.sl = u.sh = _mm256_setzero_si256();
        for (int64_t b = 0; b < a.nb / F::SUB; b++) {
            // As fly8: without it the 8 interleaved weight rows stream at the hardware prefetcher's pace,
            // and 5 to 8 rows (a speculative step's k + 1, a small batch) cost 2x 4 rows from memory.
            if (ahead < end) prefetch_slice8<8 * F::BB>(ahead, b);
            head8<QT>(rows, b * F::BB, &h);
            for (int s = 0; s < F::SUB; s++) {
                unit8<QT>(rows, b * F::BB, s, h, &u);
                prep8<QT>(u, pb + b * F::SUB + s);
            }
        }
        lives[filled++] = live;
        if (filled == PANELS2<QT> || n + 8 >= n1) {  // the panels at y + n - 8 (filled - 1) onwards
            float* yf = yp - 8 * (filled - 1);
            if (filled == 2) tiles8<QT, 2>(buf, a, l16, M, yf, ldy, lives);
            else tiles8<QT, 1>(buf, a, l16, M, yf, ldy, lives);
            filled = 0;
        }
    }
}

}  // namespace
