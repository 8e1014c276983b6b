// AVX-512 int8-activation matmul for Q4_0, Q4_1 and Q8_0 weights: column-lane panels. Included by
// kernels_int8.h on the AVX-512 and AVX-512 VNNI units (numerics: reference.qmatmul_int8_ref).
//
// Layout. A panel is 16 output columns (weight rows n..n+15), one per int32 / float lane of a zmm. Weight
// block b of those rows becomes a PanelBlock: 8 vectors v[j] of [16 columns x 4 bytes], v[j] lane c holding
// row n + c's weights at elements 4j..4j+3 as unsigned bytes u (Q4: the nibble 0..15; Q8_0 with VNNI:
// w + 128; Q8_0 without VNNI: |w|, w's signs kept as byte masks), and the 16 rows' scales (and Q4_1 mins).
// A row of x's bytes 4j..4j+3 broadcast to all lanes, 8 vpdpbusd (or maddubs + madd) give the exact
// integer block sums of all 16 columns: ~11 instructions per 512 multiply-adds instead of 32 for a
// row-at-a-time kernel, which spends a convert, a scale and an FMA per 64.
//
// Order contract. Output (m, n) runs exactly this, whatever M, the row tile, the panel the column lands
// in (lanes are independent; tail columns are masked lanes) or the thread split, so a row's result is
// the same bits alone, in a batch or in a prefill chunk:
//     isum_b = sum_i w_i * q_i                  (int32, exact: |isum_b| < 2^20; Q4_0's u - 8 and Q8_0's
//                                                u - 128 offsets enter as -8 / -128 * sum_i q_i)
//     acc = 0;  for b = 0 .. nb - 1:  acc = fma(float(isum_b) * dw_b, xd_b, acc)
//     Q4_1:  mn = 0;  for b = 0 .. nb - 1:  mn = fma(m_b, xs_b, mn);  y = acc + mn.   Q4_0, Q8_0: y = acc.
// (dw_b, m_b: the weight row's block scale and min; xd_b, xs_b: x's block scale and d * sum(q).)
//
// Work order. Few rows (M <= FLY_ROWS, decode): each block is transposed into registers and used at once
// ("on the fly"). More rows: the panel's blocks are transposed once into a per-thread buffer (K / 32
// PanelBlocks, ~22 KB at K = 1536 for Q4) and every tile of ROW_TILE rows of x runs against it.

struct PanelBlock {
    __m512i v[8];      // unsigned weight bytes: v[j] lane c = row c's elements 4j..4j+3
    __m512 dw;         // the 16 rows' block scales
    __m512 mw;         // Q4_1: the 16 rows' block mins (unused otherwise)
    __mmask64 neg[8];  // Q8_0 without VNNI: where w < 0 (x is negated there); unused otherwise
};

template <int QT>
constexpr bool SIGNS = QT == T_Q8_0 && !KVLM_HAS_VNNI;  // Q8_0 via maddubs: |w| and sign masks

// The 16 rows' 16 bytes at offset `off`, 4 rows a vector: z[a] 128-bit lane l = row a + 4l. (Masked
// broadcasts from memory: a load and a blend each, no shuffle: cheaper than inserts.)
KVLM_INLINE void load_rows(const uint8_t* const* rows, int64_t off, __m512i z[4]) {
    for (int a = 0; a < 4; a++) {
        __m512i r = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(rows[a] + off)));
        r = _mm512_mask_broadcast_i32x4(r, 0x00f0, _mm_loadu_si128((const __m128i*)(rows[a + 4] + off)));
        r = _mm512_mask_broadcast_i32x4(r, 0x0f00, _mm_loadu_si128((const __m128i*)(rows[a + 8] + off)));
        z[a] = _mm512_mask_broadcast_i32x4(r, 0xf000, _mm_loadu_si128((const __m128i*)(rows[a + 12] + off)));
    }
}

// 4 x 4 transpose of dwords inside each 128-bit lane: from load_rows' z to t[j] lane c = row c's
// dword j (element 4l + a of t[j] is dword j of z[a]'s lane l, which is row a + 4l).
KVLM_INLINE void transpose4(const __m512i z[4], __m512i t[4]) {
    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    t[0] = _mm512_unpacklo_epi64(t0, t2), t[1] = _mm512_unpackhi_epi64(t0, t2);
    t[2] = _mm512_unpacklo_epi64(t1, t3), t[3] = _mm512_unpackhi_epi64(t1, t3);
}

