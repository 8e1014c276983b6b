// BF16 weights: the row kernels' bodies, on one contract whether the CPU has AVX-512 BF16's vdpbf16ps or
// not. Included by kernels_impl.h twice on the AVX-512 units: inside namespace bf16_emu as every unit does
// (the arithmetic spelled out in float32), and inside namespace bf16_hw under `#pragma GCC target(...,
// avx512bf16)` with KVLM_BF16_HW defined (the same arithmetic, one instruction per 32 products), which
// the AVX-512 VNNI unit runs only where the CPU reports avx512_bf16 (`bf16_gemv` in kernels_impl.h).
//
// Contract of output (m, n) (reference.qmatmul_bf16_contract computes it in torch, bit for bit):
//   xb = x[m] rounded to bf16 (nearest even), zero-padded to a multiple of 32; W[n] zero-padded alike;
//   with the thread's MXCSR set to flush denormal inputs and results to zero (FTZ, DAZ):
//   acc (16 lanes) = 0; for chunk c = 0, 1, ... (32 elements):  for lane l:
//       acc[l] += xb[32c + 2l + 1] * W[32c + 2l + 1];   acc[l] += xb[32c + 2l] * W[32c + 2l]
//   y = hsum(acc) (kernels_impl.h's fixed tree).
// Each += adds the exact product and rounds once (an FMA; a product of two bf16 values is exact in float32
// unless it overflows). This is vdpbf16ps's definition (Intel SDM: the odd pair first, then the even one,
// RNE, DAZ and FTZ), measured on Zen 5 to agree with fmaf in that order on 6.4 million random lanes, and
// tests/kernels/test_dense.py checks it against the instruction where the CPU has it. So a row has the same
// bits whatever M, the tile, the thread split and whether the instruction ran. (The x86 baseline unit has
// no FMA: there, and only where a product overflows float32, it rounds the product to infinity first.)

// x as this form reads it, XT per element, 32 a chunk (`to_x` writes it, once per call and row): bf16, as
// the instruction reads it, and as the spelled-out AVX-512 form splits it into odd and even elements at
// each use; on the other units (16 or fewer vector registers) split once: each chunk's 16 odd elements
// widened to float32 (a bf16 is the top half of its float32), then its 16 even ones. (AVX-512 spelled out
// with split x: prefill at M = 512 0.61x to 0.86x; AVX2 with bf16 x: 0.27x to 0.38x; Zen 5, 2 threads,
// 2026-12-05, a one-off A/B not kept in the repo.)
#if defined(KVLM_BF16_HW) || defined(KVLM_AVX512)
#define KVLM_BF16_XB 1
typedef uint16_t XT;
#else
typedef float XT;
#endif
#if defined(KVLM_BF16_HW)
struct XChunk {
    __m512bh v;
};
KVLM_INLINE XChunk xchunk(const XT* x) { return {(__m512bh)_mm512_loadu_si512((const void*)x)}; }
// acc += the chunk's 32 products with the weights at w, in the contract's order.
KVLM_INLINE void bdot(v16& acc, const uint16_t* w, const XChunk& x) {
    acc = (v16)_mm512_dpbf16_ps((__m512)acc, (__m512bh)_mm512_loadu_si512((const void*)w), x.v);
}
#else
struct XChunk {
    v16 odd, even;
};
KVLM_INLINE void split(const uint16_t* p, v16& odd, v16& even) {
    u16v u;
    memcpy(&u, p, 64);
    even = (v16)(u << 16);
    odd = (v16)(u & 0xffff0000u);
}
#if defined(KVLM_BF16_XB)
KVLM_INLINE XChunk xchunk(const XT* x) {
    XChunk c;
    split(x, c.odd, c.even);
    return c;
}
#else
KVLM_INLINE XChunk xchunk(const XT* x) { return {ld(x), ld(x + 16)}; }
#endif
KVLM_INLINE void bdot(v16& acc, const uint16_t* w, const XChunk& x) {
    v16 wo, we;
    split(w, wo, we);
    acc += wo * x.odd;
    acc += we * x.even;
}
#endif

