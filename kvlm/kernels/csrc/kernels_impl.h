// Kernel bodies, compiled once per instruction set: each isa_*.cpp sets `#pragma GCC target(...)`,
// defines KVLM_ISA_FN (the name of its table getter) and includes this file.
//
// Vectors are GCC vector extensions of 16 floats (`v16`): one zmm under AVX-512, two ymm under AVX2,
// four xmm on the SSE2 baseline, so one source gives all three paths with identical lane semantics.
//
// Exactness contract of `gemv`: output (m, n) accumulates x[m, k] * W[n, k] into lane k % 16 of a
// 16-lane accumulator in increasing k (one fused multiply-add per element), then sums the lanes in a
// fixed tree. That order depends on neither M, nor which rows share a call, nor the thread split, so a
// row's result is bit-identical alone and in a batch.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(KVLM_AVX2) || defined(KVLM_AVX512)
#include <immintrin.h>
#endif

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint32_t u16v __attribute__((vector_size(64)));
typedef uint8_t b16 __attribute__((vector_size(16)));
typedef uint8_t b16u __attribute__((vector_size(16), aligned(1)));
typedef int8_t s16 __attribute__((vector_size(16)));
typedef uint16_t h16 __attribute__((vector_size(32)));
typedef uint16_t h16u __attribute__((vector_size(32), aligned(1)));

#define KVLM_INLINE static inline __attribute__((always_inline))

KVLM_INLINE v16 ld(const float* p) { return *(const v16u*)p; }
KVLM_INLINE void st(float* p, v16 v) { *(v16u*)p = v; }
KVLM_INLINE b16 ldb(const uint8_t* p) { return *(const b16u*)p; }
// Bits are unpacked on int32 lanes (x86 has no byte shifts, and GCC 12 scalarizes a direct u8 -> float
// conversion): bytes are widened to int32 first, then masked, shifted and converted to float.
// Widening goes 8 -> 16 -> 32 bits: GCC 12 turns each 2x step into vpmovzx/vpmovsx, a 4x step into scalar code.
typedef int16_t hs16 __attribute__((vector_size(32)));
#if defined(KVLM_AVX2)
// A 16-lane vector from two 8-lane AVX2 registers (lo = lanes 0..7, hi = 8..15).
template <class V, class H>
KVLM_INLINE V join16(H lo, H hi) {
    V r;
    memcpy(&r, &lo, 32);
    memcpy((char*)&r + 32, &hi, 32);
    return r;
}
#endif
KVLM_INLINE i16v widen(const uint8_t* p) {
#if defined(KVLM_AVX512)
    return (i16v)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
#elif defined(KVLM_AVX2)
    return join16<i16v>(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)),
                        _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))));
#else
    return __builtin_convertvector(__builtin_convertvector(ldb(p), h16), i16v);
#endif
}
KVLM_INLINE v16 tof(i16v q) { return __builtin_convertvector(q, v16); }
KVLM_INLINE v16 tof_signed(const uint8_t* p) {
    return __builtin_convertvector(__builtin_convertvector(__builtin_convertvector((s16)ldb(p), hs16), i16v), v16);
}
// A 16-element initializer, not `(v16){} + f`: GCC turns it into one broadcast, where on AVX2 the
// scalar-vector form of a 2-register vector is built in memory (16 scalar stores, then a reload).
KVLM_INLINE v16 splat(float f) { return (v16){f, f, f, f, f, f, f, f, f, f, f, f, f, f, f, f}; }

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef float v2 __attribute__((vector_size(8)));

KVLM_INLINE float hsum(v16 a) {
    // Fixed tree: lanes i and i + 8, then i and i + 4, ...; the same for every call.
    v8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
    v2 d = __builtin_shufflevector(c, c, 0, 1) + __builtin_shufflevector(c, c, 2, 3);
    return d[0] + d[1];
}

// IEEE half -> float, exact for normals, subnormals, zeros (signed), inf and NaN.
KVLM_INLINE v16 half_to_float(u16v h) {
    u16v sign = (h & 0x8000u) << 16;
    u16v em = h & 0x7fffu;
    v16 mag;
    u16v bits = em << 13;
    memcpy(&mag, &bits, sizeof mag);
    mag = mag * splat(0x1p112f);  // rebias the exponent (15 -> 127); subnormal halves become normal floats
    u16v out;
    memcpy(&out, &mag, sizeof out);
    out = (em >= 0x7c00u) ? ((em << 13) | 0x7f800000u) : out;  // inf / NaN keep an all-ones exponent
    out |= sign;
    v16 r;
    memcpy(&r, &out, sizeof r);
    return r;
}

