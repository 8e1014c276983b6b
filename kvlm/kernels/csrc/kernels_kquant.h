// Int8 activations for Q5_0, Q5_1, Q4_K, Q5_K and Q6_K weights (reference: reference.qmatmul_int8_ref,
// the same as Q4_0 / Q4_1 / Q8_0). Included by kernels_int8.h after the Q4 / Q8 kernels (AVX2 and
// AVX-512 units): x is quantized by the same quantize_act, per 32-element block (q8_0's scheme, not
// llama.cpp's per-256 q8_K for the K-quants: one quantizer and one reference for every format, and a
// K-quant's 32-element sub-blocks have their own scale anyway, so the float epilogue per 32 elements
// costs the same as Q4_1's; docs/kernels.md has the measurement).
//
// A "unit" is the 32 weights of one row that meet activation block ib (32 ib .. 32 ib + 31), as
// unsigned bytes u plus the unit's factors. Per format (dw: weight scale, mw: min coefficient):
//     Q5_0  u = 5-bit q             isum = sum u q - 16 sum q          dw = d
//     Q5_1  u = 5-bit q             isum = sum u q                     dw = d,          mw = m
//     Q4_K  u = 4-bit q             isum = sum u q                     dw = d sc_s,     mw = -(dmin m_s)
//     Q5_K  u = 5-bit q             isum = sum u q                     dw = d sc_s,     mw = -(dmin m_s)
//     Q6_K  u = 6-bit q             isum = sl (sum_lo u q - 32 sum_lo q) + sh (sum_hi u q - 32 sum_hi q)
//                                   (sl, sh: the int8 scales of elements 0..15 and 16..31)   dw = d
// (all integer sums exact in int32). Order contract of output (m, n), whatever M, the tile, the panel
// lane or the thread split:
//     acc = 0;  for ib = 0 .. K/32 - 1:  acc = fma(float(isum_ib) * dw_ib, xd_ib, acc)
//     formats with mw: mn = 0;  for ib:  mn = fma(mw_ib, xs_ib, mn);  y = acc + mn.   Others: y = acc.
// on AVX-512 (16 columns per vector, kernels_int8_panel.h's layout and helpers) and on AVX2 alike (8 columns
// per ymm, kernels_int8_avx2.h; Q4_K packed in 16-row panels, kernels_kquant_panels_avx2.h), so both give the
// same bits.