// The same 4 x 4 pattern, summing instead of moving: s[a] lane l holds 4 partial sums of row a + 4l;
// the result's lane c holds row c's total (exact: integers).
KVLM_INLINE __m512i sum_rows4(const __m512i s[4]) {
    const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(s[0], s[1]), _mm512_unpackhi_epi32(s[0], s[1]));
    const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(s[2], s[3]), _mm512_unpackhi_epi32(s[2], s[3]));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
}

// Lane c: row c's dword K of the 16 bytes at rows[c] + off (the 4 bytes at off + 4 K): load_rows' 16
// loads and half a transpose4. Replaces vpgatherdd, which was the M = 1 loop's costliest instruction on
// Zen 5 (Q4_0 at M = 1 1.27x faster without it, hot, avx512-vnni unit; kernels_int8_avx2.h's dwords8 found
// the same on Zen 4).
// K = 3 reads a field at a block's end without leaving the block (Q6_K's d: off = block + 194).
template <int K>
KVLM_INLINE __m512i dwords16(const uint8_t* const* rows, int64_t off) {
    __m512i z[4];
    load_rows(rows, off, z);
    const __m512i a = K < 2 ? _mm512_unpacklo_epi32(z[0], z[1]) : _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i b = K < 2 ? _mm512_unpacklo_epi32(z[2], z[3]) : _mm512_unpackhi_epi32(z[2], z[3]);
    return K % 2 == 0 ? _mm512_unpacklo_epi64(a, b) : _mm512_unpackhi_epi64(a, b);
}

// The 16 rows' scales dw (and Q4_1's mins mw) of the block at offset `off`: the first 4 bytes of each
// row's block (d, then m as halves).
template <int QT>
KVLM_INLINE void block_scales(const uint8_t* const* rows, int64_t off, __m512* dw, __m512* mw) {
    const __m512i head = dwords16<0>(rows, off);
    *dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
    if constexpr (QT == T_Q4_1) *mw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
}

// Block b of the panel's 16 rows (rows[c]: row c's first byte).
template <int QT>
KVLM_INLINE void prep_block(const uint8_t* const* rows, int64_t b, PanelBlock* pb) {
    constexpr int BB = I8Fmt<QT>::BB, QOFF = I8Fmt<QT>::QOFF;
    const int64_t off = b * BB;
    block_scales<QT>(rows, off, &pb->dw, &pb->mw);
    __m512i z[4], t[4];
    load_rows(rows, off + QOFF, z);
    transpose4(z, t);
    if constexpr (QT == T_Q8_0) {
        __m512i h[4];
        load_rows(rows, off + QOFF + 16, z);
        transpose4(z, h);
        for (int j = 0; j < 4; j++) pb->v[j] = t[j], pb->v[4 + j] = h[j];
        for (int j = 0; j < 8; j++) {
            if constexpr (SIGNS<QT>) pb->neg[j] = _mm512_movepi8_mask(pb->v[j]), pb->v[j] = _mm512_abs_epi8(pb->v[j]);
            else pb->v[j] = _mm512_xor_si512(pb->v[j], _mm512_set1_epi8((char)0x80));  // w + 128
        }
    } else {  // byte i holds element i (low nibble) and i + 16 (high nibble)
        const __m512i lo4 = _mm512_set1_epi8(15);
        for (int j = 0; j < 4; j++)
            pb->v[j] = _mm512_and_si512(t[j], lo4), pb->v[4 + j] = _mm512_and_si512(_mm512_srli_epi16(t[j], 4), lo4);
    }
}

// int32 lanes += 4-byte dot products of u (unsigned) with s (signed).
KVLM_INLINE __m512i dot_acc(__m512i acc, __m512i u, __m512i s) {
#if KVLM_HAS_VNNI
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}

template <int QT>
constexpr int OFFSET = QT == T_Q4_0 ? -8 : (QT == T_Q8_0 && !SIGNS<QT> ? -128 : 0);  // u = w - OFFSET

// The float part of the contract for one block of one row of x: isum (16 columns' exact sums).
template <int QT>
KVLM_INLINE void finish_block(__m512i isum, __m512 dw, __m512 mw, const ActRows& a, int64_t ib, __m512* acc,
                              __m512* mn) {
    *acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(isum), dw), _mm512_set1_ps(a.xd[8 * ib]), *acc);
    if constexpr (QT == T_Q4_1) *mn = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.xs[ib]), *mn);
}