KVLM_INLINE float f16(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(KVLM_AVX2) || defined(KVLM_AVX512)
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, em = h & 0x7fffu;
    uint32_t bits = em << 13;
    float mag;
    memcpy(&mag, &bits, 4);
    mag *= 0x1p112f;
    uint32_t out;
    memcpy(&out, &mag, 4);
    if (em >= 0x7c00u) out = (em << 13) | 0x7f800000u;
    out |= sign;
    float r;
    memcpy(&r, &out, 4);
    return r;
}

KVLM_INLINE float bf16(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t u = (uint32_t)h << 16;
    float r;
    memcpy(&r, &u, 4);
    return r;
}

// ---- Weight formats -----------------------------------------------------------------------------
// Each format decodes its blocks 32 elements at a time: step(blk, s, w0, w1) writes elements
// 32*s .. 32*s+15 to w0 and 32*s+16 .. 32*s+31 to w1. BE = elements per block, BB = bytes per block.
// Dense formats (F32, F16, BF16) use 32-element pseudo-blocks plus a scalar tail (`elem`).

struct FmtQ4_0 {  // d f16, qs[16]: element i < 16 is the low nibble of qs[i], i >= 16 the high nibble
    static constexpr int BE = 32, BB = 18;
    static constexpr bool DENSE = false;
    KVLM_INLINE void step(const uint8_t* b, int, v16& w0, v16& w1) {
        float d = f16(b);
        i16v q = widen(b + 2);
        w0 = (tof(q & 15) - 8.0f) * d;
        w1 = (tof(q >> 4) - 8.0f) * d;
    }
};

struct FmtQ4_1 {  // d f16, m f16, qs[16]: value = q * d + m
    static constexpr int BE = 32, BB = 20;
    static constexpr bool DENSE = false;
    KVLM_INLINE void step(const uint8_t* b, int, v16& w0, v16& w1) {
        float d = f16(b), m = f16(b + 2);
        i16v q = widen(b + 4);
        w0 = tof(q & 15) * d + m;
        w1 = tof(q >> 4) * d + m;
    }
};

struct FmtQ8_0 {  // d f16, qs int8[32]: value = q * d
    static constexpr int BE = 32, BB = 34;
    static constexpr bool DENSE = false;
    KVLM_INLINE void step(const uint8_t* b, int, v16& w0, v16& w1) {
        float d = f16(b);
        w0 = tof_signed(b + 2) * d;
        w1 = tof_signed(b + 18) * d;
    }
};

// K-quants: 256-element super-blocks of 8 sub-blocks of 32, 6-bit scales and mins packed in 12 bytes.
KVLM_INLINE void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

struct FmtQ4_K {  // d f16, dmin f16, scales[12], qs[128]; sub-block s: nibble (s & 1) of qs[32*(s/2) ..]
    static constexpr int BE = 256, BB = 144;
    static constexpr bool DENSE = false;
    KVLM_INLINE void step(const uint8_t* b, int s, v16& w0, v16& w1) {
        int sc, mn;
        scale_min_k4(s, b + 4, sc, mn);
        float d = f16(b) * (float)sc, m = f16(b + 2) * (float)mn;
        const uint8_t* q = b + 16 + 32 * (s / 2);
        int sh = (s & 1) * 4;
        w0 = tof((widen(q) >> sh) & 15) * d - m;
        w1 = tof((widen(q + 16) >> sh) & 15) * d - m;
    }
};

struct FmtQ5_K {  // d, dmin, scales[12], qh[32], qs[128]; the 5th bit of sub-block s is bit s of qh[l]
    static constexpr int BE = 256, BB = 176;
    static constexpr bool DENSE = false;
    KVLM_INLINE void step(const uint8_t* b, int s, v16& w0, v16& w1) {
        int sc, mn;
        scale_min_k4(s, b + 4, sc, mn);
        float d = f16(b) * (float)sc, m = f16(b + 2) * (float)mn;
        const uint8_t* qh = b + 16;
        const uint8_t* q = b + 48 + 32 * (s / 2);
        int sh = (s & 1) * 4;
        i16v lo0 = (widen(q) >> sh) & 15, lo1 = (widen(q + 16) >> sh) & 15;
        i16v hi0 = ((widen(qh) >> s) & 1) << 4, hi1 = ((widen(qh + 16) >> s) & 1) << 4;
        w0 = tof(lo0 | hi0) * d - m;
        w1 = tof(lo1 | hi1) * d - m;
    }
};