namespace {

template <int QT> struct KQ;  // BE elements and BB bytes per block, SUB units per block, MIN: has mw
template <> struct KQ<T_Q5_0> { static constexpr int BE = 32, BB = 22, SUB = 1; static constexpr bool MIN = false; };
template <> struct KQ<T_Q5_1> { static constexpr int BE = 32, BB = 24, SUB = 1; static constexpr bool MIN = true; };
template <> struct KQ<T_Q4_K> { static constexpr int BE = 256, BB = 144, SUB = 8; static constexpr bool MIN = true; };
template <> struct KQ<T_Q5_K> { static constexpr int BE = 256, BB = 176, SUB = 8; static constexpr bool MIN = true; };
template <> struct KQ<T_Q6_K> { static constexpr int BE = 256, BB = 210, SUB = 8; static constexpr bool MIN = false; };

// The row-stream decode kernels (AVX-512 kq_stream, AVX2 q6_stream8) read a panel's weight rows whole, in a few
// streams side by side; each stream prefetches its own bytes STREAM_AHEAD on, one block's lines per block read.
constexpr int64_t STREAM_AHEAD = 2304;  // bytes (1152 to 4608 measured alike on the Xeon's Q6_K walk; 9216 0.9x)

// Prefetch into L2 the lines of the BB bytes STREAM_AHEAD past cur (past the row: the stream's next row, or the
// next panel), unless they start past end.
template <int64_t BB>
KVLM_INLINE void prefetch_stream(const uint8_t* cur, const uint8_t* end) {
    const uint8_t* pf = (const uint8_t*)((uintptr_t)(cur + STREAM_AHEAD) & ~(uintptr_t)63);
    if (pf < end)
        for (int l = 0; l < (BB + 63) / 64 + 1; l++) _mm_prefetch((const char*)(pf + 64 * l), _MM_HINT_T1);
}

// Q4_K in 16-row panels (kernels_kquant_panels.h has the layout; AVX-512 gemm_k4p, AVX2 gemm_k4p8).
constexpr int64_t K4P_BB = 16 * 144;       // a super-block of the 16 rows
// Decode prefetches each line twice, K4P_AHEAD and 2 K4P_AHEAD ahead, a quarter block per unit pair. In
// development runs (the 3B Q4_K_M's Q4_K walk at M = 1, 2 threads, the Xeon; variants behind a temporary
// switch, alternating in one process): 22.0 GB/s, against 19.0 spread once 2 blocks ahead, 18.2 a whole
// block at a time 4 ahead, 14.7 with no software prefetch, and 17.7 on the file's layout (kq_fly).
constexpr int64_t K4P_AHEAD = 2 * K4P_BB;

#if defined(KVLM_AVX512)

// One unit of 16 rows in load_rows' layout: lo[a] 128-bit lane l = row a + 4l's elements 0..15, hi[a]
// its elements 16..31.
struct KUnit {
    __m512i lo[4], hi[4];
    __m512 dw, mw;
    __m512i sl, sh;  // Q6_K's sub-scales (int32 lanes)
};

// Per block of 16 rows: what its units share (K-quants: the decoded scales; Q5_K: the high bits).
struct KHead {
    __m512 dw[8], mw[8];
    __m512i qh[8];  // Q5_K: qh bytes 0..15 (qh[0..3]) and 16..31 (qh[4..7]) in load_rows' layout
    __m512i sc[4];  // Q6_K: lane c = row c's int8 scales 4j .. 4j + 3 (sc[j])
};

KVLM_INLINE __m512i nib(__m512i z, int sh) {
    return _mm512_and_si512(_mm512_srli_epi16(z, sh), _mm512_set1_epi8(15));
}

// Q5_0 / Q5_1 block at `off`: qh at off + qh_at, the nibbles at off + qs_at. The 16 rows' qh are read
// into load_rows' layout (each 128-bit lane's first dword is its row's qh), spread to bytes by a shuffle
// (byte e of a lane: qh byte e / 8) and tested against bit e % 8: masks of the elements with a 5th bit.
KVLM_INLINE void q5_unit(const uint8_t* const* rows, int64_t off, int qh_at, int qs_at, KUnit* u) {
    __m512i z[4], q[4];
    load_rows(rows, off + qh_at, q);
    load_rows(rows, off + qs_at, z);
    const __m512i b4 = _mm512_set1_epi8(16), bits = _mm512_set1_epi64((long long)0x8040201008040201ULL);
    const __m512i spread_lo = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
    const __m512i spread_hi = _mm512_broadcast_i32x4(_mm_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    for (int a = 0; a < 4; a++) {
        const __m512i l = nib(z[a], 0), h = nib(z[a], 4);
        u->lo[a] = _mm512_mask_add_epi8(l, _mm512_test_epi8_mask(_mm512_shuffle_epi8(q[a], spread_lo), bits), l, b4);
        u->hi[a] = _mm512_mask_add_epi8(h, _mm512_test_epi8_mask(_mm512_shuffle_epi8(q[a], spread_hi), bits), h, b4);
    }
}

// Q4_K / Q5_K: the 12 packed 6-bit scales and mins (bytes 4..15) of 16 rows, decoded for all 8 sub-blocks.
// t[0] lane c = row c's d | dmin << 16, t[1..3] = its scale bytes 0..3, 4..7, 8..11 (a panel-packed block's
// head as stored, kernels_kquant_panels.h).
KVLM_INLINE void k4_scales_t(const __m512i* t, KHead* h) {
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(t[0]));
    const __m512 ndmin = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(t[0], 16))));
    const __m512i m63 = _mm512_set1_epi32(63), m15 = _mm512_set1_epi32(15), m3 = _mm512_set1_epi32(3);
    for (int j = 0; j < 8; j++) {
        __m512i sc, mn;
        if (j < 4) {
            sc = _mm512_and_si512(_mm512_srli_epi32(t[1], 8 * j), m63);
            mn = _mm512_and_si512(_mm512_srli_epi32(t[2], 8 * j), m63);
        } else {
            const int k = j - 4;
            sc = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(t[3], 8 * k), m15),
                                 _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(t[1], 8 * k + 6), m3), 4));
            mn = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(t[3], 8 * k + 4), m15),
                                 _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(t[2], 8 * k + 6), m3), 4));
        }
        h->dw[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
        h->mw[j] = _mm512_mul_ps(ndmin, _mm512_cvtepi32_ps(mn));
    }
}

KVLM_INLINE void k4_scales(const uint8_t* const* rows, int64_t off, KHead* h) {
    __m512i z[4], t[4];
    load_rows(rows, off, z);
    transpose4(z, t);
    k4_scales_t(t, h);
}

template <int QT>
KVLM_INLINE void kq_head(const uint8_t* const* rows, int64_t off, KHead* h) {
    if constexpr (QT == T_Q4_K || QT == T_Q5_K) k4_scales(rows, off, h);
    if constexpr (QT == T_Q5_K) {
        load_rows(rows, off + 16, h->qh);
        load_rows(rows, off + 32, h->qh + 4);
    }
    if constexpr (QT == T_Q6_K) {
        __m512i z[4];
        load_rows(rows, off + 192, z);
        transpose4(z, h->sc);
        // d is at bytes 208..209: the last dword of the 16 bytes from 194, so the read stays inside the block
        const __m512i dd = _mm512_srli_epi32(dwords16<3>(rows, off + 194), 16);
        h->dw[0] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
    }
}

