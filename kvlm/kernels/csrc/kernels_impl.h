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
#include <type_traits>

#include "kernels.h"
#include "kv_quantize.h"  // Q4_LEVELS: the int4 KV cache's levels

#include <math.h>
#if defined(KVLM_AVX2) || defined(KVLM_AVX512)
#include <immintrin.h>
#endif
#if defined(KVLM_NEON)
#include <arm_neon.h>
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

// Decode's prefetch for NR weight rows read side by side (rows_dot here, b_rows / b_rows8 in
// kernels_bf16.h): the NR rows after them (`next`: NR * rs bytes, back to back) are fetched in address order
// at the rate these are read. When each row has read `done` bytes, and reads `step` more, the next group's
// bytes [done * nr, (done + step) * nr) are fetched, so it is in cache when its turn comes, whatever K is.
// (A per-row prefetch 1 KB ahead reached into the next row at K = 2048 and missed each group's start.)
// Past a thread's last rows these read lines it does not use; a prefetch never faults.
KVLM_INLINE void prefetch_next_rows(const char* next, int64_t nr, int64_t done, int64_t step) {
    for (int64_t o = done * nr; o < (done + step) * nr; o += 64) __builtin_prefetch(next + o);
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

// Q5_0 / Q5_1: Q4_0 / Q4_1's nibbles plus a 5th bit per element, bit i of the 32-bit qh for element i.
KVLM_INLINE void q5_step(const uint8_t* qh_at, const uint8_t* qs, v16& q0, v16& q1) {
    uint32_t qh;
    memcpy(&qh, qh_at, 4);
    const u16v lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const u16v hv = (u16v){} + qh;
    const i16v q = widen(qs), h0 = (i16v)(((hv >> lane) & 1u) << 4), h1 = (i16v)(((hv >> (lane + 16u)) & 1u) << 4);
    q0 = tof((q & 15) | h0);
    q1 = tof((q >> 4) | h1);
}

struct FmtQ5_0 {  // d f16, qh u32, qs[16]: value = (q - 16) * d
    static constexpr int BE = 32, BB = 22;
    static constexpr bool DENSE = false;
    KVLM_INLINE void step(const uint8_t* b, int, v16& w0, v16& w1) {
        float d = f16(b);
        q5_step(b + 2, b + 6, w0, w1);
        w0 = (w0 - 16.0f) * d;
        w1 = (w1 - 16.0f) * d;
    }
};

struct FmtQ5_1 {  // d f16, m f16, qh u32, qs[16]: value = q * d + m
    static constexpr int BE = 32, BB = 24;
    static constexpr bool DENSE = false;
    KVLM_INLINE void step(const uint8_t* b, int, v16& w0, v16& w1) {
        float d = f16(b), m = f16(b + 2);
        q5_step(b + 4, b + 8, w0, w1);
        w0 = w0 * d + m;
        w1 = w1 * d + m;
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

// Dense formats also give `ld16(p)`: the 16 elements at p as floats (ES bytes per element).
struct FmtF32 {
    static constexpr int BE = 32, BB = 128, ES = 4;
    static constexpr bool DENSE = true;
    KVLM_INLINE v16 ld16(const uint8_t* p) { return ld((const float*)p); }
    KVLM_INLINE void step(const uint8_t* b, int, v16& w0, v16& w1) {
        w0 = ld16(b);
        w1 = ld16(b + 64);
    }
#if defined(KVLM_AVX2)
    KVLM_INLINE v8 ld8(const uint8_t* p) { return (v8)_mm256_loadu_ps((const float*)p); }
#endif
    KVLM_INLINE float elem(const uint8_t* row, int64_t k) {
        float f;
        memcpy(&f, row + 4 * k, 4);
        return f;
    }
};

struct FmtF16 {
    static constexpr int BE = 32, BB = 64, ES = 2;
    static constexpr bool DENSE = true;
    // vcvtph2ps is exact (every half is a float; subnormal halves become normal floats), as is
    // half_to_float: the same values, one instruction per 16 (AVX2: per 8) elements.
    KVLM_INLINE v16 ld16(const uint8_t* p) {
#if defined(KVLM_AVX512)
        return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif defined(KVLM_AVX2)
        return join16<v16>(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)),
                           _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16))));
#else
        return half_to_float(__builtin_convertvector(*(const h16u*)p, u16v));
#endif
    }
    KVLM_INLINE void step(const uint8_t* b, int, v16& w0, v16& w1) {
        w0 = ld16(b);
        w1 = ld16(b + 32);
    }
#if defined(KVLM_AVX2)
    KVLM_INLINE v8 ld8(const uint8_t* p) { return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
#endif
    KVLM_INLINE float elem(const uint8_t* row, int64_t k) { return f16(row + 2 * k); }
};

struct FmtBF16 {  // dequantize only: gemv sends BF16 rows to bf16_gemv (kernels_bf16.h)
    static constexpr int BE = 32, BB = 64, ES = 2;
    static constexpr bool DENSE = true;
    // A bf16 is the top half of its float32: zero-extend each 16-bit value to 32 bits, shift left 16.
    // Written with intrinsics: GCC 12 splits the generic form into 8-lane pieces and re-inserts them.
    KVLM_INLINE v16 ld16(const uint8_t* p) {
#if defined(KVLM_AVX512)
        return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
#elif defined(KVLM_AVX2)
        auto h8 = [](const uint8_t* q) {
            return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)q)), 16));
        };
        return join16<v16>(h8(p), h8(p + 16));
#else
        u16v a = __builtin_convertvector(*(const h16u*)p, u16v) << 16;
        v16 r;
        memcpy(&r, &a, sizeof r);
        return r;
#endif
    }
    KVLM_INLINE void step(const uint8_t* b, int, v16& w0, v16& w1) {
        w0 = ld16(b);
        w1 = ld16(b + 32);
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

// One row of x against NR weight rows of a dense format at once: each output is row_dot<F, 1>'s (the same
// FMAs into the same lanes in the same order, the same tree), but the NR accumulators are independent
// chains, so a short matrix (a LoRA A, r x K) is not bound by one chain's FMA latency.
// Rows in flight for one row of x (a decode step): 4 independent FMA chains. (2026-12-04, Zen 4: 8 rows, or a
// prefetch 1-2 KB ahead in each row, were no faster than 4 rows alone.)
constexpr int DENSE_NR = 4;
// Both bodies prefetch the next NR rows (prefetch_next_rows).
template <class F, int NR>
KVLM_INLINE void rows_dot(const uint8_t* w, int64_t rs, int64_t K, const float* x, float* y) {
    static_assert(F::DENSE, "dense formats only");
    const char* next = (const char*)w + NR * rs;
#if defined(KVLM_AVX2)
    // In 8-lane halves (as tile_dot's AVX2 path, with one row of x): 2 NR ymm accumulators. GCC's 16-lane
    // vectors on two ymm spilled them (the same loop ran at half the AVX-512 path's GB/s).
    v8 a[2][NR];
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < NR; j++) a[h][j] = (v8){};
    const int64_t kb8 = K / F::BE * F::BE;
    for (int64_t k = 0; k < kb8; k += 16) {
        prefetch_next_rows(next, NR, k * F::ES, 16 * F::ES);
        for (int h = 0; h < 2; h++) {
            v8 xv;
            memcpy(&xv, x + k + 8 * h, 32);
            for (int j = 0; j < NR; j++) a[h][j] += F::ld8(w + j * rs + (k + 8 * h) * F::ES) * xv;
        }
    }
    for (int64_t k = kb8; k < K; k++)
        for (int j = 0; j < NR; j++) {
            const int lane = (int)((k - kb8) % 16);
            a[lane / 8][j][lane % 8] += F::elem(w + j * rs, k) * x[k];
        }
    for (int j = 0; j < NR; j++) y[j] = hsum(join16<v16>(a[0][j], a[1][j]));
    return;
#endif
    v16 acc[NR];
    for (int j = 0; j < NR; j++) acc[j] = (v16){};
    const int64_t nb = K / F::BE;
    for (int64_t b = 0; b < nb; b++) {
        const float* xb = x + b * F::BE;
        for (int s = 0; s < F::BE / 32; s++) {
            const v16 x0 = ld(xb + 32 * s), x1 = ld(xb + 32 * s + 16);
            prefetch_next_rows(next, NR, (b * F::BE + 32 * s) * F::ES, 32 * F::ES);
            for (int j = 0; j < NR; j++) {
                v16 w0, w1;
                F::step(w + j * rs + b * F::BB, s, w0, w1);
                acc[j] += w0 * x0;
                acc[j] += w1 * x1;
            }
        }
    }
    for (int64_t k = nb * F::BE; k < K; k++) {
        const int lane = (int)((k - nb * F::BE) % 16);
        for (int j = 0; j < NR; j++) acc[j][lane] += F::elem(w + j * rs, k) * x[k];
    }
    for (int j = 0; j < NR; j++) y[j] = hsum(acc[j]);
}

