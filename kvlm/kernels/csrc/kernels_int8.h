// Int8 activations (llama.cpp style) for Q4_0, Q4_1 and Q8_0 weights (the other formats: kernels_kquant.h): the default numerics for these
// types on the AVX2 and AVX-512 paths (reference: reference.qmatmul_int8_ref). Included by the AVX2,
// AVX-512 and AVX-512 VNNI units only, after kernels_impl.h.
//
// Activations: each 32-element block of a row of x becomes 32 int8 q = round_even(x * (1 / d)) with
// d = amax / 127 (d = 0 and q = 0 for an all-zero block), plus s = d * sum(q) (q8_1's convention: s is
// the sum of the fake-quantized block, so Q4_1's min term is exactly what x_fq @ W.T contains) and the
// integer sum(q) (the AVX-512 kernel folds Q4_0's and Q8_0's weight offsets into the integer sums).
// Block product (weight block b: scale dw, min term mw = m for Q4_1, -8 dw for Q4_0, none for Q8_0):
//     y += (float(sum_i u_i q_i) * dw) * d + mw * s        (u = the nibbles 0..15, or Q8_0's int8)
// The integer sums run on vpdpbusd (VNNI) or maddubs + madd (u8 x s8 -> int32, no overflow here).
//
// Kernels, each with its order contract (output (m, n) runs the same instruction sequence whatever M,
// the row tile, the rows sharing the call or the thread split):
// - AVX-512: kernels_int8_panel.h (16 output columns per vector; its header states the contract).
// - AVX2: kernels_int8_avx2.h (every format: one weight row's block b into accumulator b % 4, 8 partial
//   sums of the block each; its header states the contract; decode runs 2 weight rows per pass).

namespace {

KVLM_INLINE float hsum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

KVLM_INLINE float hsum4(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// ---- Activation quantization ----------------------------------------------------------------------

// One 32-element block: 32 int8 at q, its scale and fake-quantized sum.
KVLM_INLINE void quantize_block(const float* v, int8_t* q, float* d_out, float* s_out, int32_t* i_out) {
#if defined(KVLM_AVX512)
    const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));  // round to nearest even
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
    _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtepi32_epi8(qb));
    *i_out = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    *s_out = d * (float)*i_out;
#else
    __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
           v3 = _mm256_loadu_ps(v + 24);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
    const __m256 vi = _mm256_set1_ps(inv);
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, vi)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, vi));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, vi)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, vi));
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    // int32 -> int8 in element order: packs interleave 128-bit lanes, a final permute restores the order
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i*)q, p);
    *i_out = _mm_cvtsi128_si32(s4);
    *s_out = d * (float)*i_out;
#endif
    _mm256_storeu_ps(d_out, _mm256_set1_ps(d));  // expanded: 8 copies, one per int32 lane of the block
}

// x (M, K) -> xq (M, K) int8, xd (M, K/32, 8) scales (each repeated 8 times: the AVX2 kernel loads them
// as vectors), xs (M, K/32) sums of the fake-quantized blocks, xi (M, K/32) the blocks' sum(q).
void quantize_act(const float* x, int64_t M, int64_t K, int8_t* xq, float* xd, float* xs, int32_t* xi) {
    for (int64_t i = 0; i < M * (K / 32); i++)
        quantize_block(x + i * 32, xq + i * 32, xd + 8 * i, xs + i, xi + i);
}

// ---- Weight blocks --------------------------------------------------------------------------------

template <int QT> struct I8Fmt;
template <> struct I8Fmt<T_Q4_0> { static constexpr int BB = 18, QOFF = 2; };
template <> struct I8Fmt<T_Q4_1> { static constexpr int BB = 20, QOFF = 4; };
template <> struct I8Fmt<T_Q8_0> { static constexpr int BB = 34, QOFF = 2; };

// One block's 32 weights as bytes in element order (Q4: nibbles 0..15 unsigned; Q8_0: int8).
template <int QT>
KVLM_INLINE __m256i weights32(const uint8_t* blk) {
    const uint8_t* q = blk + I8Fmt<QT>::QOFF;
    if constexpr (QT == T_Q8_0) return _mm256_loadu_si256((const __m256i*)q);
    const __m128i t = _mm_loadu_si128((const __m128i*)q);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(15));
}

#if defined(KVLM_AVX512)

#if defined(KVLM_VNNI)
#define KVLM_HAS_VNNI 1
#else
#define KVLM_HAS_VNNI 0
#endif
#include "kernels_int8_panel.h"

#else  // AVX2

KVLM_INLINE __m256i dot256(__m256i u, __m256i s) {  // u8 x s8, 4 bytes per int32 lane
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

#endif  // AVX2

#include "kernels_kquant.h"  // Q5_0, Q5_1, Q4_K, Q5_K, Q6_K (gemv_kq)

int gemv_i8(int qtype, const uint8_t* w, int64_t rs, int64_t K, const int8_t* xq, const float* xd, const float* xs,
            const int32_t* xi, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
#if defined(KVLM_AVX512)
#define KVLM_I8_CALL(QT) gemm_i8_t<QT>(w, rs, K, xq, xd, xs, xi, M, y, ldy, n0, n1)
#else
    (void)xi;
#define KVLM_I8_CALL(QT) gemv_avx2_t<QT>(w, rs, K, xq, xd, xs, M, y, ldy, n0, n1)
#endif
    switch (qtype) {
        case T_Q4_0: KVLM_I8_CALL(T_Q4_0); return 0;
        case T_Q4_1: KVLM_I8_CALL(T_Q4_1); return 0;
        case T_Q8_0: KVLM_I8_CALL(T_Q8_0); return 0;
        default: return gemv_kq(qtype, w, rs, K, xq, xd, xs, xi, M, y, ldy, n0, n1);
    }
#undef KVLM_I8_CALL
}

}  // namespace