// The units of the block at `off`, in ascending s: fn(s, unit) for each. Units that read the same bytes
// share their loads (the 16 rows' bytes are gathered into load_rows' layout, the costly part of a unit at
// few rows): Q4_K / Q5_K units 2j and 2j + 1 are the low and high nibbles of the same 32 bytes a row;
// Q6_K's 4 units of a 128-element half (c = 0..3) share its 32 qh bytes, and c, c + 2 their ql bytes.
// Only loads are shared: each unit's values and the order fn sees them are those of unit-by-unit reads.
template <int QT, typename F>
KVLM_INLINE void kq_units(const uint8_t* const* rows, int64_t off, const KHead& h, KUnit* u, F&& fn) {
    if constexpr (QT == T_Q5_0 || QT == T_Q5_1) {
        const __m512i head = dwords16<0>(rows, off);
        u->dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
        if constexpr (QT == T_Q5_1) u->mw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
        q5_unit(rows, off, QT == T_Q5_0 ? 2 : 4, QT == T_Q5_0 ? 6 : 8, u);
        fn(0, *u);
    } else if constexpr (QT == T_Q4_K || QT == T_Q5_K) {
        for (int j = 0; j < 4; j++) {
            const int64_t q = off + (QT == T_Q4_K ? 16 : 48) + 32 * j;
            __m512i zl[4], zh[4];
            load_rows(rows, q, zl);
            load_rows(rows, q + 16, zh);
            for (int s = 2 * j; s < 2 * j + 2; s++) {
                for (int a = 0; a < 4; a++) u->lo[a] = nib(zl[a], 4 * (s & 1)), u->hi[a] = nib(zh[a], 4 * (s & 1));
                if constexpr (QT == T_Q5_K) {
                    const __m512i bit = _mm512_set1_epi8((char)(1 << s)), b4 = _mm512_set1_epi8(16);
                    for (int a = 0; a < 4; a++) {
                        u->lo[a] = _mm512_mask_add_epi8(u->lo[a], _mm512_test_epi8_mask(h.qh[a], bit), u->lo[a], b4);
                        u->hi[a] = _mm512_mask_add_epi8(u->hi[a], _mm512_test_epi8_mask(h.qh[4 + a], bit), u->hi[a], b4);
                    }
                }
                u->dw = h.dw[s], u->mw = h.mw[s];
                fn(s, *u);
            }
        }
    } else {  // Q6_K: sub-block s = 4 hh + c, low bits from ql, high 2 bits from qh
        const __m512i m3 = _mm512_set1_epi8(3);
        for (int hh = 0; hh < 2; hh++) {
            __m512i l[2][2][4], qh[2][4];  // l[c & 1][half]: ql bytes 64 hh + 32 (c & 1) + 16 half; qh[half]
            for (int p = 0; p < 2; p++) {
                load_rows(rows, off + 64 * hh + 32 * p, l[p][0]);
                load_rows(rows, off + 64 * hh + 32 * p + 16, l[p][1]);
            }
            load_rows(rows, off + 128 + 32 * hh, qh[0]);
            load_rows(rows, off + 128 + 32 * hh + 16, qh[1]);
            for (int c = 0; c < 4; c++) {
                const int s = 4 * hh + c;
                for (int a = 0; a < 4; a++) {
                    u->lo[a] = _mm512_or_si512(nib(l[c & 1][0][a], (c >> 1) * 4),
                                               _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh[0][a], 2 * c), m3), 4));
                    u->hi[a] = _mm512_or_si512(nib(l[c & 1][1][a], (c >> 1) * 4),
                                               _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh[1][a], 2 * c), m3), 4));
                }
                const __m512i sc = h.sc[s / 2];  // scales 2s (elements 0..15) and 2s + 1 (16..31): bytes 2 (s % 2), + 1
                u->sl = _mm512_srai_epi32(_mm512_slli_epi32(sc, 24 - 16 * (s % 2)), 24);
                u->sh = _mm512_srai_epi32(_mm512_slli_epi32(sc, 16 - 16 * (s % 2)), 24);
                u->dw = h.dw[0];
                fn(s, *u);
            }
        }
    }
}

// The float epilogue of one unit for one row of x (ActRows index ib of that row).
template <int QT>
KVLM_INLINE void kq_finish(__m512i isum, __m512 dw, __m512 mw, const ActRows& a, int64_t ib, __m512* acc, __m512* mn) {
    *acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(isum), dw), _mm512_set1_ps(a.xd[8 * ib]), *acc);
    if constexpr (KQ<QT>::MIN) *mn = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.xs[ib]), *mn);
}

// The integer start of a row's unit sums (lo: elements 0..15 or all 32; hi: Q6_K's 16..31).
template <int QT>
KVLM_INLINE __m512i kq_init_lo(const ActRows& a, const int32_t* l16, int64_t ib) {
    if constexpr (QT == T_Q5_0) return _mm512_set1_epi32(-16 * a.xi[ib]);
    if constexpr (QT == T_Q6_K) return _mm512_set1_epi32(-32 * l16[ib]);
    return _mm512_setzero_si512();
}
KVLM_INLINE __m512i kq_init_hi(const ActRows& a, const int32_t* l16, int64_t ib) {
    return _mm512_set1_epi32(-32 * (a.xi[ib] - l16[ib]));
}

