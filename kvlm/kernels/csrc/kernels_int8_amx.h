// AMX tiles (Intel Xeon since Sapphire Rapids: TMUL, tdpbssd / tdpbsud) for the int8 kernels' many-row
// case, on the avx512-amx unit only (KVLM_AMX). Included by kernels_int8_panel.h; used by gemm_i8_t
// (Q4_0, Q4_1, Q8_0) and gemm_kq_t (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) for rows of x in groups of 16.
//
// Layout. The panel buffer the VNNI tiles use (PanelBlock, KPanel: v[j] lane c = column c's bytes
// 4j .. 4j + 3, 8 zmm per 32-element unit, one after another) is AMX's B operand as it stands: 8 rows
// of 64 bytes, K = 32 (tdpb* multiplies A's row m, bytes 4j .. 4j + 3, into B row j's 4 bytes of
// column c). A is 16 rows of x's int8 codes for the unit (32 bytes a row, K apart); C (16 x 16 int32)
// is then each of the 16 x 16 outputs' exact block sum. Before the tiles run, the buffer's bytes get
// the format's offset taken off (Q4_0 u - 8, Q5_0 u - 16, Q6_K u - 32, Q8_0 (w + 128) - 128 = w) so
// that signed x signed (tdpbssd) gives the sums with the offsets in; the other formats' u stay
// unsigned (tdpbsud). Q6_K's two halves (elements 0..15 and 16..31, one int8 scale each) are two
// products with K = 16: A and B split in halves.
//
// Contract: the same as the VNNI tiles' (kernels_int8_panel.h, kernels_kquant.h). isum is the same int32
// (integer sums: exact in any order), and the float epilogue below runs finish_block's / kq_finish's
// operations in the same order, unit after unit, so a row has the same bits whichever rows share its
// tile, whether they go through AMX or the VNNI tiles, and at M = 1.
//
// Work order. Two panels (32 columns, two buffers prepared as for the VNNI tiles) against 32 rows of x:
// 2 A tiles x 2 B tiles into 4 C tiles per unit, so each A and B tile load serves two products and x is
// read once per 32 columns (Q6_K: one panel, 16 rows, C in halves). C goes through memory (tilestored:
// AMX has no move from a tile to a vector register), a chunk of units at a time (AMX_CHUNK_BYTES of C):
// the next chunk's products are issued before this chunk's float epilogue runs, so the tile unit and the
// vector units work side by side. The epilogue takes 8 rows at a time over the chunk's units, their
// accumulators in registers. Rows past the last multiple of 16 take the VNNI tiles, and calls of fewer
// than AMX_MIN_ROWS rows all of them.

struct alignas(64) AmxConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Tiles 0-3: C (16 x 16 int32); 4-5: A (16 rows x 32 bytes, Q6_K 16); 6-7: B (8 x 64 bytes, Q6_K 4 x 64).
template <bool HALVES>
KVLM_INLINE void amx_configure() {
    AmxConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) c.colsb[t] = 64, c.rows[t] = 16;
    for (int t = 4; t < 6; t++) c.colsb[t] = HALVES ? 16 : 32, c.rows[t] = 16;
    for (int t = 6; t < 8; t++) c.colsb[t] = 64, c.rows[t] = HALVES ? 4 : 8;
    // Not _tile_loadconfig: GCC's declares only the first 8 bytes as read, so the stores of the rows and
    // columns could be dropped as dead (they were, in one build: the first tile load then faulted, #UD)
    __asm__ volatile("ldtilecfg %0" ::"m"(c));
}

// GCC's tile intrinsics are asm statements that declare no memory operands: these barriers keep the
// buffer's stores before a tile load and C's reads after its store.
#define KVLM_TILE_LOAD(t, p, s)                  \
    do {                                         \
        __asm__ volatile("" ::: "memory");       \
        _tile_loadd(t, p, s);                    \
    } while (0)
#define KVLM_TILE_STORE(t, p, s)                 \
    do {                                         \
        _tile_stored(t, p, s);                   \
        __asm__ volatile("" ::: "memory");       \
    } while (0)