// Prefill on a dense format: MR rows of x against NR weight rows, an MR x NR register block. Each output
// accumulates exactly as row_dot<F, 1> (lane k % 16, increasing k, one FMA each, the same tree), so its bits
// do not depend on the block it ran in; per 16 elements NR weight vectors and MR x vectors are loaded for
// MR * NR FMAs (row_dot: one x load per FMA, from L2 at prefill sizes).
template <class F, int MR, int NR>
KVLM_INLINE void tile_dot(const uint8_t* w, int64_t rs, int64_t K, const float* x, int64_t ldx, float* y,
                          int64_t ldy) {
#if defined(KVLM_AVX2)
    // In 8-lane halves, one ymm accumulator each (a v16 block would need two registers per weight row and
    // spill): lanes 0..7 take elements k .. k + 7 of each 16, lanes 8..15 the next 8, in increasing k, so
    // every lane's sequence of FMAs is the one above, and the tree joins the halves back.
    v8 a[2][MR][NR];
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < NR; j++) a[h][i][j] = (v8){};
    const auto x8 = [](const float* p) {
        v8 r;
        memcpy(&r, p, 32);
        return r;
    };
    const int64_t kb8 = K / F::BE * F::BE;
    for (int64_t k = 0; k < kb8; k += 16)
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < NR; j++) {
                const v8 wv = F::ld8(w + j * rs + (k + 8 * h) * F::ES);
                for (int i = 0; i < MR; i++) a[h][i][j] += wv * x8(x + i * ldx + k + 8 * h);
            }
    for (int64_t k = kb8; k < K; k++)
        for (int j = 0; j < NR; j++) {
            const float wk = F::elem(w + j * rs, k);
            const int lane = (int)((k - kb8) % 16);
            for (int i = 0; i < MR; i++) a[lane / 8][i][j][lane % 8] += wk * x[i * ldx + k];
        }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) y[i * ldy + j] = hsum(join16<v16>(a[0][i][j], a[1][i][j]));
    return;
#endif
    v16 acc[MR][NR];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = (v16){};
    const int64_t kb = K / F::BE * F::BE;  // whole 32-element pseudo-blocks, then the scalar tail
    for (int64_t k = 0; k < kb; k += 16) {
        v16 wv[NR];
        for (int j = 0; j < NR; j++) wv[j] = F::ld16(w + j * rs + k * F::ES);
        for (int i = 0; i < MR; i++) {
            const v16 xv = ld(x + i * ldx + k);
            for (int j = 0; j < NR; j++) acc[i][j] += wv[j] * xv;
        }
    }
    for (int64_t k = kb; k < K; k++)
        for (int j = 0; j < NR; j++) {
            const float wk = F::elem(w + j * rs, k);
            for (int i = 0; i < MR; i++) acc[i][j][(k - kb) % 16] += wk * x[i * ldx + k];
        }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) y[i * ldy + j] = hsum(acc[i][j]);
}

// Register blocks (x rows, weight rows): AVX-512 6 x 4 (24 accumulators of 32 registers); AVX2 2 x 3 in
// 8-lane halves (12 of 16; a 2 x 2 block of whole v16s, two ymm each, ran 1.7x slower than row_dot there).
// A panel of PANEL_ROWS weight rows (f16 at K = 2048: 64 KB) stays in L2 while every block of x rows passes
// over it. The baseline and NEON keep row_dot (the same bits either way).
#if defined(KVLM_AVX512)
constexpr bool DENSE_TILES = true;
constexpr int TILE_MR = 6, TILE_NR = 4;
#elif defined(KVLM_AVX2)
constexpr bool DENSE_TILES = true;
constexpr int TILE_MR = 2, TILE_NR = 3;
#else
constexpr bool DENSE_TILES = false;
constexpr int TILE_MR = 2, TILE_NR = 2;
#endif
constexpr int64_t PANEL_ROWS = 4 * TILE_NR;  // a whole number of blocks

template <class F, int MR>
KVLM_INLINE void tile_rows(const uint8_t* w, int64_t rs, int64_t K, const float* x, int64_t M, float* y,
                           int64_t ldy, int64_t n, int64_t ne, int64_t m) {
    for (int64_t j = n; j < ne; j += TILE_NR)
        tile_dot<F, MR, TILE_NR>(w + j * rs, rs, K, x + m * K, K, y + m * ldy + j, ldy);
}

template <class F>
void dense_panels(const uint8_t* w, int64_t rs, int64_t K, const float* x, int64_t M, float* y, int64_t ldy,
                  int64_t n0, int64_t n1) {
    const int64_t nt = n0 + (n1 - n0) / TILE_NR * TILE_NR;  // whole register blocks; the rest by row_dot
    for (int64_t n = n0; n < nt; n += PANEL_ROWS) {
        const int64_t ne = n + PANEL_ROWS < nt ? n + PANEL_ROWS : nt;
        int64_t m = 0;
        for (; m + TILE_MR <= M; m += TILE_MR) tile_rows<F, TILE_MR>(w, rs, K, x, M, y, ldy, n, ne, m);
        for (; m < M; m++) tile_rows<F, 1>(w, rs, K, x, M, y, ldy, n, ne, m);
    }
    for (int64_t n = nt; n < n1; n++)
        for (int64_t m = 0; m < M; m++) row_dot<F, 1>(w + n * rs, K, x + m * K, K, y + m * ldy + n, ldy);
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
    if constexpr (F::DENSE)
        if (M == 1)  // one row of x (a decode step, a LoRA A product): four weight rows at a time, same bits
            for (; n0 + DENSE_NR <= n1; n0 += DENSE_NR) rows_dot<F, DENSE_NR>(w + n0 * rs, rs, K, x, y + n0);
    if constexpr (F::DENSE && DENSE_TILES)
        if (M >= TILE_MR) return dense_panels<F>(w, rs, K, x, M, y, ldy, n0, n1);
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
        case T_Q5_0: CALL(FmtQ5_0); break;  \
        case T_Q5_1: CALL(FmtQ5_1); break;  \
        case T_Q4_K: CALL(FmtQ4_K); break;  \
        case T_Q5_K: CALL(FmtQ5_K); break;  \
        case T_Q6_K: CALL(FmtQ6_K); break;  \
        default: return -1;                 \
    }