// Few rows: unit ib of MT rows of x (from the first row of `a`) against the 16 rows in place.
template <int QT, int MT>
KVLM_INLINE void kq_direct(const KUnit& u, const ActRows& a, const int32_t* l16, int64_t ib, __m512* acc, __m512* mn) {
    for (int i = 0; i < MT; i++) {
        const int64_t r = i * a.nb + ib;
        const int8_t* xp = a.xq + i * a.K + 32 * ib;
        const __m512i xl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)xp));
        const __m512i xh = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(xp + 16)));
        __m512i isum;
        if constexpr (QT == T_Q6_K) {
            __m512i sl[4], sh[4];
            for (int j = 0; j < 4; j++)
                sl[j] = dot_acc(_mm512_setzero_si512(), u.lo[j], xl), sh[j] = dot_acc(_mm512_setzero_si512(), u.hi[j], xh);
            const __m512i lo = _mm512_add_epi32(kq_init_lo<QT>(a, l16, r), sum_rows4(sl));
            const __m512i hi = _mm512_add_epi32(kq_init_hi(a, l16, r), sum_rows4(sh));
            isum = _mm512_add_epi32(_mm512_mullo_epi32(lo, u.sl), _mm512_mullo_epi32(hi, u.sh));
        } else {
            __m512i s[4];
            for (int j = 0; j < 4; j++) s[j] = dot_acc(dot_acc(_mm512_setzero_si512(), u.lo[j], xl), u.hi[j], xh);
            isum = _mm512_add_epi32(kq_init_lo<QT>(a, l16, r), sum_rows4(s));
        }
        kq_finish<QT>(isum, u.dw, u.mw, a, r, acc + i, mn + i);
    }
}

// Many rows: a unit transposed once (v[j] lane c = row c's elements 4j .. 4j + 3), used by every tile.
struct KPanel {
    __m512i v[8];
    __m512 dw, mw;
    __m512i sl, sh;
};

KVLM_INLINE void kq_prep(const KUnit& u, KPanel* p) {
    transpose4(u.lo, p->v);
    transpose4(u.hi, p->v + 4);
    p->dw = u.dw, p->mw = u.mw, p->sl = u.sl, p->sh = u.sh;
}

template <int QT, int MT>
KVLM_INLINE void kq_tile_unit(const KPanel& p, const ActRows& a, const int32_t* l16, int64_t m0, int64_t ib,
                              __m512* acc, __m512* mn) {
    __m512i lo[MT], hi[MT];
    for (int i = 0; i < MT; i++) {
        lo[i] = kq_init_lo<QT>(a, l16, (m0 + i) * a.nb + ib);
        if constexpr (QT == T_Q6_K) hi[i] = kq_init_hi(a, l16, (m0 + i) * a.nb + ib);
    }
    // Unrolled, each sum named by value: a pointer chosen per j (lo or hi) kept Q6_K's 2 MT sums in memory,
    // spilled and reloaded around every dot product (230 against Q4_K's 500 GOP/s at M = 512, 1 thread, Zen 5)
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < MT; i++) {
            int32_t q4;
            memcpy(&q4, a.xq + (m0 + i) * a.K + 32 * ib + 4 * j, 4);
            if (QT == T_Q6_K && j >= 4) hi[i] = dot_acc(hi[i], p.v[j], _mm512_set1_epi32(q4));
            else lo[i] = dot_acc(lo[i], p.v[j], _mm512_set1_epi32(q4));
        }
    for (int i = 0; i < MT; i++) {
        __m512i isum = lo[i];
        if constexpr (QT == T_Q6_K) isum = _mm512_add_epi32(_mm512_mullo_epi32(lo[i], p.sl), _mm512_mullo_epi32(hi[i], p.sh));
        kq_finish<QT>(isum, p.dw, p.mw, a, (m0 + i) * a.nb + ib, acc + i, mn + i);
    }
}

template <int QT, int MT>
KVLM_INLINE void kq_store(const __m512* acc, const __m512* mn, float* y, int64_t ldy, __mmask16 live) {
    for (int i = 0; i < MT; i++)
        _mm512_mask_storeu_ps(y + i * ldy, live, KQ<QT>::MIN ? _mm512_add_ps(acc[i], mn[i]) : acc[i]);
}

template <int QT, int MT>
void kq_fly(const uint8_t* const* rows, const uint8_t* ahead, const uint8_t* end, const ActRows& a,
            const int32_t* l16, float* y, int64_t ldy, __mmask16 live) {
    __m512 acc[MT], mn[MT];
    for (int i = 0; i < MT; i++) acc[i] = mn[i] = _mm512_setzero_ps();
    constexpr int64_t BB = KQ<QT>::BB, SUB = KQ<QT>::SUB;
    KHead h;
    KUnit u;
    u.mw = _mm512_setzero_ps();
    for (int64_t b = 0; b < a.nb / SUB; b++) {
        prefetch_slice(ahead, end, b, 16 * BB);
        kq_head<QT>(rows, b * BB, &h);
        kq_units<QT>(rows, b * BB, h, &u,
                     [&](int s, const KUnit& v) { kq_direct<QT, MT>(v, a, l16, b * SUB + s, acc, mn); });
    }
    kq_store<QT, MT>(acc, mn, y, ldy, live);
}

