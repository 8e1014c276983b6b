// Int8 activations (llama.cpp style) for Q4_0, Q4_1 and Q8_0 weights (the other formats: kernels_kquant.h): the default numerics for these
// types on the AVX2 and AVX-512 paths (reference: reference.qmatmul_int8_ref). Included by the AVX2,
// AVX-512 and AVX-512 VNNI units, and (kernels_int8_portable.h) by the portable and NEON units, after kernels_impl.h.
//
// Activations: each 32-element block of a row of x becomes 32 int8 q = round_even(x * (1 / d)) with
// d = amax / 127 (d = 0 and q = 0 for an all-zero block), plus s = d * sum(q) (q8_1's convention: s is
// the sum of the fake-quantized block, so Q4_1's min term is exactly what x_fq @ W.T contains) and the
// integer sum(q) (the AVX-512 kernel folds Q4_0's and Q8_0's weight offsets into the integer sums).
// Block product (weight block b: scale dw, min term mw = m for Q4_1, -8 dw for Q4_0, none for Q8_0):
//     y += (float(sum_i u_i q_i) * dw) * d + mw * s        (u = the nibbles 0..15, or Q8_0's int8)
// The integer sums run on vpdpbusd (VNNI) or maddubs + madd (u8 x s8 -> int32, no overflow here).
//
// Kernels, on one order contract (output (m, n) runs the same integer and float sequence whatever the
// ISA, M, the row tile, the rows sharing the call or the thread split; reference.qmatmul_int8_contract
// spells it out):
// - AVX-512: kernels_int8_panel.h and kernels_kquant.h (16 output columns per zmm; the contract there).
// - AVX2: kernels_int8_avx2.h (every format: 8 output columns per ymm; since 2026-12-03, when AVX2 left
//   its own contract of 8 partial sums per block: its logits moved in the last bits once).

namespace {

// ---- Activation quantization ----------------------------------------------------------------------

#if defined(KVLM_AVX2) || defined(KVLM_AVX512)
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
#else
// One 32-element block of activations (kernels_int8.h's contract): d = amax / 127, q = round_even(x / d)
// computed as x * (1 / d), s = d * sum(q). Max and integer sums are exact in any order.
KVLM_INLINE void quantize_block(const float* v, int8_t* q, float* d_out, float* s_out, int32_t* i_out) {
    float amax = 0.0f;
    for (int e = 0; e < 32; e++) amax = fmaxf(amax, fabsf(v[e]));
    const float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int e = 0; e < 32; e++) {
        const float p = v[e] * inv;  // a lone product: nothing for fp-contract to fuse
        const int32_t r = (int32_t)rintf(p);  // round to nearest even (the default rounding mode), as cvtps
        q[e] = (int8_t)r;
        sum += r;
    }
    *i_out = sum;
    *s_out = d * (float)sum;
    for (int e = 0; e < 8; e++) d_out[e] = d;
}
#endif

// x (M, K) -> xq (M, K) int8, xd (M, K/32, 8) scales (each repeated 8 times: the AVX2 kernel loads them
// as vectors), xs (M, K/32) sums of the fake-quantized blocks, xi (M, K/32) the blocks' sum(q).
void quantize_act(const float* x, int64_t M, int64_t K, int8_t* xq, float* xd, float* xs, int32_t* xi) {
    for (int64_t i = 0; i < M * (K / 32); i++)
        quantize_block(x + i * 32, xq + i * 32, xd + 8 * i, xs + i, xi + i);
}

// ---- Shared by every unit's kernels -----------------------------------------------------

// Rows of x seen by a tile: row i's block b at xq + i * K + 32 b, its scale at xd[8 (i nb + b)]
// (expanded), d * sum(q) at xs[i nb + b], sum(q) at xi[i nb + b].
struct ActRows {
    const int8_t* xq;
    const float* xd;
    const float* xs;
    const int32_t* xi;
    int64_t K, nb;
};