// This thread's buffer of n T (64-byte aligned), grown to the largest n asked for and kept (one per T).
template <class T>
T* thread_buffer(int64_t n) {
    static __thread T* buf = nullptr;
    static __thread int64_t cap = 0;
    if (n > cap) {
        free(buf);
        buf = (T*)aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
        cap = buf ? n : 0;
    }
    return buf;
}

// ---- BF16 weights: bf16 activations (kernels_bf16.h has the contract) ----------------------------

namespace bf16_emu {
#include "kernels_bf16.h"
}
// The vdpbf16ps form, on the AVX-512 VNNI unit (every CPU with AVX-512 BF16 has VNNI: Cooper Lake, Sapphire
// Rapids, Zen 4 and 5), run where the CPU reports it; the AVX-512 unit keeps the spelled-out form, so one CPU
// can compare the two (tests/kernels/test_dense.py).
#if defined(KVLM_AVX512) && defined(KVLM_VNNI) && !defined(__clang__)
#define KVLM_BF16_UNIT 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx2,fma,f16c,bmi2,prefer-vector-width=512")
#define KVLM_BF16_HW 1
namespace bf16_hw {
#include "kernels_bf16.h"
}
#undef KVLM_BF16_HW
#pragma GCC pop_options
#endif

// Denormal inputs and results flushed to zero while it lives (x86 MXCSR FTZ + DAZ, AArch64 FPCR.FZ): what
// vdpbf16ps always does, so the spelled-out form does it too.
struct FlushDenormals {
#if defined(__x86_64__) || defined(__i386__)
    unsigned saved = __builtin_ia32_stmxcsr();
    FlushDenormals() { __builtin_ia32_ldmxcsr(saved | 0x8040u); }
    ~FlushDenormals() { __builtin_ia32_ldmxcsr(saved); }
#elif defined(__aarch64__)
    uint64_t saved;
    FlushDenormals() {
        __asm__ volatile("mrs %0, fpcr" : "=r"(saved));
        __asm__ volatile("msr fpcr, %0" : : "r"(saved | (1ull << 24)));
    }
    ~FlushDenormals() { __asm__ volatile("msr fpcr, %0" : : "r"(saved)); }
#endif
};

int bf16_gemv(const uint8_t* w, int64_t rs, int64_t K, const float* x, int64_t M, float* y, int64_t ldy, int64_t n0,
              int64_t n1) {
    const int64_t ldx = (K + 31) / 32 * 32;
    FlushDenormals flush;
#if defined(KVLM_BF16_UNIT)
    static const bool hw = __builtin_cpu_supports("avx512bf16");
    if (hw) {
        uint16_t* xb = thread_buffer<uint16_t>(M * ldx);
        if (xb == nullptr) return -1;
        bf16_hw::to_x(x, M, K, xb, ldx);
        bf16_hw::b_gemm(w, rs, K, xb, ldx, M, y, ldy, n0, n1);
        return 0;
    }
#endif
    bf16_emu::XT* xb = thread_buffer<bf16_emu::XT>(M * ldx);
    if (xb == nullptr) return -1;
    bf16_emu::to_x(x, M, K, xb, ldx);
    bf16_emu::b_gemm(w, rs, K, xb, ldx, M, y, ldy, n0, n1);
    return 0;
}

int gemv(int qtype, const uint8_t* w, int64_t rs, int64_t K, const float* x, int64_t M, float* y, int64_t ldy,
         int64_t n0, int64_t n1) {
    if (qtype == T_BF16) return bf16_gemv(w, rs, K, x, M, y, ldy, n0, n1);
// (BF16 returned above: its widened row kernels are not instantiated; FmtBF16 serves dequant_t)
#define KVLM_GEMV(F) \
    if constexpr (!std::is_same_v<F, FmtBF16>) gemv_t<F>(w, rs, K, x, M, y, ldy, n0, n1)
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
// One body for every vector width (v16; v8 on the AVX2 path, where a v16 lives in two registers): the
// same operations on each lane, so the same bits. `bc` broadcasts a float to x's type.
typedef int32_t i8v __attribute__((vector_size(32)));
KVLM_INLINE v16 bc(v16, float f) { return splat(f); }
KVLM_INLINE v8 bc(v8, float f) { return (v8){f, f, f, f, f, f, f, f}; }
template <class V, class I>
KVLM_INLINE V exp_neg_v(V x) {
    const V lo = bc(x, -87.33654f);
    I under = x < lo;
    x = under ? lo : x;
    V fx = x * 1.44269504088896341f + 0.5f;
    V nf = __builtin_convertvector(__builtin_convertvector(fx, I), V);
    nf = (nf > fx) ? nf - 1.0f : nf;  // floor
    x = x - nf * 0.693359375f;
    x = x - nf * -2.12194440e-4f;
    V z = x * x;
    V y = bc(x, 1.9875691500E-4f);
    y = y * x + 1.3981999507E-3f;
    y = y * x + 8.3334519073E-3f;
    y = y * x + 4.1665795894E-2f;
    y = y * x + 1.6666665459E-1f;
    y = y * x + 5.0000001201E-1f;
    y = y * z + x + 1.0f;
    I e = (__builtin_convertvector(nf, I) + 127) << 23;
    V p;
    memcpy(&p, &e, sizeof p);
    y = y * p;
    return under ? bc(x, 0.0f) : y;
}
KVLM_INLINE v16 exp_neg(v16 x) { return exp_neg_v<v16, i16v>(x); }

// K/V cache element types: load(p, e) = elements e .. e + 15 of the head row at p (e % 16 == 0) as 16
// floats, load8(p, e) elements e .. e + 7 (AVX2, e % 8 == 0); head(D) = a head row's length in T.
#if defined(KVLM_AVX2)
// AVX2 works on 8-lane halves where it can (load8: 8 consecutive elements): GCC keeps arrays of v16 (two
// ymm each) on the stack and moves them through general registers, several times slower.
typedef float v8u __attribute__((vector_size(32), aligned(4)));
KVLM_INLINE v8 ld8(const float* p) { return *(const v8u*)p; }
KVLM_INLINE void st8(float* p, v8 v) { *(v8u*)p = v; }
KVLM_INLINE v8 splat8(float f) { return (v8){f, f, f, f, f, f, f, f}; }
#endif

struct KvF32 {
    typedef float T;
    static constexpr int64_t head(int64_t D) { return D; }
    KVLM_INLINE v16 load(const T* p, int64_t e) { return ld(p + e); }
#if defined(KVLM_AVX2)
    KVLM_INLINE v8 load8(const T* p, int64_t e) { return ld8(p + e); }
#endif
};
struct KvF16 {
    typedef uint16_t T;
    static constexpr int64_t head(int64_t D) { return D; }
    KVLM_INLINE v16 load(const T* p, int64_t e) { return FmtF16::ld16((const uint8_t*)(p + e)); }
#if defined(KVLM_AVX2)
    KVLM_INLINE v8 load8(const T* p, int64_t e) {
        return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + e)));
    }
#endif
};
struct KvBF16 {
    typedef uint16_t T;
    static constexpr int64_t head(int64_t D) { return D; }
    KVLM_INLINE v16 load(const T* p, int64_t e) { return FmtBF16::ld16((const uint8_t*)(p + e)); }
#if defined(KVLM_AVX2)
    KVLM_INLINE v8 load8(const T* p, int64_t e) {  // the same bits: each u16 widened, shifted into the high half
        p += e;
        return (v8)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
    }
#endif
};

#include "kernels_attn_quant.h"  // KvQ8, KvQ4: int8 / int4 codes read in place