// Q6_K, few rows of x (decode, kq_stream below): a weight row at a time in its own byte order, not
// load_rows' panel layout. Why: through load_rows a Q6_K unit of 16 rows costs 12 panel loads (a load and a blend each)
// and ~50 unpack instructions, and Q6_K ran at half Q4_K's bytes per second. In a row's own order the
// 64 ql bytes of a 128-element half are its elements 0..63 (low nibbles) and 64..127 (high nibbles) in
// order, and its 32 qh bytes broadcast to both 256-bit halves give their 2 top bits with one variable
// shift per vector: a super-block is 4 zmm w[k] of 6-bit u (elements 64 k .. 64 k + 63) after ~14
// instructions. Per weight row and row of x:
//     D[k] dword t = sum over elements 64 k + 4 t .. + 3 of (u - 32) q   (started from -32 x's dword sums)
//     G dword 4 L + k = the sum of D[k]'s 128-bit lane L = group 4 k + L (16 elements, one int8 scale)
//     P = G * the row's scales (permuted to G's order)
// rows r and r + 4 are merged (lanes 0 + 1 and 2 + 3 added: units 2 k and 2 k + 1) and two 4 x 4
// transposes put unit s of the 16 rows in one vector, lane c = row c. Each isum is the int32 of kq_units'
// sl (sum_lo - 32 q_lo) + sh (sum_hi - 32 q_hi) (integers: any order), and the float epilogue is
// kq_finish's, unit after unit: the bits of every other path. Q4_K's rows the same way (k4_row, no scales
// in the integers: P = G). (Read a super-block of each row in turn, as before kq_stream, Q4_K / Q5_K
// measured 0.87x / 0.95x of their panel path: memory order, not unpacking, is what pays.)
KVLM_INLINE __m512i k6_groups(const __m512i d[4]) {
    const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(d[0], d[1]), _mm512_unpackhi_epi32(d[0], d[1]));
    const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(d[2], d[3]), _mm512_unpackhi_epi32(d[2], d[3]));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
}

// Two 16-bit shift counts: c0 for the low 256 bits, c1 for the high.
KVLM_INLINE __m512i k6_counts(int c0, int c1) {
    return _mm512_inserti64x4(_mm512_set1_epi16((short)c0), _mm256_set1_epi16((short)c1), 1);
}

// One weight row's super-block at q as w[4] (above) and its scales in G's order.
KVLM_INLINE void k6_row(const uint8_t* q, __m512i w[4], __m512i* sc) {
    // qh to bits 4..5: elements 0..31 of a half want qh bits 0..1 (<< 4), 32..63 bits 2..3 (<< 2), 64..95
    // bits 4..5 (as is), 96..127 bits 6..7 (>> 2); 16-bit shifts, the bytes' other bits masked off
    const __m512i m0f = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
    for (int hh = 0; hh < 2; hh++) {
        const __m512i v = _mm512_loadu_si512((const void*)(q + 64 * hh));
        const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(q + 128 + 32 * hh)));
        // (v & 15) | h': ternary logic 0xEC is (A & C) | B
        w[2 * hh] = _mm512_ternarylogic_epi32(v, _mm512_and_si512(_mm512_sllv_epi16(h, k6_counts(4, 2)), m30), m0f, 0xEC);
        w[2 * hh + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4),
                                                  _mm512_and_si512(_mm512_srlv_epi16(h, k6_counts(0, 2)), m30), m0f, 0xEC);
    }
    const __m512i perm = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    *sc = _mm512_permutexvar_epi32(perm, _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 192))));
}

constexpr int64_t STREAM_ROWS = 3;  // up to this many rows of x: kq_stream (k6_fly, before it, spilled registers at 4)