struct FmtQ6_K {  // ql[128], qh[64], scales int8[16], d f16; value = d * scale[i/16] * (q - 32)
    static constexpr int BE = 256, BB = 210;
    static constexpr bool DENSE = false;
    KVLM_INLINE void step(const uint8_t* b, int s, v16& w0, v16& w1) {
        int h = s / 4, c = s % 4;
        const uint8_t* ql = b + 64 * h + (c & 1) * 32;
        const uint8_t* qh = b + 128 + 32 * h;
        const int8_t* scales = (const int8_t*)(b + 192);
        float d = f16(b + 208);
        int shl = (c >> 1) * 4, shh = 2 * c;
        i16v q0 = ((widen(ql) >> shl) & 15) | (((widen(qh) >> shh) & 3) << 4);
        i16v q1 = ((widen(ql + 16) >> shl) & 15) | (((widen(qh + 16) >> shh) & 3) << 4);
        w0 = (tof(q0) - 32.0f) * (d * (float)scales[2 * s]);
        w1 = (tof(q1) - 32.0f) * (d * (float)scales[2 * s + 1]);
    }
};

struct FmtF32 {
    static constexpr int BE = 32, BB = 128;
    static constexpr bool DENSE = true;
    KVLM_INLINE void step(const uint8_t* b, int, v16& w0, v16& w1) {
        w0 = ld((const float*)b);
        w1 = ld((const float*)b + 16);
    }
    KVLM_INLINE float elem(const uint8_t* row, int64_t k) {
        float f;
        memcpy(&f, row + 4 * k, 4);
        return f;
    }
};

struct FmtF16 {
    static constexpr int BE = 32, BB = 64;
    static constexpr bool DENSE = true;
    KVLM_INLINE void step(const uint8_t* b, int, v16& w0, v16& w1) {
        w0 = half_to_float(__builtin_convertvector(*(const h16u*)b, u16v));
        w1 = half_to_float(__builtin_convertvector(*(const h16u*)(b + 32), u16v));
    }
    KVLM_INLINE float elem(const uint8_t* row, int64_t k) { return f16(row + 2 * k); }
};

struct FmtBF16 {
    static constexpr int BE = 32, BB = 64;
    static constexpr bool DENSE = true;
    KVLM_INLINE void step(const uint8_t* b, int, v16& w0, v16& w1) {
        u16v a = __builtin_convertvector(*(const h16u*)b, u16v) << 16;
        u16v c = __builtin_convertvector(*(const h16u*)(b + 32), u16v) << 16;
        memcpy(&w0, &a, sizeof w0);
        memcpy(&w1, &c, sizeof w1);
    }
    KVLM_INLINE float elem(const uint8_t* row, int64_t k) { return bf16(row + 2 * k); }
};

// ---- Matrix-vector products ---------------------------------------------------------------------

// MT rows of x against one weight row; each block is decoded once and used for all MT rows.
template <class F, int MT>
KVLM_INLINE void row_dot(const uint8_t* row, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy) {
    v16 acc[MT];
    for (int i = 0; i < MT; i++) acc[i] = (v16){};
    const int64_t nb = K / F::BE;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = row + b * F::BB;
        const float* xb = x + b * F::BE;
        for (int s = 0; s < F::BE / 32; s++) {
            v16 w0, w1;
            F::step(blk, s, w0, w1);
            for (int i = 0; i < MT; i++) {
                acc[i] += w0 * ld(xb + i * ldx + 32 * s);
                acc[i] += w1 * ld(xb + i * ldx + 32 * s + 16);
            }
        }
    }
    if constexpr (F::DENSE) {
        for (int64_t k = nb * F::BE; k < K; k++) {  // tail of a dense row: lane (k % 32) % 16, as above
            float w = F::elem(row, k);
            int lane = (int)((k - nb * F::BE) % 16);
            for (int i = 0; i < MT; i++) acc[i][lane] += w * x[i * ldx + k];
        }
    }
    for (int i = 0; i < MT; i++) y[i * ldy] = hsum(acc[i]);
}