#if defined(KVLM_AVX2) || defined(KVLM_AVX512)

// Q6_K's per-row integer offsets need sum(q) of each block's first 16 elements: xl16 (M, K/32), computed
// per call into this thread's buffer (grown and kept).
int32_t* lo16_sums(const ActRows& a, int64_t M) {
    int32_t* buf = thread_buffer<int32_t>(M * a.nb);
    if (!buf) return nullptr;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < a.nb; b++) {
            const int8_t* q = a.xq + m * a.K + 32 * b;
            int32_t s = 0;
            for (int e = 0; e < 16; e++) s += q[e];
            buf[m * a.nb + b] = s;
        }
    return buf;
}

// ---- Weight blocks --------------------------------------------------------------------------------

template <int QT> struct I8Fmt;
template <> struct I8Fmt<T_Q4_0> { static constexpr int BB = 18, QOFF = 2; };
template <> struct I8Fmt<T_Q4_1> { static constexpr int BB = 20, QOFF = 4; };
template <> struct I8Fmt<T_Q8_0> { static constexpr int BB = 34, QOFF = 2; };

#if defined(KVLM_AVX512)

#if defined(KVLM_VNNI)
#define KVLM_HAS_VNNI 1
#else
#define KVLM_HAS_VNNI 0
#endif
#include "kernels_int8_panel.h"

#endif  // AVX-512

#include "kernels_kquant.h"  // Q5_0, Q5_1, Q4_K, Q5_K, Q6_K (gemv_kq)

#else  // no x86 vectors: the portable and NEON units (every format, kernels_int8_portable.h)

#include "kernels_int8_portable.h"

int gemv_i8(int qtype, const uint8_t* w, int64_t rs, int64_t K, const int8_t* xq, const float* xd, const float* xs,
            const int32_t* xi, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
#define KVLM_I8_CALL(QT) gemm_port_t<QT>(w, rs, K, xq, xd, xs, xi, M, y, ldy, n0, n1)
    switch (qtype) {
        case T_Q4_0: KVLM_I8_CALL(T_Q4_0); return 0;
        case T_Q4_1: KVLM_I8_CALL(T_Q4_1); return 0;
        case T_Q8_0: KVLM_I8_CALL(T_Q8_0); return 0;
        case T_Q5_0: KVLM_I8_CALL(T_Q5_0); return 0;
        case T_Q5_1: KVLM_I8_CALL(T_Q5_1); return 0;
        case T_Q4_K: KVLM_I8_CALL(T_Q4_K); return 0;
        case T_Q5_K: KVLM_I8_CALL(T_Q5_K); return 0;
        case T_Q6_K: KVLM_I8_CALL(T_Q6_K); return 0;
        default: return -1;
    }
#undef KVLM_I8_CALL
}

#endif

#if defined(KVLM_AVX2) || defined(KVLM_AVX512)
int gemv_i8(int qtype, const uint8_t* w, int64_t rs, int64_t K, const int8_t* xq, const float* xd, const float* xs,
            const int32_t* xi, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
#if defined(KVLM_AVX512)
#define KVLM_I8_CALL(QT) gemm_i8_t<QT>(w, rs, K, xq, xd, xs, xi, M, y, ldy, n0, n1)
#else
#define KVLM_I8_CALL(QT) gemm_avx2_t<QT>(w, rs, K, xq, xd, xs, xi, M, y, ldy, n0, n1)
#endif
    switch (qtype) {
        case T_Q4_0: KVLM_I8_CALL(T_Q4_0); return 0;
        case T_Q4_1: KVLM_I8_CALL(T_Q4_1); return 0;
        case T_Q8_0: KVLM_I8_CALL(T_Q8_0); return 0;
        default: return gemv_kq(qtype, w, rs, K, xq, xd, xs, xi, M, y, ldy, n0, n1);
    }
#undef KVLM_I8_CALL
}
#endif

}  // namespace