// One block of the contract for MT rows of x (from row m0) against a prepared PanelBlock.
template <int QT, int MT>
KVLM_INLINE void tile_block(const PanelBlock& pb, const ActRows& a, int64_t m0, int64_t b, __m512* acc, __m512* mn) {
    __m512i s[MT];
    for (int i = 0; i < MT; i++)
        s[i] = OFFSET<QT> ? _mm512_set1_epi32(OFFSET<QT> * a.xi[(m0 + i) * a.nb + b]) : _mm512_setzero_si512();
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < MT; i++) {
            int32_t q4;
            memcpy(&q4, a.xq + (m0 + i) * a.K + 32 * b + 4 * j, 4);
            __m512i x = _mm512_set1_epi32(q4);
            if constexpr (SIGNS<QT>) x = _mm512_mask_sub_epi8(x, pb.neg[j], _mm512_setzero_si512(), x);
            s[i] = dot_acc(s[i], pb.v[j], x);
        }
    for (int i = 0; i < MT; i++) finish_block<QT>(s[i], pb.dw, pb.mw, a, (m0 + i) * a.nb + b, acc + i, mn + i);
}

// The same block for MT <= FLY_ROWS rows without transposing the weights: z[a] (load_rows) holds rows
// a, a + 4, a + 8, a + 12 with their 16 bytes in place, so x's matching 16 bytes are broadcast to each
// 128-bit lane, and each row's 4 partial sums per z are added up afterwards (sum_rows4): a few more
// additions per row of x, far fewer shuffles than the transpose, which only pays for many rows.
template <int QT, int MT>
KVLM_INLINE void direct_block(const uint8_t* const* rows, const ActRows& a, int64_t b, __m512* acc,
                              __m512* mn) {
    constexpr int BB = I8Fmt<QT>::BB, QOFF = I8Fmt<QT>::QOFF;
    const int64_t off = b * BB;
    __m512 dw, mw = _mm512_setzero_ps();
    block_scales<QT>(rows, off, &dw, &mw);
    __m512i lo[4], hi[4];  // u of elements 0..15 and 16..31 (each z: 4 rows x 16 bytes)
    __mmask64 nlo[4] = {0, 0, 0, 0}, nhi[4] = {0, 0, 0, 0};  // Q8_0 without VNNI: w < 0
    load_rows(rows, off + QOFF, lo);
    if constexpr (QT == T_Q8_0) {
        load_rows(rows, off + QOFF + 16, hi);
        for (int j = 0; j < 4; j++) {
            if constexpr (SIGNS<QT>) {
                nlo[j] = _mm512_movepi8_mask(lo[j]), lo[j] = _mm512_abs_epi8(lo[j]);
                nhi[j] = _mm512_movepi8_mask(hi[j]), hi[j] = _mm512_abs_epi8(hi[j]);
            } else {
                lo[j] = _mm512_xor_si512(lo[j], _mm512_set1_epi8((char)0x80));
                hi[j] = _mm512_xor_si512(hi[j], _mm512_set1_epi8((char)0x80));
            }
        }
    } else {
        const __m512i lo4 = _mm512_set1_epi8(15);
        for (int j = 0; j < 4; j++)
            hi[j] = _mm512_and_si512(_mm512_srli_epi16(lo[j], 4), lo4), lo[j] = _mm512_and_si512(lo[j], lo4);
    }
    for (int i = 0; i < MT; i++) {
        const int8_t* xp = a.xq + i * a.K + 32 * b;
        const __m512i xl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)xp));
        const __m512i xh = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(xp + 16)));
        __m512i s[4];
        for (int j = 0; j < 4; j++) {
            __m512i l = xl, h = xh;
            if constexpr (SIGNS<QT>) {
                l = _mm512_mask_sub_epi8(xl, nlo[j], _mm512_setzero_si512(), xl);
                h = _mm512_mask_sub_epi8(xh, nhi[j], _mm512_setzero_si512(), xh);
            }
            s[j] = dot_acc(dot_acc(_mm512_setzero_si512(), lo[j], l), hi[j], h);
        }
        __m512i isum = sum_rows4(s);
        if constexpr (OFFSET<QT> != 0) isum = _mm512_add_epi32(isum, _mm512_set1_epi32(OFFSET<QT> * a.xi[i * a.nb + b]));
        finish_block<QT>(isum, dw, mw, a, i * a.nb + b, acc + i, mn + i);
    }
}