#if defined(KVLM_AVX2)
// Lane t of the result = the 8 lanes of h[t] summed in hsum's tree after its first step: c_j = b_j + b_{j+4},
// d_j = c_j + c_{j+2}, d_0 + d_1 (b = h[t]). So AVX2's scores are AVX-512's and the baseline's bit for bit.
// Tokens t and t + 4 share a register through the first two steps (low and high 128-bit lanes), so the
// last shuffles put tokens 0..7 in order.
KVLM_INLINE __m256 sum8_tree(const __m256* h) {
    __m256 c[4], d[2];
    for (int t = 0; t < 4; t++)  // [c(t) | c(t + 4)], 4 lanes each
        c[t] = _mm256_add_ps(_mm256_permute2f128_ps(h[t], h[t + 4], 0x20), _mm256_permute2f128_ps(h[t], h[t + 4], 0x31));
    for (int i = 0; i < 2; i++)  // [d0 d1 of t = 2i, d0 d1 of 2i + 1 | the same of t + 4]
        d[i] = _mm256_add_ps(_mm256_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44), _mm256_shuffle_ps(c[2 * i], c[2 * i + 1], 0xee));
    return _mm256_add_ps(_mm256_shuffle_ps(d[0], d[1], 0x88), _mm256_shuffle_ps(d[0], d[1], 0xdd));
}
#endif

// Sums of 16 vectors at once: lane t of the result is the sum of the lanes of x[t]. AVX-512: a fixed
// tree of 15 adds and 30 shuffles (halves, quarters, ...) instead of 16 horizontal sums of ~8 steps each.
// AVX2 (where GCC would split those 512-bit shuffles into scalar inserts): halves added, then the same
// tree on 8-lane registers (sum8_tree). Baseline: 16 horizontal sums (hsum). One tree on every ISA.
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
        r[half] = sum8_tree(h);
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

#if defined(KVLM_AVX2)
// sum16 of 16 dots given as halves (lo[t]: lanes 0..7 of token t's dot, hi[t]: lanes 8..15), the same
// tree as the AVX2 sum16 above (whose first step adds the halves); r[0] = tokens 0..7, r[1] = 8..15.
KVLM_INLINE void sum16_halves(const v8* lo, const v8* hi, __m256* r) {
    for (int half = 0; half < 2; half++) {
        __m256 h[8];
        for (int i = 0; i < 8; i++) h[i] = (__m256)(lo[8 * half + i] + hi[8 * half + i]);
        r[half] = sum8_tree(h);
    }
}
#endif

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

// One query row's share of a work item: tokens [t0, t0 + n) of its chunk (n <= chunk; n = 0 only for an
// empty row), and where its results go.
struct AttnRow {
    const float* q;  // (H, D)
    float* acc;      // (H, D): the row's out (a one-chunk row) or its partial state for this chunk
    float* mx;       // (H,) the chunk's max score per head
    float* den;      // (H,) the chunk's sum of exp(score - max) per head
    float* sc;       // (H, chunk) scores, then exp(score - max)
    int64_t n;
    int64_t skip;    // leading tokens of the chunk before the row's sliding window (masked to -inf)
    bool k0;         // the chunk holds the row's position-0 key, stored centered on k0 (KvlmPagedAttn)
};

// Row r's score of its token 0 += scale * (q_h . k0_delta[h / G]) per head h in [h0, h1), the dot in a fixed
// order: 16-lane products summed over D / 16, then hsum (the position-0 key's center correction, KvlmPagedAttn).
KVLM_INLINE void attn_k0_correct(const KvlmPagedAttn* a, const AttnRow& r, int64_t h0, int64_t h1) {
    const int64_t H = a->H, D = a->D, G = H / a->kv_heads, CH = a->chunk;
    for (int64_t h = h0; h < h1; h++) {
        const float* q = r.q + h * D;
        const float* d = a->k0_delta + (h / G) * D;
        v16 s = (v16){};
        for (int64_t i = 0; i < D; i += 16) s += ld(q + i) * ld(d + i);
        r.sc[h * CH] += hsum(s) * a->scale;
    }
}

// (row, head) pairs per register block: the K pass keeps P pairs' q (P * NV vectors) and one token's K
// (NV); the V pass P pairs' acc (P * NV) and one token's V (NV). AVX-512 has 32 vector registers; AVX2
// (16 of half the width, worked in halves below) and the baseline take one pair at a time. The
// arithmetic of each pair is the same for any P.
#if defined(KVLM_AVX512)
constexpr int ATTN_KP = 2, ATTN_VP = 4;
#else
constexpr int ATTN_KP = 1, ATTN_VP = 1;
#endif

// The (row, head) pairs of one kv head g over rows j0 .. nr - 1, in order: (j0, g G), (j0, g G + 1), ...,
// (j0 + 1, g G), ...; `next` steps to the following pair (no division in the loops).
struct AttnPairs {
    const AttnRow* r;
    int64_t h, h0, h1;
    inline __attribute__((always_inline)) void next() {
        if (++h == h1) h = h0, r++;
    }
};

// K pass, one 16-token group (cache element offsets `off`) against P (row, head) pairs of kv head g:
// The next P (row, head) pairs of `pr` for 16-token group `grp`: each pair's query, where its scores go,
// and how many of the group's tokens its row attends (the rest are masked).
template <int P>
KVLM_INLINE void attn_pair_ptrs(AttnPairs& pr, int64_t D, int64_t CH, int64_t grp, const float** qp, float** sp,
                                int64_t* nt) {
    for (int p = 0; p < P; p++, pr.next()) {
        qp[p] = pr.r->q + pr.h * D;
        sp[p] = pr.r->sc + pr.h * CH + 16 * grp;
        nt[p] = pr.r->n - 16 * grp < 16 ? pr.r->n - 16 * grp : 16;
    }
}

// scores s[i] = scale * q[h] . K[token i, g], lane k % 16 of the dot accumulating in increasing k, then
// sum16; tokens at or past the row's n masked to -inf. kg = the cache plus g * E::head(D).
template <class E, int NV, int P>
KVLM_INLINE void attn_k_pairs(const KvlmPagedAttn* a, const typename E::T* kg, const int64_t* off, AttnPairs& pr,
                              int64_t grp) {
    const int64_t D = a->D, CH = a->chunk, nv = NV ? NV : D / 16;
    const float* qp[P];
    float* sp[P];
    int64_t nt[P];
    attn_pair_ptrs<P>(pr, D, CH, grp, qp, sp, nt);
#if defined(KVLM_AVX2)
    if constexpr (NV != 0) {  // in 8-lane halves: lane j of a dot is lane j % 8 of half j / 8, same products
        for (int p = 0; p < P; p++) {
            v8 qv[2 * NV], lo[16], hi[16];
            for (int k = 0; k < 2 * NV; k++) qv[k] = ld8(qp[p] + 8 * k);
            for (int i = 0; i < 16; i++) {
                v8 sl = (v8){}, sh = (v8){};
                for (int k = 0; k < NV; k++) {
                    sl += qv[2 * k] * E::load8(kg + off[i], 16 * k);
                    sh += qv[2 * k + 1] * E::load8(kg + off[i], 16 * k + 8);
                }
                lo[i] = sl;
                hi[i] = sh;
            }
            __m256 r[2];
            sum16_halves(lo, hi, r);
            st8(sp[p], (v8)r[0] * splat8(a->scale));
            st8(sp[p] + 8, (v8)r[1] * splat8(a->scale));
            for (int64_t i = nt[p]; i < 16; i++) sp[p][i] = -__builtin_inff();
        }
        return;
    }
#endif
    v16 dots[P][16];
    if (NV) {
        v16 qv[P][NV ? NV : 1];
        for (int p = 0; p < P; p++)
            for (int k = 0; k < NV; k++) qv[p][k] = ld(qp[p] + 16 * k);
        for (int i = 0; i < 16; i++) {
            v16 kv[NV ? NV : 1];
            for (int k = 0; k < NV; k++) kv[k] = E::load(kg + off[i], 16 * k);
            for (int p = 0; p < P; p++) {
                v16 s = (v16){};
                for (int k = 0; k < NV; k++) s += qv[p][k] * kv[k];
                dots[p][i] = s;
            }
        }
    } else {
        for (int i = 0; i < 16; i++)
            for (int p = 0; p < P; p++) {
                v16 s = (v16){};
                for (int64_t k = 0; k < nv; k++) s += ld(qp[p] + 16 * k) * E::load(kg + off[i], 16 * k);
                dots[p][i] = s;
            }
    }
    for (int p = 0; p < P; p++) {
        v16 s = sum16((const v16u*)dots[p]) * splat(a->scale);
        for (int64_t i = nt[p]; i < 16; i++) s[i] = -__builtin_inff();
        st(sp[p], s);
    }
}

