// Experimental row kernel with int8 activations (llama.cpp style), for Q4_0, Q4_1 and Q8_0 weights:
// each 32-element block of a row of x is quantized to int8 with one float scale (and its exact float
// sum kept), and the block dot products run on integers (AVX2 maddubs/madd). Included by the AVX2 and
// AVX-512 units only, after kernels_impl.h. Opt-in (KVLM_KERNEL_ACT=int8): it costs accuracy (about
// 0.4% per activation) for fewer instructions per weight byte.
//
// Order contract as in kernels_impl.h: output (m, n) adds, block by block, the 8-lane float products
// into one accumulator and the min/offset terms into one scalar, then sums the lanes in a fixed tree,
// so the result does not depend on M, on which rows share the call, or on the thread split.

namespace {

KVLM_INLINE float hsum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// x (M, K) -> xq (M, K) int8, xd (M, K/32) scales, xs (M, K/32) exact float block sums.
void quantize_act(const float* x, int64_t M, int64_t K, int8_t* xq, float* xd, float* xs) {
    const int64_t nb = K / 32;
    for (int64_t i = 0; i < M * nb; i++) {
        const float* v = x + i * 32;
        float amax = 0.0f, sum = 0.0f;
        for (int j = 0; j < 32; j++) {
            float a = v[j] < 0 ? -v[j] : v[j];
            amax = a > amax ? a : amax;
            sum += v[j];
        }
        const float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < 32; j++) xq[i * 32 + j] = (int8_t)__builtin_lrintf(v[j] * inv);
        xd[i] = d;
        xs[i] = sum;
    }
}

KVLM_INLINE __m256i nibbles32(const uint8_t* q) {  // 16 bytes -> elements 0..15 (low), 16..31 (high)
    __m128i t = _mm_loadu_si128((const __m128i*)q);
    __m256i v = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    return _mm256_and_si256(v, _mm256_set1_epi8(15));
}

KVLM_INLINE __m256 dot_u8s8(__m256i u, __m256i s) {  // 8 lanes of 4-element integer sums, as floats
    __m256i p = _mm256_maddubs_epi16(u, s);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

// MT rows of x per pass over a weight row: each block is unpacked once and used for all of them.
template <int QT, int MT>
KVLM_INLINE void row_dot_i8(const uint8_t* row, int64_t nb, const int8_t* xq, const float* xd, const float* xs,
                            float* y, int64_t ldy) {
    __m256 acc[MT];
    float off[MT];
    for (int i = 0; i < MT; i++) acc[i] = _mm256_setzero_ps(), off[i] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        __m256i qv;
        float d, mn = 0.0f;
        if constexpr (QT == T_Q8_0) {
            qv = _mm256_loadu_si256((const __m256i*)(row + b * 34 + 2));
            d = f16(row + b * 34);
        } else if constexpr (QT == T_Q4_1) {
            qv = nibbles32(row + b * 20 + 4);
            d = f16(row + b * 20);
            mn = f16(row + b * 20 + 2);
        } else {  // Q4_0: (q - 8) d = q d + (-8 d)
            qv = nibbles32(row + b * 18 + 2);
            d = f16(row + b * 18);
            mn = -8.0f * d;
        }
        const __m256i qabs = QT == T_Q8_0 ? _mm256_sign_epi8(qv, qv) : qv;
        for (int i = 0; i < MT; i++) {
            const int64_t r = i * nb + b;  // row i's block b in xq (32 bytes each), xd, xs
            __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + r * 32));
            if constexpr (QT == T_Q8_0) xv = _mm256_sign_epi8(xv, qv);  // move q's sign onto x
            acc[i] = _mm256_fmadd_ps(dot_u8s8(qabs, xv), _mm256_set1_ps(d * xd[r]), acc[i]);
            if constexpr (QT != T_Q8_0) off[i] += mn * xs[r];
        }
    }
    for (int i = 0; i < MT; i++) y[i * ldy] = hsum8(acc[i]) + off[i];
}

template <int QT>
void gemv_i8_t(const uint8_t* w, int64_t rs, int64_t K, const int8_t* xq, const float* xd, const float* xs,
               int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
    const int64_t nb = K / 32;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t* row = w + n * rs;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) row_dot_i8<QT, 4>(row, nb, xq + m * K, xd + m * nb, xs + m * nb, y + m * ldy + n, ldy);
        for (; m < M; m++) row_dot_i8<QT, 1>(row, nb, xq + m * K, xd + m * nb, xs + m * nb, y + m * ldy + n, ldy);
    }
}

int gemv_i8(int qtype, const uint8_t* w, int64_t rs, int64_t K, const int8_t* xq, const float* xd, const float* xs,
            int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
    switch (qtype) {
        case T_Q4_0: gemv_i8_t<T_Q4_0>(w, rs, K, xq, xd, xs, M, y, ldy, n0, n1); return 0;
        case T_Q4_1: gemv_i8_t<T_Q4_1>(w, rs, K, xq, xd, xs, M, y, ldy, n0, n1); return 0;
        case T_Q8_0: gemv_i8_t<T_Q8_0>(w, rs, K, xq, xd, xs, M, y, ldy, n0, n1); return 0;
        default: return -1;
    }
}

}  // namespace