template <int QT>
constexpr int AMX_BIAS = QT == T_Q4_0 ? 8 : QT == T_Q5_0 ? 16 : QT == T_Q6_K ? 32 : QT == T_Q8_0 ? 128 : 0;
template <int QT>
constexpr bool AMX_MIN = QT == T_Q4_1 || QT == T_Q5_1 || QT == T_Q4_K || QT == T_Q5_K;

// The buffer's units as signed bytes (AMX_BIAS > 0; after the VNNI tiles have used them unsigned).
template <int QT, typename P>
KVLM_INLINE void amx_signed(P* buf, int64_t nb) {
    if constexpr (AMX_BIAS<QT> != 0) {
        const __m512i bias = _mm512_set1_epi8((char)AMX_BIAS<QT>);
        for (int64_t ib = 0; ib < nb; ib++)
            for (int j = 0; j < 8; j++) buf[ib].v[j] = _mm512_sub_epi8(buf[ib].v[j], bias);
    }
}

// The product into C tile C of A and B: signed x signed where the buffer's bytes carry the offset.
#define KVLM_AMX_DP(C, A, B)                                    \
    do {                                                        \
        if constexpr (AMX_BIAS<QT> != 0) _tile_dpbssd(C, A, B); \
        else _tile_dpbsud(C, A, B);                             \
    } while (0)

// Bytes of C per chunk: 2 chunks in flight stay in L1 with x's tiles (a chunk of 4 units at 2 x 2 tiles, 8 for
// Q6_K's one panel: on a 2-core Xeon, 2 threads, 32 KB of C in flight ran 1.3x faster than 64 KB, and Q6_K's 8
// units 1.1x faster than 4)
constexpr int64_t AMX_CHUNK_BYTES = 16384;

// x packed per A tile: 16 rows x 32 bytes of one unit's codes, contiguous, then the 16 rows' block scales
// d and fake-quantized sums s. Why: read in place, a tile load touched 16 lines K bytes apart (a quarter
// of the time), and the epilogue's scales of 8 rows, (K / 32) * 32 bytes apart in ActRows (2 KB at
// K = 2048), fell into two L1 sets and missed every time (a vector-only test loop of this epilogue took
// 4.5 TSC cycles a row).
struct alignas(64) AmxA {
    int8_t q[16][32];
    float d[16], s[16];
};

// Rows [0, mt) of x as A tiles: tile T (rows 16 T ..) of unit ib at xp[T nb + ib].
KVLM_INLINE void amx_pack(const ActRows& a, int64_t mt, AmxA* xp) {
    for (int64_t m = 0; m < mt; m++) {
        const int8_t* row = a.xq + m * a.K;
        AmxA* t = xp + (m / 16) * a.nb;
        for (int64_t ib = 0; ib < a.nb; ib++) {
            _mm256_store_si256((__m256i*)t[ib].q[m % 16], _mm256_loadu_si256((const __m256i*)(row + 32 * ib)));
            t[ib].d[m % 16] = a.xd[8 * (m * a.nb + ib)];
            t[ib].s[m % 16] = a.xs[m * a.nb + ib];
        }
    }
}