// Rows of x per decoded block: AVX-512 has 32 vector registers (8 accumulators fit), AVX2 16.
#if defined(KVLM_AVX512)
constexpr int64_t MT_MAX = 8;
#else
constexpr int64_t MT_MAX = 4;
#endif

template <class F>
void gemv_t(const uint8_t* w, int64_t rs, int64_t K, const float* x, int64_t M, float* y, int64_t ldy,
            int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t* row = w + n * rs;
        int64_t m = 0;
        // Tiles of MT_MAX rows, then the rest as 4 + 2 + 1: the per-row arithmetic is the same in all.
        for (; m + MT_MAX <= M; m += MT_MAX) row_dot<F, MT_MAX>(row, K, x + m * K, K, y + m * ldy + n, ldy);
        if (MT_MAX > 4 && m + 4 <= M) row_dot<F, 4>(row, K, x + m * K, K, y + m * ldy + n, ldy), m += 4;
        if (m + 2 <= M) row_dot<F, 2>(row, K, x + m * K, K, y + m * ldy + n, ldy), m += 2;
        if (m < M) row_dot<F, 1>(row, K, x + m * K, K, y + m * ldy + n, ldy);
    }
}

template <class F>
void dequant_t(const uint8_t* w, int64_t rs, int64_t K, float* out, int64_t ldo, int64_t n0, int64_t n1) {
    const int64_t nb = K / F::BE;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t* row = w + n * rs;
        float* o = out + (n - n0) * ldo;
        for (int64_t b = 0; b < nb; b++)
            for (int s = 0; s < F::BE / 32; s++) {
                v16 w0, w1;
                F::step(row + b * F::BB, s, w0, w1);
                st(o + b * F::BE + 32 * s, w0);
                st(o + b * F::BE + 32 * s + 16, w1);
            }
        if constexpr (F::DENSE)
            for (int64_t k = nb * F::BE; k < K; k++) o[k] = F::elem(row, k);
    }
}

// ggml type ids (gguf.GGMLQuantizationType)

#define KVLM_DISPATCH(qtype, CALL)          \
    switch (qtype) {                        \
        case T_F32: CALL(FmtF32); break;    \
        case T_F16: CALL(FmtF16); break;    \
        case T_BF16: CALL(FmtBF16); break;  \
        case T_Q4_0: CALL(FmtQ4_0); break;  \
        case T_Q4_1: CALL(FmtQ4_1); break;  \
        case T_Q8_0: CALL(FmtQ8_0); break;  \
        case T_Q4_K: CALL(FmtQ4_K); break;  \
        case T_Q5_K: CALL(FmtQ5_K); break;  \
        case T_Q6_K: CALL(FmtQ6_K); break;  \
        default: return -1;                 \
    }

int gemv(int qtype, const uint8_t* w, int64_t rs, int64_t K, const float* x, int64_t M, float* y, int64_t ldy,
         int64_t n0, int64_t n1) {
#define KVLM_GEMV(F) gemv_t<F>(w, rs, K, x, M, y, ldy, n0, n1)
    KVLM_DISPATCH(qtype, KVLM_GEMV)
    return 0;
}

int dequant(int qtype, const uint8_t* w, int64_t rs, int64_t K, float* out, int64_t ldo, int64_t n0, int64_t n1) {
#define KVLM_DEQUANT(F) dequant_t<F>(w, rs, K, out, ldo, n0, n1)
    KVLM_DISPATCH(qtype, KVLM_DEQUANT)
    return 0;
}

// ---- Paged decode attention ---------------------------------------------------------------------

// exp(x) for x <= 0 (scores minus their running max), Cephes-style: n = round(x / ln 2), a degree-6
// polynomial on the remainder, times 2^n; about 2 ulp. Below -87.3 (where expf underflows) it is 0.
KVLM_INLINE v16 exp_neg(v16 x) {
    const v16 lo = splat(-87.33654f);
    i16v under = x < lo;
    x = under ? lo : x;
    v16 fx = x * 1.44269504088896341f + 0.5f;
    v16 nf = __builtin_convertvector(__builtin_convertvector(fx, i16v), v16);
    nf = (nf > fx) ? nf - 1.0f : nf;  // floor
    x = x - nf * 0.693359375f;
    x = x - nf * -2.12194440e-4f;
    v16 z = x * x;
    v16 y = splat(1.9875691500E-4f);
    y = y * x + 1.3981999507E-3f;
    y = y * x + 8.3334519073E-3f;
    y = y * x + 4.1665795894E-2f;
    y = y * x + 1.6666665459E-1f;
    y = y * x + 5.0000001201E-1f;
    y = y * z + x + 1.0f;
    i16v e = (__builtin_convertvector(nf, i16v) + 127) << 23;
    v16 p;
    memcpy(&p, &e, sizeof p);
    y = y * p;
    return under ? splat(0.0f) : y;
}