// x (M, K) float32 -> xb (M, ldx) XT: rounded to bf16 (nearest even; a NaN stays a NaN), zero-padded to ldx
// (a multiple of 32).
KVLM_INLINE u16v bf16_bits(u16v u) {  // float32 bits -> bf16 bits, per lane
    const u16v nan = (u16v)((u & 0x7fffffffu) > 0x7f800000u);
    return (nan & ((u >> 16) | 0x40u)) | (~nan & ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16));
}
inline void to_x(const float* x, int64_t M, int64_t K, XT* xb, int64_t ldx) {
    for (int64_t m = 0; m < M; m++) {
        const float* xr = x + m * K;
        XT* o = xb + m * ldx;
        for (int64_t c = 0; c < ldx / 32; c++) {
            float in[32];
            const float* p = xr + 32 * c;
            if (32 * c + 32 > K) {  // the last, partial chunk: zero-padded
                memset(in, 0, sizeof in);
                memcpy(in, p, 4 * (K - 32 * c));
                p = in;
            }
            u16v a, b;
            memcpy(&a, p, 64);
            memcpy(&b, p + 16, 64);
            a = bf16_bits(a), b = bf16_bits(b);
#if defined(KVLM_BF16_XB)
            const h16 ha = __builtin_convertvector(a, h16), hb = __builtin_convertvector(b, h16);
            memcpy(o + 32 * c, &ha, 32);
            memcpy(o + 32 * c + 16, &hb, 32);
#else
            const u16v od =
                __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31) << 16;
            const u16v ev =
                __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) << 16;
            memcpy(o + 32 * c, &od, 64);
            memcpy(o + 32 * c + 16, &ev, 64);
#endif
        }
    }
}

// The partial last chunk of a weight row (K % 32 elements from p), zero-padded into tmp. Kept out of the
// main loops, whose accumulators then stay in registers.
KVLM_INLINE const uint16_t* wtail(const uint8_t* row, int64_t K, uint16_t* tmp) {
    memset(tmp, 0, 64);
    memcpy(tmp, (const uint16_t*)row + K / 32 * 32, 2 * (K % 32));
    return tmp;
}

// Decode prefetches the next rows (kernels_impl.h's prefetch_next_rows): Zen 5, 2 threads, the machine at
// ~57 GB/s, `kvlm bench kernels --formats BF16 --rows 1`, GB/s before -> after: avx2 34-42 -> 54-58 (with
// b_rows8), avx512-vnni (vdpbf16ps) 52-56 -> 56-58, avx512 (spelled out) 45-49 -> 56-58.

// One row of x (xb: its chunks as to_x wrote them) against NR weight rows at once: NR independent chains,
// the x chunk read once for all (a decode step).
template <int NR>
KVLM_INLINE void b_rows(const uint8_t* w, int64_t rs, int64_t K, const XT* xb, float* y) {
    v16 acc[NR];
    for (int j = 0; j < NR; j++) acc[j] = (v16){};
    const int64_t nf = K / 32;
    const char* next = (const char*)w + NR * rs;
    for (int64_t c = 0; c < nf; c++) {
        const XChunk xc = xchunk(xb + 32 * c);
        prefetch_next_rows(next, NR, 64 * c, 64);
        for (int j = 0; j < NR; j++) {
            bdot(acc[j], (const uint16_t*)(w + j * rs) + 32 * c, xc);
        }
    }
    if (K % 32) {
        alignas(64) uint16_t tmp[32];
        const XChunk xc = xchunk(xb + 32 * nf);
        for (int j = 0; j < NR; j++) bdot(acc[j], wtail(w + j * rs, K, tmp), xc);
    }
    for (int j = 0; j < NR; j++) y[j] = hsum(acc[j]);
}