#if defined(KVLM_AVX512)
// The K pass with tokens on the lanes, for groups shared by many (row, head) pairs (AVX-512 only). The
// direct form above computes lane j of a dot, A_j = sum_k q[16k + j] * K[16k + j] (k increasing), for
// one token, then sum16 adds the 16 lanes in a fixed tree. Here the group's K rows are transposed once
// (kt[d] = dim d of the 16 tokens) and A_j is computed for the 16 tokens at once, the same products in
// the same order, and the tree is the same adds between whole vectors:
// ((A0 + A8) + (A4 + A12)) + ((A2 + A10) + (A6 + A14)), plus the same of A1, A3, ..., added last (the
// AVX-512 sum16, halves then quarters, ...). Same bits, no per-token horizontal sums.
constexpr int ATTN_LP = 4;          // pairs per register block
constexpr int64_t ATTN_LANES_MIN = 8;  // pairs of a kv head that make the transpose worth it

// out[c] = column c of the 16 x 16 block in[0 .. 15] (rows), the classic 4-stage shuffle network.
KVLM_INLINE void transpose16(const v16* in, v16* out) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = (__m512)in[i];
    for (int i = 0; i < 8; i++) {  // per 128-bit lane: (r0[0] r1[0] r0[1] r1[1]), (r0[2] r1[2] r0[3] r1[3])
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  // r[4i + c], lane L: rows 4i .. 4i + 3 of column 4L + c
        r[4 * i] = (__m512)_mm512_unpacklo_pd((__m512d)t[4 * i], (__m512d)t[4 * i + 2]);
        r[4 * i + 1] = (__m512)_mm512_unpackhi_pd((__m512d)t[4 * i], (__m512d)t[4 * i + 2]);
        r[4 * i + 2] = (__m512)_mm512_unpacklo_pd((__m512d)t[4 * i + 1], (__m512d)t[4 * i + 3]);
        r[4 * i + 3] = (__m512)_mm512_unpackhi_pd((__m512d)t[4 * i + 1], (__m512d)t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {  // lanes: (rows 0-3 | 4-7 or 8-11 | 12-15) of columns c, c + 8 or c + 4, c + 12
        t[c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
        t[4 + c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);
        t[8 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
        t[12 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
    }
    for (int c = 0; c < 4; c++) {
        out[c] = (v16)_mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);
        out[c + 8] = (v16)_mm512_shuffle_f32x4(t[c], t[8 + c], 0xdd);
        out[c + 4] = (v16)_mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0x88);
        out[c + 12] = (v16)_mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0xdd);
    }
}

// kt (16 NV) = the group's K rows of kv head g transposed: kt[d] lane i = K[token i, g][d].
template <class E, int NV>
KVLM_INLINE void attn_k_transpose(const typename E::T* kg, const int64_t* off, v16* kt) {
    for (int k = 0; k < NV; k++) {
        v16 rowk[16];
        for (int i = 0; i < 16; i++) rowk[i] = E::load(kg + off[i], 16 * k);
        transpose16(rowk, kt + 16 * k);
    }
}

// o[p] = A_j of pair p for the 16 tokens (lane i: token i).
template <int NV, int P>
KVLM_INLINE void attn_k_leaf(const v16* kt, const float* const* qp, int j, v16* o) {
    for (int p = 0; p < P; p++) o[p] = (v16){};
    for (int k = 0; k < NV; k++) {
        const v16 kv = kt[16 * k + j];
        for (int p = 0; p < P; p++) o[p] += splat(qp[p][16 * k + j]) * kv;
    }
}

// c[p] = (A_j + A_{j+8}) + (A_{j+4} + A_{j+12}) of pair p.
template <int NV, int P>
KVLM_INLINE void attn_k_quad(const v16* kt, const float* const* qp, int j, v16* c) {
    v16 x[P], y[P], b[P];
    attn_k_leaf<NV, P>(kt, qp, j, x);
    attn_k_leaf<NV, P>(kt, qp, j + 8, y);
    for (int p = 0; p < P; p++) b[p] = x[p] + y[p];
    attn_k_leaf<NV, P>(kt, qp, j + 4, x);
    attn_k_leaf<NV, P>(kt, qp, j + 12, y);
    for (int p = 0; p < P; p++) c[p] = b[p] + (x[p] + y[p]);
}

template <int NV, int P>
KVLM_INLINE void attn_k_lanes(const KvlmPagedAttn* a, const v16* kt, AttnPairs& pr, int64_t grp) {
    const int64_t D = a->D, CH = a->chunk;
    const float* qp[P];
    float* sp[P];
    int64_t nt[P];
    attn_pair_ptrs<P>(pr, D, CH, grp, qp, sp, nt);
    v16 c0[P], c1[P], d0[P];
    attn_k_quad<NV, P>(kt, qp, 0, c0);
    attn_k_quad<NV, P>(kt, qp, 2, c1);
    for (int p = 0; p < P; p++) d0[p] = c0[p] + c1[p];  // D_0 = C_0 + C_2
    attn_k_quad<NV, P>(kt, qp, 1, c0);
    attn_k_quad<NV, P>(kt, qp, 3, c1);
    for (int p = 0; p < P; p++) {
        v16 s = (d0[p] + (c0[p] + c1[p])) * splat(a->scale);  // D_0 + D_1, D_1 = C_1 + C_3
        for (int64_t i = nt[p]; i < 16; i++) s[i] = -__builtin_inff();
        st(sp[p], s);
    }
}
#endif

// V pass, one 16-token group against P (row, head) pairs of kv head g: acc[h] += p[i] * V[token i, g] for
// i < the row's tokens in the group, in token order. vg = the cache plus g * E::head(D).
template <class E, int NV, int P>
KVLM_INLINE void attn_v_pairs(const KvlmPagedAttn* a, const typename E::T* vg, const int64_t* off, AttnPairs& pr,
                              int64_t grp) {
    const int64_t D = a->D, CH = a->chunk, nv = NV ? NV : D / 16;
    const float* pp[P];
    float* ap[P];
    int64_t nt[P], ntmin = 16;
    for (int p = 0; p < P; p++, pr.next()) {
        pp[p] = pr.r->sc + pr.h * CH + 16 * grp;
        ap[p] = pr.r->acc + pr.h * D;
        nt[p] = pr.r->n - 16 * grp < 16 ? pr.r->n - 16 * grp : 16;
        ntmin = nt[p] < ntmin ? nt[p] : ntmin;
    }
#if defined(KVLM_AVX2)
    if constexpr (NV != 0) {  // 8-lane registers, 64 columns at a time (the columns of acc are independent)
        constexpr int W = 2 * NV < 8 ? 2 * NV : 8;
        for (int p = 0; p < P; p++)
            for (int64_t c = 0; c < D; c += 8 * W) {
                v8 acc[W];
                for (int k = 0; k < W; k++) acc[k] = ld8(ap[p] + c + 8 * k);
                for (int64_t i = 0; i < nt[p]; i++) {
                    const v8 pi = splat8(pp[p][i]);
                    for (int k = 0; k < W; k++) acc[k] += pi * E::load8(vg + off[i], c + 8 * k);
                }
                for (int k = 0; k < W; k++) st8(ap[p] + c + 8 * k, acc[k]);
            }
        return;
    }
#endif
    if (NV) {
        v16 acc[P][NV ? NV : 1];
        for (int p = 0; p < P; p++)
            for (int k = 0; k < NV; k++) acc[p][k] = ld(ap[p] + 16 * k);
        int64_t i = 0;
        for (; i < ntmin; i++) {  // tokens of every pair: each V row loaded once
            v16 vv[NV ? NV : 1];
            for (int k = 0; k < NV; k++) vv[k] = E::load(vg + off[i], 16 * k);
            for (int p = 0; p < P; p++) {
                const v16 pi = splat(pp[p][i]);
                for (int k = 0; k < NV; k++) acc[p][k] += pi * vv[k];
            }
        }
        for (int p = 0; p < P; p++)  // a shorter row's last group ends before the others'
            for (int64_t t = i; t < nt[p]; t++) {
                const v16 pi = splat(pp[p][t]);
                for (int k = 0; k < NV; k++) acc[p][k] += pi * E::load(vg + off[t], 16 * k);
            }
        for (int p = 0; p < P; p++)
            for (int k = 0; k < NV; k++) st(ap[p] + 16 * k, acc[p][k]);
    } else {
        for (int p = 0; p < P; p++)
            for (int64_t k = 0; k < nv; k++) {
                v16 r = ld(ap[p] + 16 * k);
                for (int64_t i = 0; i < nt[p]; i++) r += splat(pp[p][i]) * E::load(vg + off[i], 16 * k);
                st(ap[p] + 16 * k, r);
            }
    }
}

#if defined(KVLM_AVX2)
// AVX2 takes one (row, head) pair at a time (16 registers of 8 lanes hold one pair's q or acc), so each
// pair would decode the group's K or V rows again: G times per token for one decode row (3 for SmolLM2's
// 9 / 3 heads). For int8 and int4 codes (widened, converted, scaled; int4 through two permutes) that
// decoding bound the kernel: with two or more pairs on a kv head, its 16 rows are decoded once into buf
// (16 x D floats, L1) and every pair reads them as float32 rows. load8 gives the same floats either way,
// so the bits do not change. 30 layers of SmolLM2's cache at 2,048 tokens, 2 threads, ms per step (AMD
// EPYC Zen 5, 2026-12-04, before the prefetch below): int8 3.6 -> 3.2, int4 4.6 -> 3.2. Not float16 or
// bf16, whose widening is one instruction: the round trip through buf made float16 slower (3.6 -> 4.0).
//
// int4 codes go through a byte table instead of load8 (the levels are integers in int8's range): a
// 32-value group's 16 bytes split into low and high nibbles, `pshufb` turns each nibble into its level,
// then the levels are widened, converted and scaled as int8 codes are; 4 instructions per 8 values
// instead of 8. The same float per value: the integer level times the group's scale.
struct Q4LevelsI8 {
    alignas(16) int8_t v[16];
};
constexpr Q4LevelsI8 q4_levels_i8() {
    Q4LevelsI8 t{};
    for (int i = 0; i < 16; i++) t.v[i] = (int8_t)kvlm::Q4_LEVELS[i];
    return t;
}
constexpr bool q4_levels_fit_i8() {  // each level an integer that int8 holds, so the table is exact
    for (int i = 0; i < 16; i++)
        if (kvlm::Q4_LEVELS[i] != (float)q4_levels_i8().v[i]) return false;
    return true;
}
static_assert(q4_levels_fit_i8(), "int4's levels must be integers in int8's range for the byte table");

// buf (16 x D floats) = the 16 rows at kg + off[i], decoded; boff[i] = row i's offset in buf.
template <class E, int NV>
KVLM_INLINE void attn_decode_group(const typename E::T* kg, const int64_t* off, float* buf, int64_t* boff) {
    constexpr int64_t D = 16 * NV;
    if constexpr (std::is_same_v<E, KvQ4>) {
        static constexpr Q4LevelsI8 LV = q4_levels_i8();
        const __m128i lv = _mm_load_si128((const __m128i*)LV.v), m4 = _mm_set1_epi8(15);
        for (int i = 0; i < 16; i++) {
            for (int64_t j = 0; j < D / 32; j++) {
                const uint8_t* g = kg + off[i] + j * KvQ4::GB;
                const __m256 d = _mm256_set1_ps(f16(g));
                const __m128i b = _mm_loadu_si128((const __m128i*)(g + 2));
                const __m128i lo = _mm_shuffle_epi8(lv, _mm_and_si128(b, m4));
                const __m128i hi = _mm_shuffle_epi8(lv, _mm_and_si128(_mm_srli_epi16(b, 4), m4));
                float* o = buf + i * D + 32 * j;
                _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), d));
                _mm256_storeu_ps(o + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), d));
                _mm256_storeu_ps(o + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), d));
                _mm256_storeu_ps(o + 24, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), d));
            }
            boff[i] = i * D;
        }
        return;
    }
    for (int i = 0; i < 16; i++) {
        for (int k = 0; k < 2 * NV; k++) st8(buf + i * D + 8 * k, E::load8(kg + off[i], 8 * k));
        boff[i] = i * D;
    }
}
#endif