// K/V cache element types: 16 consecutive elements -> 16 floats.
struct KvF32 {
    typedef float T;
    KVLM_INLINE v16 load(const T* p) { return ld(p); }
};
struct KvF16 {
    typedef uint16_t T;
    KVLM_INLINE v16 load(const T* p) {
#if defined(KVLM_AVX512)
        return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif defined(KVLM_AVX2)
        return join16<v16>(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)),
                           _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8))));
#else
        return half_to_float(__builtin_convertvector(*(const h16u*)p, u16v));
#endif
    }
};
struct KvBF16 {
    typedef uint16_t T;
    KVLM_INLINE v16 load(const T* p) {
        u16v u = __builtin_convertvector(*(const h16u*)p, u16v) << 16;
        v16 r;
        memcpy(&r, &u, sizeof r);
        return r;
    }
};

// Sums of 16 vectors at once: lane t of the result is the sum of the lanes of x[t]. AVX-512: a fixed
// tree of 15 adds and 30 shuffles (halves, quarters, ...) instead of 16 horizontal sums of ~8 steps each.
// AVX2 (where GCC would split those 512-bit shuffles into scalar inserts): halves added, then the
// classic hadd tree on 8-lane registers. Baseline: 16 horizontal sums. Each is a fixed order.
KVLM_INLINE v16 sum16(const v16u* x) {
#if defined(KVLM_AVX512)
    v16 u[8], w[4], z[2];
    for (int i = 0; i < 8; i++)  // lanes 0-7: x[2i]'s halves added, 8-15: x[2i + 1]'s
        u[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)  // 4 lanes per vector
        w[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(u[2 * i], u[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)  // 2 lanes per vector
        z[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(w[2 * i], w[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#elif defined(KVLM_AVX2)
    __m256 r[2];
    for (int half = 0; half < 2; half++) {  // tokens 8 * half .. 8 * half + 7
        __m256 h[8];
        for (int i = 0; i < 8; i++) {
            const float* p = (const float*)&x[8 * half + i];
            h[i] = _mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8));
        }
        __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
        __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
        r[half] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    }
    v16 out;
    memcpy(&out, r, sizeof out);
    return out;
#else
    v16 out;
    for (int t = 0; t < 16; t++) out[t] = hsum(x[t]);
    return out;
#endif
}

KVLM_INLINE v16 vmax(v16 a, v16 b) { return a > b ? a : b; }

KVLM_INLINE float hmax(v16 a) {
    float m = a[0];
    for (int i = 1; i < 16; i++) m = a[i] > m ? a[i] : m;
    return m;
}

// Element offsets of tokens t0 .. t0 + 15 of a sequence (its block table `tab`) in a cache of
// (num_blocks, BS, KVH * D) rows; tokens at or past t1 repeat t0's row (read, then masked or skipped).
KVLM_INLINE void token_rows(const int32_t* tab, int64_t BS, int64_t row, int64_t t0, int64_t t1, int64_t* off) {
    int64_t j = t0 / BS, s = t0 % BS;
    for (int i = 0; i < 16; i++) {
        off[i] = t0 + i < t1 ? ((int64_t)tab[j] * BS + s) * row : off[0];
        if (++s == BS) s = 0, j++;
    }
}

// One work item: tokens [t0, t1) of sequence b, every head. Two passes over the chunk, K then V, each
// streaming whole blocks (all kv heads of a token are one contiguous row): scores of all H heads into
// sc (H, chunk), softmax of the chunk, then acc (H, D) += p * V. Each K/V row is fetched from memory once
// and reused from L1 by the G query heads of its kv head. NV = D / 16 if fixed at compile time, else 0.
template <class E, int NV>
void attn_chunk(const KvlmPagedAttn* a, int64_t b, int64_t t0, int64_t t1, float* sc, v16u* dots, float* acc,
                float* mx, float* den) {
    typedef typename E::T T;
    const int64_t H = a->H, KVH = a->kv_heads, D = a->D, BS = a->block_size, CH = a->chunk, G = H / KVH;
    const int64_t nv = NV ? NV : D / 16, row = KVH * D, n = t1 - t0, ngrp = (n + 15) / 16;
    const T* kc = (const T*)a->k_cache;
    const T* vc = (const T*)a->v_cache;
    const int32_t* tab = a->block_tables + b * a->max_blocks;
    const float* qb = a->q + b * H * D;
    const v16 NEG_INF = splat(-__builtin_inff());
    int64_t off[16];
    // K pass: sc[h, 16 * grp + i] = scale * q[h] . K[token t0 + 16 * grp + i, h / G]. Token-major, so each
    // block is read front to back once (what the hardware prefetchers follow); dots (H, 16) in scratch.
    for (int64_t grp = 0; grp < ngrp; grp++) {
        const int64_t nt = n - 16 * grp < 16 ? n - 16 * grp : 16;
        token_rows(tab, BS, row, t0 + 16 * grp, t1, off);
        for (int i = 0; i < 16; i++) {
            const T* kr = kc + off[i];
            for (int64_t g = 0; g < KVH; g++) {
                if (NV) {
                    v16 kv[NV ? NV : 1];
                    for (int k = 0; k < NV; k++) kv[k] = E::load(kr + g * D + 16 * k);
                    for (int64_t h = g * G; h < g * G + G; h++) {
                        v16 s = (v16){};
                        for (int k = 0; k < NV; k++) s += ld(qb + h * D + 16 * k) * kv[k];
                        dots[h * 16 + i] = s;
                    }
                } else {
                    for (int64_t h = g * G; h < g * G + G; h++) {
                        v16 s = (v16){};
                        for (int64_t k = 0; k < nv; k++) s += ld(qb + h * D + 16 * k) * E::load(kr + g * D + 16 * k);
                        dots[h * 16 + i] = s;
                    }
                }
            }
        }
        for (int64_t h = 0; h < H; h++) {
            v16 s = sum16(dots + h * 16) * splat(a->scale);
            for (int64_t i = nt; i < 16; i++) s[i] = -__builtin_inff();
            st(sc + h * CH + 16 * grp, s);
        }
    }
    // Softmax of the chunk: p = exp(s - max) in place, den = sum p (lanes, then one fixed-order sum).
    for (int64_t h = 0; h < H; h++) {
        float* s = sc + h * CH;
        v16 m = NEG_INF;
        for (int64_t grp = 0; grp < ngrp; grp++) m = vmax(m, ld(s + 16 * grp));
        const float mh = hmax(m);
        v16 l = (v16){};
        for (int64_t grp = 0; grp < ngrp; grp++) {
            v16 p = exp_neg(ld(s + 16 * grp) - mh);
            st(s + 16 * grp, p);
            l += p;
        }
        mx[h] = mh;
        den[h] = hsum(l);
    }
    // V pass: acc[h] = sum_t p[h, t] * V[t, h / G], 16 tokens at a time: acc[h] stays in registers over
    // the group, whose V rows (one block for block size 16) the first head brings into L1 for the others.
    for (int64_t i = 0; i < H * D; i++) acc[i] = 0.0f;
    for (int64_t grp = 0; grp < ngrp; grp++) {
        const int64_t nt = n - 16 * grp < 16 ? n - 16 * grp : 16;
        token_rows(tab, BS, row, t0 + 16 * grp, t1, off);
        for (int64_t h = 0; h < H; h++) {
            const float* p = sc + h * CH + 16 * grp;
            const T* vg = vc + (h / G) * D;
            float* ah = acc + h * D;
            if (NV) {
                v16 r[NV ? NV : 1];
                for (int k = 0; k < NV; k++) r[k] = ld(ah + 16 * k);
                for (int64_t i = 0; i < nt; i++) {
                    const v16 pi = splat(p[i]);
                    for (int k = 0; k < NV; k++) r[k] += pi * E::load(vg + off[i] + 16 * k);
                }
                for (int k = 0; k < NV; k++) st(ah + 16 * k, r[k]);
            } else {
                for (int64_t k = 0; k < nv; k++) {
                    v16 r = ld(ah + 16 * k);
                    for (int64_t i = 0; i < nt; i++) r += splat(p[i]) * E::load(vg + off[i] + 16 * k);
                    st(ah + 16 * k, r);
                }
            }
        }
    }
}

// out[b] from the partial states of its nc chunks (part rows of H * (D + 2)), in chunk order.
KVLM_INLINE void attn_combine(const KvlmPagedAttn* a, int64_t b, int64_t nc) {
    const int64_t H = a->H, D = a->D, stride = H * (D + 2);
    const float* p0 = a->part + a->first[b] * stride;
    for (int64_t h = 0; h < H; h++) {
        float m = -__builtin_inff();
        for (int64_t c = 0; c < nc; c++) {
            const float mc = p0[c * stride + H * D + h];
            m = mc > m ? mc : m;
        }
        float l = 0.0f;
        float* o = a->out + (b * a->H + h) * D;
        for (int64_t i = 0; i < D; i++) o[i] = 0.0f;
        for (int64_t c = 0; c < nc; c++) {
            const float* pc = p0 + c * stride;
            const float w = exp_neg(splat(pc[H * D + h] - m))[0];
            l += pc[H * D + H + h] * w;
            for (int64_t k = 0; k < D; k += 16) st(o + k, ld(o + k) + ld(pc + h * D + k) * w);
        }
        const float inv = 1.0f / l;
        for (int64_t k = 0; k < D; k += 16) st(o + k, ld(o + k) * inv);
    }
}

template <class E, int NV>
void paged_attn_t(const KvlmPagedAttn* a, float* sc, int64_t i0, int64_t i1) {
    const int64_t H = a->H, D = a->D, CH = a->chunk, stride = H * (D + 2);
    v16u* dots = (v16u*)(sc + H * (CH + 2));  // (H, 16) vectors of per-token dot products
    for (int64_t it = i0; it < i1; it++) {
        const int64_t b = a->items[2 * it], c = a->items[2 * it + 1], L = a->seq_lens[b];
        const int64_t t0 = c * CH, t1 = t0 + CH < L ? t0 + CH : L;
        if (L <= CH) {  // one chunk: normalize straight into out
            float* o = a->out + b * H * D;
            float* mx = sc + H * CH;  // scratch past the scores
            attn_chunk<E, NV>(a, b, t0, t1, sc, dots, o, mx, mx + H);
            for (int64_t h = 0; h < H; h++) {
                const v16 inv = splat(mx[H + h] > 0.0f ? 1.0f / mx[H + h] : 0.0f);  // L = 0: zeros
                for (int64_t k = 0; k < D; k += 16) st(o + h * D + k, ld(o + h * D + k) * inv);
            }
            continue;
        }
        float* p = a->part + it * stride;
        attn_chunk<E, NV>(a, b, t0, t1, sc, dots, p, p + H * D, p + H * D + H);
        // Release our partial; the last chunk of the sequence to finish acquires all of them and combines.
        if (__atomic_sub_fetch(&a->pending[b], 1, __ATOMIC_ACQ_REL) == 0) attn_combine(a, b, (L + CH - 1) / CH);
    }
}

template <class E>
KVLM_INLINE void paged_attn_d(const KvlmPagedAttn* a, float* sc, int64_t i0, int64_t i1) {
    if (a->D == 64) paged_attn_t<E, 4>(a, sc, i0, i1);
    else if (a->D == 128) paged_attn_t<E, 8>(a, sc, i0, i1);
    else paged_attn_t<E, 0>(a, sc, i0, i1);
}

int paged_attn(const KvlmPagedAttn* a, float* scores, int64_t i0, int64_t i1) {
    switch (a->kv_dtype) {
        case T_F32: paged_attn_d<KvF32>(a, scores, i0, i1); return 0;
        case T_F16: paged_attn_d<KvF16>(a, scores, i0, i1); return 0;
        case T_BF16: paged_attn_d<KvBF16>(a, scores, i0, i1); return 0;
        default: return -1;
    }
}

}  // namespace

#if defined(KVLM_AVX2) || defined(KVLM_AVX512)
#include "kernels_int8.h"
#define KVLM_INT8 quantize_act, gemv_i8
#else
#define KVLM_INT8 nullptr, nullptr
#endif

extern "C" const KvlmKernels* KVLM_ISA_FN(void) {
    static const KvlmKernels table = {gemv, dequant, paged_attn, KVLM_INT8};
    return &table;
}