#if defined(KVLM_AVX2)
// b_rows on AVX2: each 16-lane accumulator as two ymm (lanes 0..7 and 8..15; lanes are independent, so
// each keeps the contract's order), with explicit intrinsics: 2 NR accumulators, x's two halves and the
// weight temporaries fit the 16 ymm. GCC's 16-lane vector code spilled the accumulators and moved them
// through general registers every chunk (19 GB/s a core on a cold 2048 x 8192 product, Zen 5).
template <int NR>
KVLM_INLINE void b_rows8(const uint8_t* w, int64_t rs, int64_t K, const XT* xb, float* y) {
    __m256 acc[2][NR];
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < NR; j++) acc[h][j] = _mm256_setzero_ps();
    const __m256i hi16 = _mm256_set1_epi32((int)0xffff0000u);
    // chunk c of the NR weight rows (wc[j]: its 32 elements) against x's chunk at xc (16 odd, 16 even)
    const auto chunk = [&](const uint16_t* const* wc, const XT* xc) __attribute__((always_inline)) {
        for (int h = 0; h < 2; h++) {
            const __m256 xo = _mm256_loadu_ps(xc + 8 * h), xe = _mm256_loadu_ps(xc + 16 + 8 * h);
            for (int j = 0; j < NR; j++) {
                const __m256i u = _mm256_loadu_si256((const __m256i*)(wc[j] + 16 * h));
                acc[h][j] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(u, hi16)), xo, acc[h][j]);
                acc[h][j] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(u, 16)), xe, acc[h][j]);
            }
        }
    };
    const int64_t nf = K / 32;
    const char* next = (const char*)w + NR * rs;
    for (int64_t c = 0; c < nf; c++) {
        const uint16_t* wc[NR];
        prefetch_next_rows(next, NR, 64 * c, 64);
        for (int j = 0; j < NR; j++) wc[j] = (const uint16_t*)(w + j * rs) + 32 * c;
        chunk(wc, xb + 32 * c);
    }
    if (K % 32) {
        alignas(64) uint16_t tmp[NR][32];
        const uint16_t* wc[NR];
        for (int j = 0; j < NR; j++) wc[j] = wtail(w + j * rs, K, tmp[j]);
        chunk(wc, xb + 32 * nf);
    }
    for (int j = 0; j < NR; j++) y[j] = hsum(join16<v16>(acc[0][j], acc[1][j]));
}
#endif

// MT rows of x (ldx elements apart in xb) against one weight row.
template <int MT>
KVLM_INLINE void b_row(const uint8_t* row, int64_t K, const XT* xb, int64_t ldx, float* y, int64_t ldy) {
    v16 acc[MT];
    for (int i = 0; i < MT; i++) acc[i] = (v16){};
    const int64_t nf = K / 32;
    for (int64_t c = 0; c < nf; c++)
        for (int i = 0; i < MT; i++) bdot(acc[i], (const uint16_t*)row + 32 * c, xchunk(xb + i * ldx + 32 * c));
    if (K % 32) {
        alignas(64) uint16_t tmp[32];
        const uint16_t* wc = wtail(row, K, tmp);
        for (int i = 0; i < MT; i++) bdot(acc[i], wc, xchunk(xb + i * ldx + 32 * nf));
    }
    for (int i = 0; i < MT; i++) y[i * ldy] = hsum(acc[i]);
}

#if defined(KVLM_AVX512)
// Prefill on AVX-512: MR rows of x by NR weight rows, per chunk NR weight loads and MR x chunks for MR * NR
// dots. Register budget (32 zmm): the instruction 6 x 4 (24 accumulators, 6 x operands); spelled out 4 x 4
// (16 accumulators, 8 x halves, 2 weight halves).
#if defined(KVLM_BF16_HW)
constexpr int B_MR = 6, B_NR = 4;
#else
constexpr int B_MR = 4, B_NR = 4;
#endif
constexpr int64_t B_PANEL = 16;  // weight rows per panel: (K = 2048) 64 KB, kept in L2 while every x tile passes