// Q4_K and Q6_K, 1 to 3 rows of x (decode), in memory order. The rows' units come from k6_row / k4_row
// as above, but each weight row is read whole. Why: reading a super-block of each of the 16 rows in turn
// (k6_fly, before) is 16 streams advancing 144-210 bytes at a time, which the hardware prefetcher does not
// follow; a software prefetch of the panel after next carried it to ~30 GB/s on a Zen 5 whose plain
// sequential reads reached 34-61 GB/s in the same minutes (even plain loads in that order stopped at ~30).
// In row order the prefetcher streams: Q6_K 8192x2048 and 49152x2048 at M = 1, 2 threads, cold, 1.2-1.5x
// (docs/kernels.md). The panel is read as STREAM_WAYS streams side by side, stream q over its rows
// 8 q .. 8 q + 7 (contiguous bytes), a super-block of each stream in turn, each prefetching its own bytes
// STREAM_AHEAD on, a block's lines at a time. Why: one stream a thread (the 16 rows one after another, in
// chunks of 8 super-blocks, the panel after next prefetched a row chunk at a time) read Q6_K at ~17-19 GB/s on
// a Xeon whose 2 threads read memory at ~24; two streams of whole rows, each with its own prefetch, at
// 20-23 (1.13-1.39x on `avx512-vnni`, `scripts/kernel_ab/gbs.sh`, docs/kernels.md "Q6_K decode in two
// streams"). Pass 1 keeps each (row, super-block)'s group sums P (k6_groups of the 4 dot products, times
// Q6_K's int8 scales) in this thread's scratch S; pass 2 merges and transposes them per super-block (rows r and r + 4, two 4 x 4 dword
// transposes: lane c = row c) and runs kq_finish unit after unit with the panel's float scales (kq_head, read
// again from cache): the same int32 isums and float epilogue as every other path, so the same bits. x0s:
// Q6_K's -32 x dword sums per (row of x, 64 codes), made once per call. S: (MT, K / 256, 16) zmm.
// Against the loop before (Q6_K, M = 1, the Xeon, `avx512-vnni`): 1 way 1.09-1.19x where K >= 3072 (4 ways
// 1.21-1.43x), 4 ways 1.01-1.04x at K = 2048 (1 way 1.10-1.12x); 2 ways 1.13-1.39x on every shape.
constexpr int STREAM_WAYS = 2;
constexpr int64_t STREAM_K4_BLOCKS = 8;  // Q4_K streams up to K = 2048 (past it: panels, 0.92x at 2048 x 8192)
struct alignas(64) ZV {
    __m512i v;
};

// Q4_K: one row's super-block at q as 4 zmm of 4-bit u, w[k] = the low nibbles of qs bytes 32 k .. 32 k + 31
// (unit 2 k, elements 64 k .. + 31) then their high nibbles (unit 2 k + 1, elements 64 k + 32 .. + 63): x's
// codes in their own order, and G's lanes (k6_groups) come in k6_row's unit order.
KVLM_INLINE void k4_row(const uint8_t* q, __m512i w[4]) {
    const __m512i m0f = _mm512_set1_epi8(15), cnt = k6_counts(0, 4);
    for (int k = 0; k < 4; k++)
        w[k] = _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(q + 16 + 32 * k))), cnt), m0f);
}

template <int QT, int MT>
void kq_stream(const uint8_t* const* rows, const uint8_t* end, const ActRows& a, const ZV* x0s, ZV* S, float* y,
               int64_t ldy, __mmask16 live) {
    constexpr int64_t BB = KQ<QT>::BB;
    constexpr int RW = 16 / STREAM_WAYS;  // rows a stream
    const int64_t nsb = a.nb / 8;
    __m512 acc[MT], mn[MT];
    for (int i = 0; i < MT; i++) acc[i] = mn[i] = _mm512_setzero_ps();
    for (int r = 0; r < RW; r++) {
        for (int64_t b = 0; b < nsb; b++) {
            for (int q = 0; q < STREAM_WAYS; q++) {
                const int c = RW * q + r;
                const uint8_t* cur = rows[c] + b * BB;
                prefetch_stream<BB>(cur, end);
                __m512i w[4], sc;
                if constexpr (QT == T_Q6_K) k6_row(cur, w, &sc);
                else k4_row(cur, w);
                for (int i = 0; i < MT; i++) {
                    __m512i d[4];
                    for (int k = 0; k < 4; k++)
                        d[k] = dot_acc(QT == T_Q6_K ? x0s[(i * nsb + b) * 4 + k].v : _mm512_setzero_si512(), w[k],
                                       _mm512_loadu_si512((const void*)(a.xq + i * a.K + 256 * b + 64 * k)));
                    S[(i * nsb + b) * 16 + c].v = QT == T_Q6_K ? _mm512_mullo_epi32(k6_groups(d), sc) : k6_groups(d);
                }
            }
        }
    }
    for (int64_t b = 0; b < nsb; b++) {  // pass 2, super-block after super-block
        KHead h;
        if constexpr (QT == T_Q6_K) {  // only d (bytes 208..209, read inside the block as kq_head does)
            const __m512i dd = _mm512_srli_epi32(dwords16<3>(rows, b * BB + 194), 16);
            h.dw[0] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
        } else {
            kq_head<QT>(rows, b * BB, &h);
        }
        for (int i = 0; i < MT; i++) {
            const ZV* P = S + (i * nsb + b) * 16;
            __m512i R[8];
            for (int p = 0; p < 8; p++) {
                const int r0 = p < 4 ? p : p + 4;
                R[p] = _mm512_add_epi32(_mm512_shuffle_i32x4(P[r0].v, P[r0 + 4].v, 0x88),
                                        _mm512_shuffle_i32x4(P[r0].v, P[r0 + 4].v, 0xDD));
            }
            __m512i t[4], u[4];
            transpose4(R, t);
            transpose4(R + 4, u);
            for (int j = 0; j < 4; j++) {
                const int64_t ib = i * a.nb + 8 * b + 2 * j;
                const __m512i e0 = _mm512_shuffle_i32x4(t[j], u[j], 0x88), e1 = _mm512_shuffle_i32x4(t[j], u[j], 0xDD);
                if constexpr (QT == T_Q6_K) {
                    kq_finish<QT>(e0, h.dw[0], h.dw[0], a, ib, acc + i, mn + i);
                    kq_finish<QT>(e1, h.dw[0], h.dw[0], a, ib + 1, acc + i, mn + i);
                } else {
                    kq_finish<QT>(e0, h.dw[2 * j], h.mw[2 * j], a, ib, acc + i, mn + i);
                    kq_finish<QT>(e1, h.dw[2 * j + 1], h.mw[2 * j + 1], a, ib + 1, acc + i, mn + i);
                }
            }
        }
    }
    kq_store<QT, MT>(acc, mn, y, ldy, live);
}