// Software prefetch of a 16-token group's K or V rows, ATTN_PF groups ahead of the pass. Blocks lie
// wherever the allocator put them and one thread works through an item alone, so without this its loads
// wait on memory: the first load of each K / V row was the kernel's hottest instruction at 2,048 tokens.
// Float caches (a head's row is 2+ lines) prefetch kv head g's part of the rows as the pass reaches g,
// which spreads the prefetches over the pass; int8 / int4 rows (a head is 34 or 18 bytes a group) prefetch
// the whole group at its start. One thread, 30 layers of SmolLM2's cache at 2,048 tokens, CPU ms per step
// (AMD EPYC Zen 5, AVX2 path, 2026-12-04), no prefetch / whole group 1 ahead / per head 1 ahead: float32
// 8.6 / 8.4 / 7.1, float16 6.3 / 4.5 / 4.2, int8 5.1 / 4.3 / 4.6, int4 5.2 / 4.7 / 5.1; 2 and 4 groups
// ahead were slower. (A plain read of the same float32 cache takes 2.9 ms: this kernel's float32 pass is
// still bound by its loads, not its arithmetic.) Reading ahead changes no arithmetic.
constexpr int64_t ATTN_PF = 1;
// Tokens t0 .. min(t0 + 16, t1) - 1 of a sequence (block table tab), elements [h0, h0 + len) of each
// token's row (row: its length in elements of esize bytes).
KVLM_INLINE void attn_prefetch(const int32_t* tab, int64_t BS, int64_t row, int64_t t0, int64_t t1, const char* base,
                               int64_t esize, int64_t h0, int64_t len) {
    if (t0 >= t1) return;
    const int64_t n = t1 - t0 < 16 ? t1 - t0 : 16, rb = row * esize, lb = len * esize;
    int64_t j = t0 / BS, s = t0 % BS;
    if (len == row) {  // whole rows: runs of consecutive rows within one block
        for (int64_t i = 0; i < n;) {
            const int64_t m = BS - s < n - i ? BS - s : n - i;
            const char* p = base + ((int64_t)tab[j] * BS + s) * rb;
            for (int64_t b = 0; b < m * rb; b += 64) __builtin_prefetch(p + b, 0, 3);
            i += m, s = 0, j++;
        }
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        const char* p = base + ((int64_t)tab[j] * BS + s) * rb + h0 * esize;
        for (int64_t b = 0; b < lb; b += 64) __builtin_prefetch(p + b, 0, 3);
        if (++s == BS) s = 0, j++;
    }
}
// Whether a pass prefetches per kv head (float caches) or per group (int8 / int4 codes).
template <class E>
constexpr bool attn_pf_per_head = sizeof(typename E::T) >= 2;