template <int QT, int MT>
KVLM_INLINE void store_tile(const __m512* acc, const __m512* mn, float* y, int64_t ldy, __mmask16 live) {
    for (int i = 0; i < MT; i++)
        _mm512_mask_storeu_ps(y + i * ldy, live, QT == T_Q4_1 ? _mm512_add_ps(acc[i], mn[i]) : acc[i]);
}

// Prefetch slice b of nb of the range [ahead, ahead + nb * step) (up to `end`) into L2, in order.
// Why: decode is memory-bound, and 16 rows read side by side a block at a time are not a pattern the
// hardware prefetcher follows well. Rows are contiguous in practice, so a panel is one range of 16 row
// strides; the one after next (`ahead`) is fetched a slice per block while this one is used (one panel
// ahead arrived too late for the 28 MB Q8_0 lm_head; L1 is too small to hold two more panels).
KVLM_INLINE void prefetch_slice(const uint8_t* ahead, const uint8_t* end, int64_t b, int64_t step) {
    const uint8_t* p = (const uint8_t*)((uintptr_t)(ahead + b * step) & ~(uintptr_t)63);
    for (; p < ahead + (b + 1) * step && p < end; p += 64) _mm_prefetch((const char*)p, _MM_HINT_T1);
}

// Few rows: direct_block, block after block.
template <int QT, int MT>
void panel_fly(const uint8_t* const* rows, const uint8_t* ahead, const uint8_t* end, const ActRows& a,
               float* y, int64_t ldy, __mmask16 live) {
    __m512 acc[MT], mn[MT];
    for (int i = 0; i < MT; i++) acc[i] = mn[i] = _mm512_setzero_ps();
    constexpr int64_t BB = I8Fmt<QT>::BB;
    for (int64_t b = 0; b < a.nb; b++) {
        prefetch_slice(ahead, end, b, 16 * BB);
        direct_block<QT, MT>(rows, a, b, acc, mn);
    }
    store_tile<QT, MT>(acc, mn, y, ldy, live);
}

// Rows m0 .. m0 + MT - 1 against the prepared panel (the first tile also prefetches, as panel_fly).
template <int QT, int MT>
void panel_tile(const PanelBlock* buf, const ActRows& a, int64_t m0, float* y, int64_t ldy, __mmask16 live,
                const uint8_t* ahead, const uint8_t* end) {
    __m512 acc[MT], mn[MT];
    for (int i = 0; i < MT; i++) acc[i] = mn[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a.nb; b++) {
        if (m0 == 0) prefetch_slice(ahead, end, b, 16 * I8Fmt<QT>::BB);
        tile_block<QT, MT>(buf[b], a, m0, b, acc, mn);
    }
    store_tile<QT, MT>(acc, mn, y + m0 * ldy, ldy, live);
}

constexpr int64_t FLY_ROWS = 4;  // up to this many rows of x: on the fly, else through the panel buffer
constexpr int64_t ROW_TILE = 4;  // rows per pass over the buffer (4 x 3 accumulators + 10 panel vectors)

// Few rows (decode): the first two panels of [n0, n1) into L2 (the panel loop prefetches two panels
// ahead from there on).
KVLM_INLINE void prefetch_first_panels(const uint8_t* w, int64_t rs, int64_t n0, int64_t n1) {
    const uint8_t* end = w + (n1 < n0 + 32 ? n1 : n0 + 32) * rs;
    for (const uint8_t* p = (const uint8_t*)((uintptr_t)(w + n0 * rs) & ~(uintptr_t)63); p < end; p += 64)
        _mm_prefetch((const char*)p, _MM_HINT_T1);
}

// The panel at weight row n: its 16 rows' first bytes; returns the live lanes (a tail panel's lanes past
// n1 repeat the last row).
KVLM_INLINE __mmask16 panel_rows(const uint8_t* w, int64_t rs, int64_t n, int64_t n1, const uint8_t** rows) {
    const int live = n1 - n < 16 ? (int)(n1 - n) : 16;
    for (int c = 0; c < 16; c++) rows[c] = w + (n + (c < live ? c : live - 1)) * rs;
    return (__mmask16)((1u << live) - 1);
}