template <int MR>
KVLM_INLINE void b_tile(const uint8_t* w, int64_t rs, int64_t K, const XT* xb, int64_t ldx, float* y,
                        int64_t ldy) {
    v16 acc[MR][B_NR];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < B_NR; j++) acc[i][j] = (v16){};
    const int64_t nf = K / 32;
    for (int64_t c = 0; c < nf; c++)
        for (int i = 0; i < MR; i++) {
            const XChunk xc = xchunk(xb + i * ldx + 32 * c);
            for (int j = 0; j < B_NR; j++) bdot(acc[i][j], (const uint16_t*)(w + j * rs) + 32 * c, xc);
        }
    if (K % 32) {
        alignas(64) uint16_t tmp[B_NR][32];
        for (int j = 0; j < B_NR; j++) wtail(w + j * rs, K, tmp[j]);
        for (int i = 0; i < MR; i++) {
            const XChunk xc = xchunk(xb + i * ldx + 32 * nf);
            for (int j = 0; j < B_NR; j++) bdot(acc[i][j], tmp[j], xc);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < B_NR; j++) y[i * ldy + j] = hsum(acc[i][j]);
}
#endif

#if defined(KVLM_AVX2)
// Prefill on AVX2 (spelled out): MR rows of x by NR weight rows, one 8-lane half of the 16 lanes at a time
// over all of K (lanes are independent, so each keeps the contract's order), MR NR accumulators of one ymm.
// Per chunk: x's MR odd and even halves loaded once into registers, then each weight row's 8 words once:
// their odd elements against every row of x, then their even ones (each accumulator takes the odd product
// before the even one). Each accumulator's two FMAs a chunk are a chain of 2 x 4 cycles, so 8 accumulators
// only just keep 2 FMA pipes busy; 2 x 5 (10 accumulators, 4 x halves, the words and their split: 16 ymm,
// the mask a memory operand) leaves slack. The second half's pass finds most of the tile in L1. M = 512,
// 2048 x 2048, 1 thread, Zen 5: 2 x 3 with x as FMA memory operands (each x half read 3 times) ~63 ms,
// both halves at once 2 x 4 (16 accumulators, spilled) ~50, one half at a time 2 x 4 ~56 (noisy), 2 x 5 ~43.
constexpr int B2_MR = 2, B2_NR = 5;
template <int MR, int NR>
KVLM_INLINE void b_tile8(const uint8_t* w, int64_t rs, int64_t K, const XT* xb, int64_t ldx, float* y, int64_t ldy) {
    __m256 acc[2][MR][NR];
    const __m256i hi16 = _mm256_set1_epi32((int)0xffff0000u);
    for (int h = 0; h < 2; h++) {
        __m256 a[MR][NR];
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < NR; j++) a[i][j] = _mm256_setzero_ps();
        // chunk c's half h of the NR weight rows (wc[j]: the chunk) against the tile's rows of x
        const auto chunk = [&](const uint16_t* const* wc, int64_t c) __attribute__((always_inline)) {
            __m256 xo[MR], xe[MR];
            for (int i = 0; i < MR; i++) {
                const XT* xp = xb + i * ldx + 32 * c + 8 * h;
                xo[i] = _mm256_loadu_ps(xp), xe[i] = _mm256_loadu_ps(xp + 16);
            }
            for (int j = 0; j < NR; j++) {
                const __m256i u = _mm256_loadu_si256((const __m256i*)(wc[j] + 16 * h));
                const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(u, hi16));
                for (int i = 0; i < MR; i++) a[i][j] = _mm256_fmadd_ps(wo, xo[i], a[i][j]);
                const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
                for (int i = 0; i < MR; i++) a[i][j] = _mm256_fmadd_ps(we, xe[i], a[i][j]);
            }
        };
        const int64_t nf = K / 32;
        for (int64_t c = 0; c < nf; c++) {
            const uint16_t* wc[NR];
            for (int j = 0; j < NR; j++) wc[j] = (const uint16_t*)(w + j * rs) + 32 * c;
            chunk(wc, c);
        }
        if (K % 32) {
            alignas(64) uint16_t tmp[NR][32];
            const uint16_t* wc[NR];
            for (int j = 0; j < NR; j++) wc[j] = wtail(w + j * rs, K, tmp[j]);
            chunk(wc, nf);
        }
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < NR; j++) acc[h][i][j] = a[i][j];
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) y[i * ldy + j] = hsum(join16<v16>(acc[0][i][j], acc[1][i][j]));
}
#endif