// kq_stream's x0s for rows [0, M) of x: -(32 * each dword's 4 codes summed), per 64 codes.
KVLM_INLINE void k6_x0(const ActRows& a, int64_t M, ZV* x0s) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < a.nb / 2; j++)
            x0s[i * (a.nb / 2) + j].v = _mm512_sub_epi32(
                _mm512_setzero_si512(),
                dot_acc(_mm512_setzero_si512(), _mm512_set1_epi8(32), _mm512_loadu_si512((const void*)(a.xq + i * a.K + 64 * j))));
}

template <int QT, int MT>
void kq_tile(const KPanel* buf, const ActRows& a, const int32_t* l16, int64_t m0, float* y, int64_t ldy,
             __mmask16 live) {
    __m512 acc[MT], mn[MT];
    for (int i = 0; i < MT; i++) acc[i] = mn[i] = _mm512_setzero_ps();
    for (int64_t ib = 0; ib < a.nb; ib++) kq_tile_unit<QT, MT>(buf[ib], a, l16, m0, ib, acc, mn);
    kq_store<QT, MT>(acc, mn, y + m0 * ldy, ldy, live);
}

// The panel's units transposed into buf (nb KPanels), prefetching the panel after next (as kq_fly: without
// it 5+ rows (a speculative step's k + 1, a small batch) read the 16 interleaved weight rows at the hardware
// prefetcher's pace; kernels_int8_avx2.h measured 2x).
template <int QT>
KVLM_INLINE void kq_prep_panel(const uint8_t* const* rows, const ActRows& a, KPanel* buf, const uint8_t* ahead,
                               const uint8_t* end) {
    constexpr int64_t BB = KQ<QT>::BB, SUB = KQ<QT>::SUB;
    KHead h;
    KUnit u;
    u.mw = _mm512_setzero_ps(), u.sl = u.sh = _mm512_setzero_si512();
    for (int64_t b = 0; b < a.nb / SUB; b++) {
        prefetch_slice(ahead, end, b, 16 * BB);
        kq_head<QT>(rows, b * BB, &h);
        kq_units<QT>(rows, b * BB, h, &u, [&](int s, const KUnit& v) { kq_prep(v, buf + b * SUB + s); });
    }
}

// Rows [m, M) against the prepared panel: tiles of ROW_TILE rows, then the remainder.
template <int QT>
KVLM_INLINE void kq_tiles(const KPanel* buf, const ActRows& a, const int32_t* l16, int64_t m, int64_t M, float* yp,
                          int64_t ldy, __mmask16 mask) {
    for (; m + ROW_TILE <= M; m += ROW_TILE) kq_tile<QT, ROW_TILE>(buf, a, l16, m, yp, ldy, mask);
    switch (M - m) {
        case 1: kq_tile<QT, 1>(buf, a, l16, m, yp, ldy, mask); break;
        case 2: kq_tile<QT, 2>(buf, a, l16, m, yp, ldy, mask); break;
        case 3: kq_tile<QT, 3>(buf, a, l16, m, yp, ldy, mask); break;
        default: break;
    }
}