// Rows [m, M) against the prepared panel: tiles of ROW_TILE rows, then the remainder.
template <int QT>
KVLM_INLINE void panel_tiles(const PanelBlock* buf, const ActRows& a, int64_t m, int64_t M, float* yp, int64_t ldy,
                             __mmask16 mask, const uint8_t* ahead, const uint8_t* end) {
    for (; m + ROW_TILE <= M; m += ROW_TILE) panel_tile<QT, ROW_TILE>(buf, a, m, yp, ldy, mask, ahead, end);
    switch (M - m) {
        case 1: panel_tile<QT, 1>(buf, a, m, yp, ldy, mask, ahead, end); break;
        case 2: panel_tile<QT, 2>(buf, a, m, yp, ldy, mask, ahead, end); break;
        case 3: panel_tile<QT, 3>(buf, a, m, yp, ldy, mask, ahead, end); break;
        default: break;
    }
}

#if defined(KVLM_AMX)
#include "kernels_int8_amx.h"  // many rows: AMX tiles on the same panel buffer and contract
#endif

// The rows [0, mt) of an M-row call that go through AMX tiles: none but on the avx512-amx unit.
KVLM_INLINE int64_t amx_rows(int64_t M) {
#if defined(KVLM_AMX)
    return M > FLY_ROWS && M >= AMX_MIN_ROWS ? M / 16 * 16 : 0;
#else
    (void)M;
    return 0;
#endif
}

template <int QT>
void gemm_i8_t(const uint8_t* w, int64_t rs, int64_t K, const int8_t* xq, const float* xd, const float* xs,
               const int32_t* xi, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
    const ActRows a{xq, xd, xs, xi, K, K / 32};
    const int64_t mt = amx_rows(M);  // rows [0, mt) on AMX tiles (then two panel buffers)
    PanelBlock* buf = M > FLY_ROWS ? thread_buffer<PanelBlock>(mt > 0 ? 2 * a.nb : a.nb) : nullptr;
    prefetch_first_panels(w, rs, n0, n1);  // then two panels ahead (panel_fly, or panel_tile's first tile)
#if defined(KVLM_AMX)
    if (mt > 0 && buf != nullptr) {
        amx_configure<false>();
        const bool done = amx_gemm<QT>(buf, a, mt, y, ldy, n0, n1, [&](int64_t n, PanelBlock* pb) {
            const uint8_t* rows[16];
            const __mmask16 mask = panel_rows(w, rs, n, n1, rows);
            const uint8_t *ahead = w + (n + 32) * rs, *end = w + n1 * rs;  // the next pair's panels
            for (int64_t b = 0; b < a.nb; b++) {
                prefetch_slice(ahead, end, b, 16 * I8Fmt<QT>::BB);
                prep_block<QT>(rows, b, pb + b);
            }
            panel_tiles<QT>(pb, a, mt, M, y + n, ldy, mask, ahead, end);  // rows [mt, M), as the buffer is now
            return mask;
        });
        _tile_release();
        if (done) return;
    }
#endif
    for (int64_t n = n0; n < n1; n += 16) {
        const uint8_t* rows[16];
        const __mmask16 mask = panel_rows(w, rs, n, n1, rows);
        float* yp = y + n;
        const uint8_t *ahead = w + (n + 32) * rs, *end = w + n1 * rs;  // the panel after next
        if (M <= FLY_ROWS || buf == nullptr) {
            for (int64_t m = 0; m < M; m += FLY_ROWS) {  // (M > FLY_ROWS only if the buffer failed to allocate)
                const ActRows am{xq + m * K, xd + 8 * m * a.nb, xs + m * a.nb, xi + m * a.nb, K, a.nb};
                switch (M - m < FLY_ROWS ? M - m : FLY_ROWS) {
                    case 1: panel_fly<QT, 1>(rows, ahead, end, am, yp + m * ldy, ldy, mask); break;
                    case 2: panel_fly<QT, 2>(rows, ahead, end, am, yp + m * ldy, ldy, mask); break;
                    case 3: panel_fly<QT, 3>(rows, ahead, end, am, yp + m * ldy, ldy, mask); break;
                    default: panel_fly<QT, 4>(rows, ahead, end, am, yp + m * ldy, ldy, mask); break;
                }
            }
            continue;
        }
        for (int64_t b = 0; b < a.nb; b++) prep_block<QT>(rows, b, buf + b);
        panel_tiles<QT>(buf, a, 0, M, yp, ldy, mask, ahead, end);
    }
}