// The products of unit ib (xt: the rows' first A tile) into C, stored at c: tile (p, t) (panel p, A tile t) at
// c + 256 (NT p + t) (Q6_K: lo at c, hi at c + 256). Tile numbers are literals (asm operands).
template <int QT, int NP, int NT, typename P>
KVLM_INLINE void amx_unit(const P* const* bufs, const AmxA* xt, int64_t nb, int64_t ib, int32_t* c) {
    if constexpr (QT == T_Q6_K) {
        KVLM_TILE_LOAD(4, xt[ib].q, 32);
        KVLM_TILE_LOAD(5, &xt[ib].q[0][16], 32);
        KVLM_TILE_LOAD(6, &bufs[0][ib].v[0], 64);
        KVLM_TILE_LOAD(7, &bufs[0][ib].v[4], 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 5, 7);
        KVLM_TILE_STORE(0, c, 64);
        KVLM_TILE_STORE(1, c + 256, 64);
    } else {
        KVLM_TILE_LOAD(4, xt[ib].q, 32);
        if constexpr (NT == 2) KVLM_TILE_LOAD(5, xt[nb + ib].q, 32);
        KVLM_TILE_LOAD(6, &bufs[0][ib].v[0], 64);
        if constexpr (NP == 2) KVLM_TILE_LOAD(7, &bufs[1][ib].v[0], 64);
        _tile_zero(0);
        KVLM_AMX_DP(0, 4, 6);
        if constexpr (NT == 2) {
            _tile_zero(1);
            KVLM_AMX_DP(1, 5, 6);
        }
        if constexpr (NP == 2) {
            _tile_zero(2);
            KVLM_AMX_DP(2, 4, 7);
            if constexpr (NT == 2) {
                _tile_zero(3);
                KVLM_AMX_DP(3, 5, 7);
            }
        }
        KVLM_TILE_STORE(0, c, 64);
        if constexpr (NT == 2) KVLM_TILE_STORE(1, c + 256, 64);
        if constexpr (NP == 2) KVLM_TILE_STORE(2, c + 256 * NT, 64);
        if constexpr (NP == 2 && NT == 2) KVLM_TILE_STORE(3, c + 256 * NT + 256, 64);
    }
}

// The float epilogue of units [ib0, ib0 + nu) for 8 rows of x (rows r0 .. r0 + 7 of A tile xt) of one
// panel: C row r of unit ib0 + u at c + u * cs + 16 r; the rows' accumulators (and mins) in registers,
// kept between chunks in acc / mn (8 rows x 16 floats; `first`: start from zero). finish_block's /
// kq_finish's operations.
template <int QT, typename P>
KVLM_INLINE void amx_epilogue(const P* buf, const AmxA* xt, int r0, int64_t ib0, int nu, const int32_t* c, int64_t cs,
                              float* acc, float* mn, bool first) {
    __m512 A[8], N[8];
    for (int r = 0; r < 8; r++) {
        A[r] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + 16 * r);
        if constexpr (AMX_MIN<QT>) N[r] = first ? _mm512_setzero_ps() : _mm512_load_ps(mn + 16 * r);
    }
    for (int u = 0; u < nu; u++) {
        const int64_t ib = ib0 + u;
        const P& w = buf[ib];
        const int32_t* cu = c + u * cs;
        for (int r = 0; r < 8; r++) {
            __m512i isum = _mm512_load_si512((const void*)(cu + 16 * r));
            if constexpr (QT == T_Q6_K)
                isum = _mm512_add_epi32(_mm512_mullo_epi32(isum, w.sl),
                                        _mm512_mullo_epi32(_mm512_load_si512((const void*)(cu + 256 + 16 * r)), w.sh));
            const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), w.dw);
            A[r] = _mm512_fmadd_ps(f, _mm512_set1_ps(xt[ib].d[r0 + r]), A[r]);
            if constexpr (AMX_MIN<QT>) N[r] = _mm512_fmadd_ps(w.mw, _mm512_set1_ps(xt[ib].s[r0 + r]), N[r]);
        }
    }
    for (int r = 0; r < 8; r++) {
        _mm512_store_ps(acc + 16 * r, A[r]);
        if constexpr (AMX_MIN<QT>) _mm512_store_ps(mn + 16 * r, N[r]);
    }
}

