// BF16 weights: the row kernels' bodies, on one contract whether the CPU has AVX-512 BF16's vdpbf16ps or
// not. Included by kernels_impl.h twice on the AVX-512 units: inside namespace bf16_emu as every unit does
// (the arithmetic spelled out in float32), and inside namespace bf16_hw under `#pragma GCC target(...,
// avx512bf16)` with KVLM_BF16_HW defined (the same arithmetic, one instruction per 32 products), which
// ops.cpp's unit runs only where the CPU reports avx512_bf16 (`bf16_gemv` below kernels_impl.h's include).
//
// Contract of output (m, n) (reference.qmatmul_bf16_ref computes it in torch, bit for bit):
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

// One 32-element chunk of x (bf16), ready to meet weight chunks: the instruction's operand, or its odd and
// even elements widened to float32 (a bf16 is the top half of its float32).
#if defined(KVLM_BF16_HW)
struct XChunk {
    __m512bh v;
};
KVLM_INLINE XChunk xchunk(const uint16_t* x) { return {(__m512bh)_mm512_loadu_si512((const void*)x)}; }
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
KVLM_INLINE XChunk xchunk(const uint16_t* x) {
    XChunk c;
    split(x, c.odd, c.even);
    return c;
}
KVLM_INLINE void bdot(v16& acc, const uint16_t* w, const XChunk& x) {
    v16 wo, we;
    split(w, wo, we);
    acc += wo * x.odd;
    acc += we * x.even;
}
#endif

// The partial last chunk of a weight row (K % 32 elements from p), zero-padded into tmp. Kept out of the
// main loops, whose accumulators then stay in registers.
KVLM_INLINE const uint16_t* wtail(const uint8_t* row, int64_t K, uint16_t* tmp) {
    memset(tmp, 0, 64);
    memcpy(tmp, (const uint16_t*)row + K / 32 * 32, 2 * (K % 32));
    return tmp;
}

// One row of x (xb: its bf16 chunks) against NR weight rows at once: NR independent chains, the x chunk
// read once for all (a decode step).
template <int NR>
KVLM_INLINE void b_rows(const uint8_t* w, int64_t rs, int64_t K, const uint16_t* xb, float* y) {
    v16 acc[NR];
    for (int j = 0; j < NR; j++) acc[j] = (v16){};
    const int64_t nf = K / 32;
    for (int64_t c = 0; c < nf; c++) {
        const XChunk xc = xchunk(xb + 32 * c);
        for (int j = 0; j < NR; j++) bdot(acc[j], (const uint16_t*)(w + j * rs) + 32 * c, xc);
    }
    if (K % 32) {
        alignas(64) uint16_t tmp[32];
        const XChunk xc = xchunk(xb + 32 * nf);
        for (int j = 0; j < NR; j++) bdot(acc[j], wtail(w + j * rs, K, tmp), xc);
    }
    for (int j = 0; j < NR; j++) y[j] = hsum(acc[j]);
}

// MT rows of x (ldx elements apart in xb) against one weight row.
template <int MT>
KVLM_INLINE void b_row(const uint8_t* row, int64_t K, const uint16_t* xb, int64_t ldx, float* y, int64_t ldy) {
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
KVLM_INLINE void b_tile(const uint8_t* w, int64_t rs, int64_t K, const uint16_t* xb, int64_t ldx, float* y,
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

// y[m, n] for m < M, n in [n0, n1): xb (M, ldx) is x in bf16, zero-padded.
inline void b_gemm(const uint8_t* w, int64_t rs, int64_t K, const uint16_t* xb, int64_t ldx, int64_t M, float* y,
                   int64_t ldy, int64_t n0, int64_t n1) {
    if (M == 1) {  // a decode step: four weight rows in flight
        for (; n0 + 4 <= n1; n0 += 4) b_rows<4>(w + n0 * rs, rs, K, xb, y + n0);
        for (; n0 < n1; n0++) b_rows<1>(w + n0 * rs, rs, K, xb, y + n0);
        return;
    }
#if defined(KVLM_AVX512)
    if (M >= B_MR) {
        const int64_t nt = n0 + (n1 - n0) / B_NR * B_NR;
        for (int64_t n = n0; n < nt; n += B_PANEL) {
            const int64_t ne = n + B_PANEL < nt ? n + B_PANEL : nt;
            int64_t m = 0;
            for (; m + B_MR <= M; m += B_MR)
                for (int64_t j = n; j < ne; j += B_NR) b_tile<B_MR>(w + j * rs, rs, K, xb + m * ldx, ldx, y + m * ldy + j, ldy);
            for (; m < M; m++)
                for (int64_t j = n; j < ne; j += B_NR) b_tile<1>(w + j * rs, rs, K, xb + m * ldx, ldx, y + m * ldy + j, ldy);
        }
        n0 = nt;  // the last columns (fewer than B_NR) by rows below
    }
#endif
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t* row = w + n * rs;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) b_row<4>(row, K, xb + m * ldx, ldx, y + m * ldy + n, ldy);
        if (m + 2 <= M) b_row<2>(row, K, xb + m * ldx, ldx, y + m * ldy + n, ldy), m += 2;
        if (m < M) b_row<1>(row, K, xb + m * ldx, ldx, y + m * ldy + n, ldy);
    }
}
