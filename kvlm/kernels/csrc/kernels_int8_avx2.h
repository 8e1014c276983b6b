// AVX2 int8-activation matmul for every int8 format (Q4_0, Q4_1, Q8_0 and kernels_kquant.h's Q5_0, Q5_1,
// Q4_K, Q5_K, Q6_K). Included by kernels_int8.h on the AVX2 unit, after the unit decoders (weights32,
// kq_head2, kq_unit2). Numerics: reference.qmatmul_int8_ref.
//
// Order contract of output (m, n) (unchanged since the AVX2 row kernel it replaces: the same bits), whatever
// M, the tile of weight rows or of rows of x, or the thread split. A *unit* ib is the 32 weights of row n
// that meet x's block ib, as bytes u (kq_unit2 / weights32: Q4 nibbles, Q5 5-bit values, Q8_0 and Q6_K
// signed, their sign moved onto x) with its scale dw and min factor mw (Q4_0: dw, times -8 at the end;
// Q5_0: -16 dw; Q4_1 / Q5_1: m; Q4_K / Q5_K: -(dmin m_s); none for Q8_0 and Q6_K):
//     p = madd(maddubs(u, x_ib), 1)       8 int32 lanes, lane l the exact sum over elements 4l .. 4l + 3
//                                         (Q6_K: times its sub-scale of elements 0..15 / 16..31)
//     acc[ib % 4] = fma(float(p) * dw, xd_ib, acc[ib % 4])        (8 lanes each)
//     mins[ib % 4] = fma(mw, xs_ib, mins[ib % 4])                 (scalars)
//     y = hsum8((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((mins[0] + mins[1]) + (mins[2] + mins[3]))
//         (Q4_0: + -8 times that sum; no min factor: + 0.0f)
//
// Work order (what changed): units are taken 4 at a time (8 for the K-quants: one super-block), so unit ib
// always lands in accumulator ib % 4 and all accumulators stay in registers; the 4 min terms are one
// 4-lane vector (lane j the scalar mins[j], the same fma per lane). Decode (one row of x) runs a weight row
// per pass and prefetches the rows PF_BYTES ahead at the offset being read (dot_tile can also take 2
// weight rows sharing each x block: measured no faster, and 25% slower on Q8_0 at K = 576).
// More rows of x: 1 weight row against 2 rows of x (each unit decoded once for both), over panels of
// 32 weight rows kept in L2 while the tiles of x pass.

namespace {

// The 16-bit halves at p + k * stride (k = 0..3) as 4 floats: 4 blocks' scales (or mins) in one convert.
KVLM_INLINE __m128 f16x4(const uint8_t* p, int64_t stride) {
    uint16_t h[4];
    for (int k = 0; k < 4; k++) memcpy(h + k, p + k * stride, 2);
    uint64_t v;
    memcpy(&v, h, 8);
    return _mm_cvtph_ps(_mm_cvtsi64_si128((long long)v));
}

template <int QT>
constexpr int block_bytes2() {
    if constexpr (QT == T_Q4_0 || QT == T_Q4_1 || QT == T_Q8_0) return I8Fmt<QT>::BB;
    else return KQ<QT>::BB;
}

// What the kernel needs of one weight row's unit ib: the bytes u (unsigned, or signed with SIGNED), the
// scale dw, min factor mw, and Q6_K's sub-scales sc. The 32-element formats decode 4 blocks' halves at
// once (Head4: unit s of the group of 4), the K-quants one super-block (KHead2).
template <int QT>
struct Src2 {
    static constexpr bool K = QT == T_Q4_K || QT == T_Q5_K || QT == T_Q6_K;
    static constexpr int GROUP = K ? 8 : 4;  // units per pass: one super-block, or 4 blocks
    static constexpr int BB = block_bytes2<QT>();
    static constexpr int UB = K ? BB : 4 * BB;  // bytes of one group
    static constexpr bool SIGNED = QT == T_Q8_0 || QT == T_Q6_K;
    static constexpr bool MINS = QT != T_Q8_0 && QT != T_Q6_K;
    struct Head {
        KHead2 k;           // K-quants
        __m128 dw4, mw4;    // 32-element formats: the 4 blocks' scales and min factors
        __m128i sc16;       // Q6_K: the 16 int8 sub-scales
    };
    // The group of units starting at `g` (a block for the K-quants, 4 blocks otherwise).
    KVLM_INLINE void head(const uint8_t* g, Head* h) {
        if constexpr (QT == T_Q4_K || QT == T_Q5_K) kq_head2<QT>(g, &h->k);
        else if constexpr (QT == T_Q6_K) {
            h->k.dw[0] = f16(g + 208);
            h->sc16 = _mm_loadu_si128((const __m128i*)(g + 192));
        } else {
            h->dw4 = f16x4(g, BB);
            if constexpr (QT == T_Q4_1 || QT == T_Q5_1) h->mw4 = f16x4(g + 2, BB);
            else if constexpr (QT == T_Q5_0) h->mw4 = _mm_mul_ps(_mm_set1_ps(-16.0f), h->dw4);
            else h->mw4 = h->dw4;  // Q4_0: dw, times -8 at the end (Q8_0: unused)
        }
    }
    KVLM_INLINE __m256i unit(const uint8_t* g, int s, const Head&) {
        if constexpr (QT == T_Q4_0 || QT == T_Q4_1 || QT == T_Q8_0) return weights32<QT>(g + s * BB);
        else if constexpr (K) return kq_unit2<QT>(g, s);
        else return kq_unit2<QT>(g + s * BB, 0);
    }
    KVLM_INLINE float dw(const Head& h, int s) {
        if constexpr (QT == T_Q6_K) return h.k.dw[0];
        else if constexpr (K) return h.k.dw[s];
        else return h.dw4[s];
    }
    // The 4 min factors of units s0 .. s0 + 3 (lane j: unit s0 + j).
    KVLM_INLINE __m128 mw4(const Head& h, int s0) {
        if constexpr (K) return _mm_loadu_ps(h.k.mw + s0);
        else return h.mw4;
    }
    // Q6_K: int32 lanes 0..3 sub-scale 2s (elements 0..15), lanes 4..7 sub-scale 2s + 1.
    KVLM_INLINE __m256i sc(const Head& h, int s) {
        const __m128i pick = _mm_add_epi8(_mm_set1_epi8((char)(2 * s)),
                                          _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0));
        return _mm256_cvtepi8_epi32(_mm_shuffle_epi8(h.sc16, pick));
    }
};