// One work item: rows[0 .. nr) of one sequence (block table `tab`), by ascending n, over the chunk that
// starts at token t0, kv heads [g0, g1) and their query heads [h0, h1). Two passes, K then V, each streaming
// the chunk's 16-token groups front to back (all kv heads of a token are one contiguous row; the next group's
// part for these heads prefetched, attn_prefetch); a group's K or V rows come from memory once and from L1 for
// every further (row, head) pair. Per row: the heads' scores into sc (H, chunk) rows h0 .. h1 - 1, the chunk's
// softmax, then acc (H, D) rows h0 .. h1 - 1 = sum p * V. A row takes
// part in a group only while it has tokens there (n > 16 * grp); rows sorted by n make those a suffix.
// NV = D / 16 if fixed at compile time, else 0.
template <class E, int NV>
void attn_chunk(const KvlmPagedAttn* a, const int32_t* tab, int64_t t0, AttnRow* rows, int64_t nr, int64_t g0,
                int64_t g1) {
    typedef typename E::T T;
    const int64_t H = a->H, KVH = a->kv_heads, D = a->D, CH = a->chunk, G = H / KVH, row = KVH * E::head(D);
    const int64_t h0 = g0 * G, h1 = g1 * G, e0 = g0 * E::head(D), en = (g1 - g0) * E::head(D);  // heads; elements
    const int64_t nmax = rows[nr - 1].n, ngrp = (nmax + 15) / 16;
    const T* kc = (const T*)a->k_cache;
    const T* vc = (const T*)a->v_cache;
    int64_t off[16];
#if defined(KVLM_AVX2)
    alignas(32) float buf[16 * 16 * (NV ? NV : 1)];  // one kv head's group, decoded (attn_decode_group)
    int64_t boff[16];
#endif
    // K pass. Offsets cover the longest row's tokens (the others mask what lies past their own n).
    for (int64_t grp = 0, j0 = 0; grp < ngrp; grp++) {
        while (rows[j0].n <= 16 * grp) j0++;
        token_rows(tab, a->block_size, row, t0 + 16 * grp, t0 + nmax, off);
        if constexpr (!attn_pf_per_head<E>)
            attn_prefetch(tab, a->block_size, row, t0 + 16 * (grp + ATTN_PF), t0 + nmax, (const char*)kc, sizeof(T), e0, en);
        if (grp + ATTN_PF >= ngrp)  // the V pass's first groups
            attn_prefetch(tab, a->block_size, row, t0 + 16 * (grp + ATTN_PF - ngrp), t0 + nmax, (const char*)vc, sizeof(T), e0,
                          en);
        const int64_t np = (nr - j0) * G;
        for (int64_t g = g0; g < g1; g++) {
            AttnPairs pr{rows + j0, g * G, g * G, g * G + G};
            int64_t u = 0;
            if constexpr (attn_pf_per_head<E>)
                attn_prefetch(tab, a->block_size, row, t0 + 16 * (grp + ATTN_PF), t0 + nmax, (const char*)kc, sizeof(T),
                              g * E::head(D), E::head(D));
#if defined(KVLM_AVX512)
            if constexpr (NV != 0) {
                if (np >= ATTN_LANES_MIN) {
                    v16 kt[16 * (NV ? NV : 1)];
                    attn_k_transpose<E, NV>(kc + g * E::head(D), off, kt);
                    for (; u + ATTN_LP <= np; u += ATTN_LP) attn_k_lanes<NV, ATTN_LP>(a, kt, pr, grp);
                    for (; u < np; u++) attn_k_lanes<NV, 1>(a, kt, pr, grp);
                }
            }
#endif
#if defined(KVLM_AVX2)
            if constexpr (NV != 0 && (std::is_same_v<E, KvQ8> || std::is_same_v<E, KvQ4>)) {
                if (np >= 2) {
                    attn_decode_group<E, NV>(kc + g * E::head(D), off, buf, boff);
                    for (; u < np; u++) attn_k_pairs<KvF32, NV, 1>(a, buf, boff, pr, grp);
                }
            }
#endif
            for (; u + ATTN_KP <= np; u += ATTN_KP) attn_k_pairs<E, NV, ATTN_KP>(a, kc + g * E::head(D), off, pr, grp);
            for (; u < np; u++) attn_k_pairs<E, NV, 1>(a, kc + g * E::head(D), off, pr, grp);
        }
    }
    if (t0 == 0 && a->k0_delta)
        for (int64_t j = 0; j < nr; j++)
            if (rows[j].k0) attn_k0_correct(a, rows[j], h0, h1);
    // Softmax of the chunk, per row and head: p = exp(s - max) in place, den = sum p (lanes, then one
    // fixed-order sum). An empty row (n = 0) gets max -inf, den 0. Tokens before a sliding window first
    // become -inf (a row is only here with at least one token of its window in the chunk).
    for (int64_t j = 0; j < nr; j++) {
        const int64_t ng = (rows[j].n + 15) / 16;
        for (int64_t h = h0; h < h1 && rows[j].skip > 0; h++)
            for (int64_t i = 0; i < rows[j].skip; i++) rows[j].sc[h * CH + i] = -__builtin_inff();
        for (int64_t h = h0; h < h1; h++) {
            float* s = rows[j].sc + h * CH;
#if defined(KVLM_AVX2)
            {  // the same in 8-lane halves: lanes 0..7 and 8..15 of each group, max and sum trees unchanged
                v8 m0 = bc(v8{}, -__builtin_inff()), m1 = m0;
                for (int64_t grp = 0; grp < ng; grp++) {
                    const v8 x0 = ld8(s + 16 * grp), x1 = ld8(s + 16 * grp + 8);
                    m0 = m0 > x0 ? m0 : x0;
                    m1 = m1 > x1 ? m1 : x1;
                }
                float mh = m0[0];  // hmax: lanes 0 .. 15 in order
                for (int i = 1; i < 8; i++) mh = m0[i] > mh ? m0[i] : mh;
                for (int i = 0; i < 8; i++) mh = m1[i] > mh ? m1[i] : mh;
                v8 l0 = (v8){}, l1 = (v8){};
                for (int64_t grp = 0; grp < ng; grp++) {
                    const v8 p0 = exp_neg_v<v8, i8v>(ld8(s + 16 * grp) - mh);
                    const v8 p1 = exp_neg_v<v8, i8v>(ld8(s + 16 * grp + 8) - mh);
                    st8(s + 16 * grp, p0);
                    st8(s + 16 * grp + 8, p1);
                    l0 += p0;
                    l1 += p1;
                }
                // hsum: lanes i and i + 8, then i and i + 4, ...
                const v8 b = l0 + l1;
                const v4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
                const v2 d = __builtin_shufflevector(c, c, 0, 1) + __builtin_shufflevector(c, c, 2, 3);
                rows[j].mx[h] = mh;
                rows[j].den[h] = d[0] + d[1];
                continue;
            }
#endif
            v16 m = splat(-__builtin_inff());
            for (int64_t grp = 0; grp < ng; grp++) m = vmax(m, ld(s + 16 * grp));
            const float mh = hmax(m);
            v16 l = (v16){};
            for (int64_t grp = 0; grp < ng; grp++) {
                v16 p = exp_neg(ld(s + 16 * grp) - mh);
                st(s + 16 * grp, p);
                l += p;
            }
            rows[j].mx[h] = mh;
            rows[j].den[h] = hsum(l);
        }
        for (int64_t i = h0 * D; i < h1 * D; i++) rows[j].acc[i] = 0.0f;
    }
    // V pass: acc stays in registers over a group, for ATTN_VP (row, head) pairs sharing each V row.
    for (int64_t grp = 0, j0 = 0; grp < ngrp; grp++) {
        while (rows[j0].n <= 16 * grp) j0++;
        token_rows(tab, a->block_size, row, t0 + 16 * grp, t0 + nmax, off);
        if constexpr (!attn_pf_per_head<E>)
            attn_prefetch(tab, a->block_size, row, t0 + 16 * (grp + ATTN_PF), t0 + nmax, (const char*)vc, sizeof(T), e0, en);
        const int64_t np = (nr - j0) * G;
        for (int64_t g = g0; g < g1; g++) {
            AttnPairs pr{rows + j0, g * G, g * G, g * G + G};
            int64_t u = 0;
            if constexpr (attn_pf_per_head<E>)
                attn_prefetch(tab, a->block_size, row, t0 + 16 * (grp + ATTN_PF), t0 + nmax, (const char*)vc, sizeof(T),
                              g * E::head(D), E::head(D));
#if defined(KVLM_AVX2)
            if constexpr (NV != 0 && (std::is_same_v<E, KvQ8> || std::is_same_v<E, KvQ4>)) {
                if (np >= 2) {
                    attn_decode_group<E, NV>(vc + g * E::head(D), off, buf, boff);
                    for (; u < np; u++) attn_v_pairs<KvF32, NV, 1>(a, buf, boff, pr, grp);
                }
            }
#endif
            for (; u + ATTN_VP <= np; u += ATTN_VP) attn_v_pairs<E, NV, ATTN_VP>(a, vc + g * E::head(D), off, pr, grp);
            for (; u < np; u++) attn_v_pairs<E, NV, 1>(a, vc + g * E::head(D), off, pr, grp);
        }
    }
}