template <int QT>
void gemm_kq_t(const uint8_t* w, int64_t rs, int64_t K, const int8_t* xq, const float* xd, const float* xs,
               const int32_t* xi, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
    const ActRows a{xq, xd, xs, xi, K, K / 32};
    // Q4_K past K = 2048 keeps the panel path: its rows in chunks are 16 streams again, and its panel units
    // are cheap (0.92x measured at 2048 x 8192)
    const bool stream = M <= STREAM_ROWS && (QT == T_Q6_K || (QT == T_Q4_K && a.nb <= 8 * STREAM_K4_BLOCKS));
    const int32_t* l16 = QT == T_Q6_K && !stream ? lo16_sums(a, M) : nullptr;  // (kq_stream folds them in)
    if (QT == T_Q6_K && !stream && l16 == nullptr) return;
    const int64_t mt = amx_rows(M);  // rows [0, mt) on AMX tiles (then two panel buffers)
    KPanel* buf = M > FLY_ROWS ? thread_buffer<KPanel>(mt > 0 ? 2 * a.nb : a.nb) : nullptr;
    // kq_stream's scratch: x0s (M, nb / 2) then S (M, nb / 8, 16)
    ZV* zs = stream ? thread_buffer<ZV>(M * a.nb / 2 + M * a.nb / 8 * 16) : nullptr;
    if (stream && zs == nullptr) return;
    if (QT == T_Q6_K && zs) k6_x0(a, M, zs);
    prefetch_first_panels(w, rs, n0, n1);  // then two panels ahead, a slice per block, in both modes
#if defined(KVLM_AMX)
    if (mt > 0 && buf != nullptr) {
        amx_configure<QT == T_Q6_K>();
        const bool done = amx_gemm<QT>(buf, a, mt, y, ldy, n0, n1, [&](int64_t n, KPanel* pb) {
            const uint8_t* rows[16];
            const __mmask16 mask = panel_rows(w, rs, n, n1, rows);
            const uint8_t *ahead = w + (n + 32) * rs, *end = w + n1 * rs;
            kq_prep_panel<QT>(rows, a, pb, ahead, end);
            kq_tiles<QT>(pb, a, l16, mt, M, y + n, ldy, mask);  // rows [mt, M), as the buffer is now
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
        const uint8_t *ahead = w + (n + 32) * rs, *end = w + n1 * rs;
        if (buf == nullptr) {  // few rows (or no buffer): units used in place, 4 rows of x at a time
            for (int64_t m = 0; m < M; m += FLY_ROWS) {
                const ActRows am{xq + m * K, xd + 8 * m * a.nb, xs + m * a.nb, xi + m * a.nb, K, a.nb};
                const int32_t* lm = l16 ? l16 + m * a.nb : nullptr;
                if (stream) {  // Q4_K / Q6_K: weight rows whole, in memory order
                    switch (M) {
                        case 1: kq_stream<QT, 1>(rows, end, am, zs, zs + M * a.nb / 2, yp, ldy, mask); break;
                        case 2: kq_stream<QT, 2>(rows, end, am, zs, zs + M * a.nb / 2, yp, ldy, mask); break;
                        default: kq_stream<QT, 3>(rows, end, am, zs, zs + M * a.nb / 2, yp, ldy, mask); break;
                    }
                } else {
                    switch (M - m < FLY_ROWS ? M - m : FLY_ROWS) {
                        case 1: kq_fly<QT, 1>(rows, ahead, end, am, lm, yp + m * ldy, ldy, mask); break;
                        case 2: kq_fly<QT, 2>(rows, ahead, end, am, lm, yp + m * ldy, ldy, mask); break;
                        case 3: kq_fly<QT, 3>(rows, ahead, end, am, lm, yp + m * ldy, ldy, mask); break;
                        default: kq_fly<QT, 4>(rows, ahead, end, am, lm, yp + m * ldy, ldy, mask); break;
                    }
                }
            }
            continue;
        }
        kq_prep_panel<QT>(rows, a, buf, ahead, end);
        kq_tiles<QT>(buf, a, l16, 0, M, yp, ldy, mask);
    }
}

#define KVLM_KQ_CALL(QT) gemm_kq_t<QT>(w, rs, K, xq, xd, xs, xi, M, y, ldy, n0, n1)

#include "kernels_kquant_panels.h"  // Q4_K in 16-row panels (gemm_k4p)

#else  // AVX2

#include "kernels_int8_avx2.h"  // the AVX2 kernel of every int8 format (gemm_avx2_t)
#include "kernels_kquant_panels_avx2.h"  // Q4_K in 16-row panels (gemm_k4p8)

#define KVLM_KQ_CALL(QT) gemm_avx2_t<QT>(w, rs, K, xq, xd, xs, xi, M, y, ldy, n0, n1)

#endif  // AVX2

// The int8 kernels of this file (gemv_i8's other types): 0, or -1 for a type it does not handle.
int gemv_kq(int qtype, const uint8_t* w, int64_t rs, int64_t K, const int8_t* xq, const float* xd, const float* xs,
            const int32_t* xi, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
    switch (qtype) {
        case T_Q5_0: KVLM_KQ_CALL(T_Q5_0); return 0;
        case T_Q5_1: KVLM_KQ_CALL(T_Q5_1); return 0;
        case T_Q4_K: KVLM_KQ_CALL(T_Q4_K); return 0;
        case T_Q5_K: KVLM_KQ_CALL(T_Q5_K); return 0;
        case T_Q6_K: KVLM_KQ_CALL(T_Q6_K); return 0;
        case T_Q4_K | PANELS16:  // whole panels of contiguous rows only
            if (n0 % 16 || n1 % 16 || rs != K / 256 * 144) return -1;
#if defined(KVLM_AVX512)
            gemm_k4p(w, rs, K, xq, xd, xs, xi, M, y, ldy, n0, n1);
#else
            gemm_k4p8(w, rs, K, xq, xd, xs, xi, M, y, ldy, n0, n1);
#endif
            return 0;
        default: return -1;
    }
}
#undef KVLM_KQ_CALL

}  // namespace