// One unit of one weight row against MT rows of x: the contract's acc update (unit ib, accumulator j).
template <int QT, int MT>
KVLM_INLINE void unit_rows(__m256i u, float dws, __m256i sc, const int8_t* xq, int64_t ldq, const float* xd, int64_t ldb,
                           int64_t ib, __m256* acc /* [MT][4] */, int j) {
    const __m256i au = Src2<QT>::SIGNED ? _mm256_sign_epi8(u, u) : u;
    const __m256 dw = _mm256_set1_ps(dws);
    for (int i = 0; i < MT; i++) {
        __m256i x = _mm256_loadu_si256((const __m256i*)(xq + i * ldq + ib * 32));
        if constexpr (Src2<QT>::SIGNED) x = _mm256_sign_epi8(x, u);  // w's sign onto x
        __m256i d = dot256(au, x);
        if constexpr (QT == T_Q6_K) d = _mm256_mullo_epi32(d, sc);
        const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(d), dw);
        acc[4 * i + j] = _mm256_fmadd_ps(f, _mm256_loadu_ps(xd + (i * ldb + ib) * 8), acc[4 * i + j]);
    }
}

KVLM_INLINE void prefetch_range(const uint8_t* p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch((const char*)(p + off), _MM_HINT_T0);
}

// R weight rows (row r at w + r * rs) against MT rows of x (row i at xq + i * ldq, scales at xd / xs + i
// * ldb): y[i * ldy + r]. `pf`: prefetch distance in bytes (0: none); each group prefetches the same
// bytes of its rows pf ahead.
template <int QT, int R, int MT>
KVLM_INLINE void dot_tile(const uint8_t* w, int64_t rs, int64_t nb, const int8_t* xq, int64_t ldq, const float* xd,
                          const float* xs, int64_t ldb, float* y, int64_t ldy, int64_t pf) {
    using S = Src2<QT>;
    constexpr int G = S::GROUP;
    __m256 acc[R][MT * 4];
    __m128 mins[R][MT];
    for (int r = 0; r < R; r++) {
        for (int k = 0; k < MT * 4; k++) acc[r][k] = _mm256_setzero_ps();
        for (int i = 0; i < MT; i++) mins[r][i] = _mm_setzero_ps();
    }
    const int64_t ng = nb / G;  // whole groups; the 32-element formats may leave up to 3 blocks
    for (int64_t g = 0; g < ng; g++) {
        const int64_t off = g * S::UB;
        if (pf)
            for (int r = 0; r < R; r++) prefetch_range(w + r * rs + off + pf, S::UB);
        typename S::Head h[R];
        for (int r = 0; r < R; r++) S::head(w + r * rs + off, &h[r]);
#pragma GCC unroll 8
        for (int s = 0; s < G; s++) {
            const int64_t ib = g * G + s;
            for (int r = 0; r < R; r++) {
                const __m256i u = S::unit(w + r * rs + off, s, h[r]);
                const __m256i sc = QT == T_Q6_K ? S::sc(h[r], s) : _mm256_setzero_si256();
                unit_rows<QT, MT>(u, S::dw(h[r], s), sc, xq, ldq, xd, ldb, ib, acc[r], s & 3);
            }
            if constexpr (S::MINS) {
                if ((s & 3) == 3)
                    for (int r = 0; r < R; r++)
                        for (int i = 0; i < MT; i++)
                            mins[r][i] = _mm_fmadd_ps(S::mw4(h[r], s - 3), _mm_loadu_ps(xs + i * ldb + ib - 3), mins[r][i]);
            }
        }
    }
    float mt[R][MT][4];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < MT; i++) _mm_storeu_ps(mt[r][i], mins[r][i]);
    if constexpr (!S::K) {  // the last nb % 4 blocks, one at a time (rows whose K is not a multiple of 128)
        for (int64_t ib = ng * G; ib < nb; ib++) {
            const int j = (int)(ib & 3);
            for (int r = 0; r < R; r++) {
                const uint8_t* blk = w + r * rs + ib * S::BB;
                typename S::Head h;
                h.dw4 = _mm_set1_ps(f16(blk));
                if constexpr (QT == T_Q4_1 || QT == T_Q5_1) h.mw4 = _mm_set1_ps(f16(blk + 2));
                else if constexpr (QT == T_Q5_0) h.mw4 = _mm_set1_ps(-16.0f * f16(blk));
                else h.mw4 = h.dw4;
                unit_rows<QT, MT>(S::unit(blk, 0, h), h.dw4[0], _mm256_setzero_si256(), xq, ldq, xd, ldb, ib, acc[r], j);
                if constexpr (S::MINS)
                    for (int i = 0; i < MT; i++) mt[r][i][j] = __builtin_fmaf(h.mw4[0], xs[i * ldb + ib], mt[r][i][j]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < MT; i++) {
            const __m256* a4 = acc[r] + 4 * i;
            const __m256 a = _mm256_add_ps(_mm256_add_ps(a4[0], a4[1]), _mm256_add_ps(a4[2], a4[3]));
            const float* m4 = mt[r][i];
            const float m = (m4[0] + m4[1]) + (m4[2] + m4[3]);
            y[i * ldy + r] = hsum8(a) + (QT == T_Q4_0 ? -8.0f * m : m);
        }
}

constexpr int64_t PF_BYTES = 4096;  // decode: prefetch distance (whole rows, at least this many bytes)

template <int QT>
void gemv_avx2_t(const uint8_t* w, int64_t rs, int64_t K, const int8_t* xq, const float* xd, const float* xs, int64_t M,
                 float* y, int64_t ldy, int64_t n0, int64_t n1) {
    const int64_t nb = K / 32;
    if (M == 1) {  // decode: a weight row per pass, prefetching the rows PF_BYTES ahead
        const int64_t pf = rs >= PF_BYTES ? rs : (PF_BYTES + rs - 1) / rs * rs;
        const uint8_t* end = w + n1 * rs;
        for (int64_t n = n0; n < n1; n++)
            dot_tile<QT, 1, 1>(w + n * rs, rs, nb, xq, K, xd, xs, nb, y + n, ldy, w + n * rs + pf + rs <= end ? pf : 0);
        return;
    }
    // Cache blocking for many rows (prefill): a panel of NP weight rows (L2) against tiles of 2 rows of x
    // (L1), tile after tile. The order of the work changes with M; each output's arithmetic does not.
    constexpr int64_t NP = 32;
    for (int64_t p0 = n0; p0 < n1; p0 += NP) {
        const int64_t p1 = p0 + NP < n1 ? p0 + NP : n1;
        int64_t m = 0;
        for (; m + 2 <= M; m += 2)
            for (int64_t n = p0; n < p1; n++)
                dot_tile<QT, 1, 2>(w + n * rs, rs, nb, xq + m * K, K, xd + 8 * m * nb, xs + m * nb, nb, y + m * ldy + n, ldy, 0);
        for (; m < M; m++)
            for (int64_t n = p0; n < p1; n++)
                dot_tile<QT, 1, 1>(w + n * rs, rs, nb, xq + m * K, K, xd + 8 * m * nb, xs + m * nb, nb, y + m * ldy + n, ldy, 0);
    }
}

}  // namespace