// out (H, D) of one row from the partial states of its nc chunks (p0: nc states of H * (D + 2) floats),
// in chunk order.
KVLM_INLINE void attn_combine(const float* p0, int64_t nc, float* out, int64_t H, int64_t D) {
    const int64_t stride = H * (D + 2);
    for (int64_t h = 0; h < H; h++) {
        float m = -__builtin_inff();
        for (int64_t c = 0; c < nc; c++) {
            const float mc = p0[c * stride + H * D + h];
            m = mc > m ? mc : m;
        }
        float l = 0.0f;
        float* o = out + h * D;
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
void paged_attn_t(const KvlmPagedAttn* a, float* scratch, int64_t i0, int64_t i1) {
    const int64_t H = a->H, D = a->D, CH = a->chunk, stride = H * (D + 2);
    AttnRow rows[KVLM_ATTN_TILE];
    const int64_t W = a->window;
    auto first = [&](int64_t L) -> int64_t { return W > 0 && L > W ? L - W : 0; };  // a row's first token
    // A row's live chunks: those holding tokens of its window (an empty row has one, empty).
    auto live = [&](int64_t L) -> int64_t { return L <= 0 ? 1 : (L - 1) / CH - first(L) / CH + 1; };
    for (int64_t it = i0; it < i1; it++) {
        const int64_t k = a->items[3 * it], c = a->items[3 * it + 1], t0 = c * CH, sh = a->items[3 * it + 2];
        const int64_t g0 = sh * a->kv_heads / a->kv_split, g1 = (sh + 1) * a->kv_heads / a->kv_split;  // kv heads
        const int64_t h0 = g0 * (H / a->kv_heads), h1 = g1 * (H / a->kv_heads);
        const int32_t* tr = a->order + a->tiles[2 * k];
        const int64_t R = a->tiles[2 * k + 1];
        // The tile's chunks: c0 (its shortest row's first live one) .. nc - 1; partial states by c - c0.
        const int64_t Lmax = a->ctx_lens[tr[R - 1]], nc = Lmax > CH ? (Lmax + CH - 1) / CH : 1;
        const int64_t c0 = first(a->ctx_lens[tr[0]]) / CH, ncl = nc - c0;
        const int64_t s0 = a->seq_ids ? a->seq_ids[tr[0]] : tr[0];
        // The tile's rows with tokens of their window in this chunk (chunk 0: all, empty ones too): rows
        // j0 .. j1 - 1, since L and the window's first token both ascend along the tile.
        int64_t j0 = 0, j1 = R;
        if (c > 0)
            while (a->ctx_lens[tr[j0]] <= t0) j0++;
        while (j1 > j0 && first(a->ctx_lens[tr[j1 - 1]]) >= t0 + CH) j1--;
        for (int64_t j = j0; j < j1; j++) {
            const int64_t t = tr[j], L = a->ctx_lens[t];
            AttnRow& r = rows[j - j0];
            r.q = a->q + t * H * D;
            r.sc = scratch + (j - j0) * H * CH;
            r.n = L - t0 < CH ? L - t0 : CH;
            r.skip = first(L) > t0 ? first(L) - t0 : 0;
            r.k0 = a->k0_delta && t0 == 0 && r.skip == 0 && r.n > 0 &&
                   (!a->k0_seqs || a->k0_seqs[a->seq_ids ? a->seq_ids[t] : t]);
            if (live(L) == 1) {  // one chunk: normalized straight into out below
                r.acc = a->out + t * H * D;
                r.mx = scratch + KVLM_ATTN_TILE * H * CH + (j - j0) * 2 * H;
            } else {
                r.acc = a->part + (a->part_first[k] + j * ncl + c - c0) * stride;
                r.mx = r.acc + H * D;
            }
            r.den = r.mx + H;
        }
        if (j1 > j0) attn_chunk<E, NV>(a, a->block_tables + s0 * a->max_blocks, t0, rows, j1 - j0, g0, g1);
        for (int64_t j = 0; j < j1 - j0; j++) {
            if (live(a->ctx_lens[tr[j0 + j]]) > 1) continue;
            float* o = rows[j].acc;
            for (int64_t h = h0; h < h1; h++) {
                const v16 inv = splat(rows[j].den[h] > 0.0f ? 1.0f / rows[j].den[h] : 0.0f);  // L = 0: zeros
                for (int64_t i = 0; i < D; i += 16) st(o + h * D + i, ld(o + h * D + i) * inv);
            }
        }
        if (ncl == 1) continue;
        // Release our partials; the tile's last chunk to finish acquires all of them and combines.
        if (__atomic_sub_fetch(&a->pending[k], 1, __ATOMIC_ACQ_REL) != 0) continue;
        for (int64_t j = 0; j < R; j++) {
            const int64_t t = tr[j], L = a->ctx_lens[t];
            if (live(L) > 1)
                attn_combine(a->part + (a->part_first[k] + j * ncl + first(L) / CH - c0) * stride, live(L),
                             a->out + t * H * D, H, D);
        }
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
        case KV_Q8: paged_attn_d<KvQ8>(a, scores, i0, i1); return 0;
        case KV_Q4: paged_attn_d<KvQ4>(a, scores, i0, i1); return 0;
        default: return -1;
    }
}

}  // namespace

#include "kernels_int8.h"  // every unit: x86 vector kernels, or the portable / NEON ones
#define KVLM_INT8 quantize_act, gemv_i8

extern "C" const KvlmKernels* KVLM_ISA_FN(void) {
    static const KvlmKernels table = {gemv, dequant, paged_attn, KVLM_INT8};
    return &table;
}