// Register blocks of MR rows of x by NR weight rows, over panels of P weight rows (every tile of x passes over
// a panel while it stays in L2): tile(MR or 1 as a constant, first row of x, first weight row). Returns the
// first of the columns left over (fewer than NR), for the row kernels.
template <int MR, int NR, int64_t P, class Tile>
KVLM_INLINE int64_t b_blocks(int64_t M, int64_t n0, int64_t n1, Tile&& tile) {
    const int64_t nt = n0 + (n1 - n0) / NR * NR;
    for (int64_t n = n0; n < nt; n += P) {
        const int64_t ne = n + P < nt ? n + P : nt;
        int64_t m = 0;
        for (; m + MR <= M; m += MR)
            for (int64_t j = n; j < ne; j += NR) tile(std::integral_constant<int, MR>{}, m, j);
        for (; m < M; m++)
            for (int64_t j = n; j < ne; j += NR) tile(std::integral_constant<int, 1>{}, m, j);
    }
    return nt;
}

// y[m, n] for m < M, n in [n0, n1): xb (M, ldx) is x as `to_x` writes it.
inline void b_gemm(const uint8_t* w, int64_t rs, int64_t K, const XT* xb, int64_t ldx, int64_t M, float* y,
                   int64_t ldy, int64_t n0, int64_t n1) {
    if (M == 1) {  // a decode step: four weight rows in flight
#if defined(KVLM_AVX2)
        for (; n0 + 4 <= n1; n0 += 4) b_rows8<4>(w + n0 * rs, rs, K, xb, y + n0);
#else
        for (; n0 + 4 <= n1; n0 += 4) b_rows<4>(w + n0 * rs, rs, K, xb, y + n0);
#endif
        for (; n0 < n1; n0++) b_rows<1>(w + n0 * rs, rs, K, xb, y + n0);
        return;
    }
#if defined(KVLM_AVX512)
    if (M >= B_MR)
        n0 = b_blocks<B_MR, B_NR, B_PANEL>(M, n0, n1, [&](auto mr, int64_t m, int64_t j) {
            b_tile<decltype(mr)::value>(w + j * rs, rs, K, xb + m * ldx, ldx, y + m * ldy + j, ldy);
        });
#endif
#if defined(KVLM_AVX2)
    if (M >= B2_MR)
        n0 = b_blocks<B2_MR, B2_NR, 4 * B2_NR>(M, n0, n1, [&](auto mr, int64_t m, int64_t j) {
            b_tile8<decltype(mr)::value, B2_NR>(w + j * rs, rs, K, xb + m * ldx, ldx, y + m * ldy + j, ldy);
        });
#endif
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t* row = w + n * rs;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) b_row<4>(row, K, xb + m * ldx, ldx, y + m * ldy + n, ldy);
        if (m + 2 <= M) b_row<2>(row, K, xb + m * ldx, ldx, y + m * ldy + n, ldy), m += 2;
        if (m < M) b_row<1>(row, K, xb + m * ldx, ldx, y + m * ldy + n, ldy);
    }
}

#undef KVLM_BF16_XB