// Rows m0 .. m0 + 16 NT - 1 of x against NP prepared (signed) panel buffers; y at the first panel's
// first column, live: each panel's live columns.
template <int QT, int NP, int NT, typename P>
void amx_block(const P* const* bufs, const ActRows& a, const AmxA* xp, int64_t m0, float* y, int64_t ldy,
               const __mmask16* live) {
    constexpr int64_t CS = 256 * NP * NT * (QT == T_Q6_K ? 2 : 1);  // int32 of C per unit
    constexpr int64_t AMX_CHUNK = AMX_CHUNK_BYTES / (4 * CS);          // units per chunk
    alignas(64) int32_t c[2][AMX_CHUNK * CS];
    alignas(64) float acc[NP * 32 * 16], mn[NP * 32 * 16];
    const AmxA* xt = xp + (m0 / 16) * a.nb;
    const int64_t nch = (a.nb + AMX_CHUNK - 1) / AMX_CHUNK;
    auto issue = [&](int64_t ch) {
        for (int64_t ib = ch * AMX_CHUNK; ib < a.nb && ib < (ch + 1) * AMX_CHUNK; ib++)
            amx_unit<QT, NP, NT>(bufs, xt, a.nb, ib, c[ch & 1] + (ib - ch * AMX_CHUNK) * CS);
    };
    issue(0);
    for (int64_t ch = 0; ch < nch; ch++) {
        if (ch + 1 < nch) issue(ch + 1);  // the next chunk's products run while this one is finished
        const int64_t ib0 = ch * AMX_CHUNK;
        const int nu = (int)(a.nb - ib0 < AMX_CHUNK ? a.nb - ib0 : AMX_CHUNK);
        for (int p = 0; p < NP; p++)
            for (int t = 0; t < NT; t++)
                for (int r0 = 0; r0 < 16; r0 += 8) {
                    const int64_t o = (p * 16 * NT + 16 * t + r0) * 16;
                    amx_epilogue<QT>(bufs[p], xt + t * a.nb, r0, ib0, nu, c[ch & 1] + 256 * (NT * p + t) + 16 * r0, CS,
                                     acc + o, mn + o, ch == 0);
                }
    }
    for (int p = 0; p < NP; p++)
        for (int r = 0; r < 16 * NT; r++) {
            const int64_t o = (p * 16 * NT + r) * 16;
            const __m512 v = _mm512_load_ps(acc + o);
            _mm512_mask_storeu_ps(y + (m0 + r) * ldy + 16 * p, live[p],
                                  AMX_MIN<QT> ? _mm512_add_ps(v, _mm512_load_ps(mn + o)) : v);
        }
}

// Columns [n0, n1) for rows [0, mt) of x (mt: a multiple of 16), two panels at a time (Q6_K one):
// prep(n, buffer) prepares the panel at column n into the buffer (nb units), runs the VNNI tiles for
// rows [mt, M) on it as it is, and returns its live columns; buf holds 2 nb units. Returns false where
// the packed x could not be allocated (nothing done).
template <int QT, typename P, typename Prep>
bool amx_gemm(P* buf, const ActRows& a, int64_t mt, float* y, int64_t ldy, int64_t n0, int64_t n1, Prep&& prep) {
    constexpr int64_t STEP = QT == T_Q6_K ? 16 : 32;
    AmxA* xp = thread_buffer<AmxA>(mt / 16 * a.nb);
    if (xp == nullptr) return false;
    amx_pack(a, mt, xp);
    for (int64_t n = n0; n < n1; n += STEP) {
        const bool two = STEP == 32 && n + 16 < n1;
        __mmask16 live[2] = {prep(n, buf), 0};
        if (two) live[1] = prep(n + 16, buf + a.nb);
        amx_signed<QT>(buf, two ? 2 * a.nb : a.nb);
        const P* bufs[2] = {buf, buf + a.nb};
        float* yn = y + n;
        int64_t m = 0;
        if constexpr (QT == T_Q6_K) {
            for (; m < mt; m += 16) amx_block<QT, 1, 1>(bufs, a, xp, m, yn, ldy, live);
        } else {
            for (; m + 32 <= mt; m += 32) {
                if (two) amx_block<QT, 2, 2>(bufs, a, xp, m, yn, ldy, live);
                else amx_block<QT, 1, 2>(bufs, a, xp, m, yn, ldy, live);
            }
            if (m < mt && two) amx_block<QT, 2, 1>(bufs, a, xp, m, yn, ldy, live);
            else if (m < mt) amx_block<QT, 1, 1>(bufs, a, xp, m, yn, ldy, live);
        }
    }
    return true;
}

// Rows of x that go through the tiles: a multiple of 16, none below AMX_MIN_ROWS (on a 2-core Xeon, 2 threads,
// one tile of 16 rows ran at 0.91-1.11x the VNNI tiles, 64 rows 1.03-1.43x: `kvlm bench kernels`,
// docs/kernels.md).
constexpr int64_t AMX_MIN_ROWS = 32;
