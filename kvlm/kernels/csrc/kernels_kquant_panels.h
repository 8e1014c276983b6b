// Q4_K weights in 16-row panels (the AVX-512 units; the AVX2 ones read the same bytes in
// kernels_kquant_panels_avx2.h; kvlm/kernels/panels.py packs them once at load: the file's bytes, reordered). Panel p (weight rows 16 p .. 16 p + 15) is 16 row_bytes contiguous bytes at
// w + 16 p rs, super-block after super-block, K4P_BB bytes each:
//     4 x 16 dwords of the rows' heads: dword i lane c = row c's bytes 4 i .. 4 i + 3 (d | dmin << 16, then
//       the 12 scale bytes): k4_scales' transposed t[0..3] as stored;
//     32 x 16 dwords of their qs: dword 8 j + t lane c = row c's qs bytes 32 j + 4 t .. + 3, whose low
//       nibbles are unit 2 j's elements 4 t .. 4 t + 3 and whose high nibbles unit 2 j + 1's: a unit's KPanel
//       v[t] is one aligned load and two ops (nib) away.
// Why: in the file's layout a decode step gathers 16 rows through load_rows per unit (kq_fly), and Q4_K at
// M = 1 ran at ~18 GB/s a core from L2 on a Xeon whose cores read memory at ~14-16 GB/s each: compute and
// memory took turns, and the 3B Q4_K_M's decode read its weights at 18 GB/s (2 threads). A prototype of this
// loop ran at ~40 GB/s a core from L2. Each thread's panels are one ascending stream, prefetched into L2
// (docs/kernels.md has the numbers).
// Every unit's integer sums and float epilogue are kq_tile_unit's, so a row has the bits of every other path.
// K4P_BB and K4P_AHEAD: kernels_kquant.h (the AVX2 unit reads the same panels, kernels_kquant_panels_avx2.h).

KVLM_INLINE void k4p_head(const uint8_t* pb, KHead* h) {
    __m512i t[4];
    for (int i = 0; i < 4; i++) t[i] = _mm512_loadu_si512((const void*)(pb + 64 * i));
    k4_scales_t(t, h);
}

// Units 2 j and 2 j + 1 of the super-block at pb: fn(s, unit) for s = 2 j, 2 j + 1.
template <typename F>
KVLM_INLINE void k4p_units(const uint8_t* pb, const KHead& h, int j, F&& fn) {
    __m512i z[8];
    for (int t = 0; t < 8; t++) z[t] = _mm512_loadu_si512((const void*)(pb + 256 + 64 * (8 * j + t)));
    for (int s = 0; s < 2; s++) {
        KPanel u;
        for (int t = 0; t < 8; t++) u.v[t] = nib(z[t], 4 * s);
        u.dw = h.dw[2 * j + s], u.mw = h.mw[2 * j + s];
        u.sl = u.sh = _mm512_setzero_si512();
        fn(2 * j + s, u);
    }
}

// Few rows of x (decode): each unit's KPanel built in registers and used at once.
template <int MT>
void k4p_fly(const uint8_t* panel, const uint8_t* end, const ActRows& a, float* y, int64_t ldy) {
    __m512 acc[MT], mn[MT];
    for (int i = 0; i < MT; i++) acc[i] = mn[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a.nb / 8; b++) {
        const uint8_t* pb = panel + b * K4P_BB;
        KHead h;
        k4p_head(pb, &h);
        for (int j = 0; j < 4; j++) {
            // a quarter of the block K4P_AHEAD ahead and of the one twice as far (K4P_AHEAD's comment)
            prefetch_slice(pb + K4P_AHEAD + K4P_BB / 4 * j, end, 0, K4P_BB / 4);
            prefetch_slice(pb + 2 * K4P_AHEAD + K4P_BB / 4 * j, end, 0, K4P_BB / 4);
            k4p_units(pb, h, j, [&](int s, const KPanel& u) { kq_tile_unit<T_Q4_K, MT>(u, a, nullptr, 0, 8 * b + s, acc, mn); });
        }
    }
    kq_store<T_Q4_K, MT>(acc, mn, y, ldy, 0xFFFF);
}

// Many rows: the panel's units into buf (nb KPanels), as kq_prep_panel makes them from the file's layout.
KVLM_INLINE void k4p_prep_panel(const uint8_t* panel, const ActRows& a, KPanel* buf, const uint8_t* end) {
    for (int64_t b = 0; b < a.nb / 8; b++) {
        const uint8_t* pb = panel + b * K4P_BB;
        const uint8_t* next = pb + a.nb / 8 * K4P_BB;  // the next panel's block, a quarter per unit pair
        KHead h;
        k4p_head(pb, &h);
        for (int j = 0; j < 4; j++) {
            prefetch_slice(next + K4P_BB / 4 * j, end, 0, K4P_BB / 4);
            k4p_units(pb, h, j, [&](int s, const KPanel& u) { buf[8 * b + s] = u; });
        }
    }
}

// gemm_kq_t<T_Q4_K> on panel-packed weights: columns [n0, n1), both multiples of 16 (checked by gemv_kq).
void gemm_k4p(const uint8_t* w, int64_t rs, int64_t K, const int8_t* xq, const float* xd, const float* xs,
              const int32_t* xi, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
    const ActRows a{xq, xd, xs, xi, K, K / 32};
    const int64_t mt = amx_rows(M);  // rows [0, mt) on AMX tiles (then two panel buffers)
    KPanel* buf = M > FLY_ROWS ? thread_buffer<KPanel>(mt > 0 ? 2 * a.nb : a.nb) : nullptr;
    const uint8_t* end = w + n1 * rs;
    prefetch_first_panels(w, rs, n0, n1);
#if defined(KVLM_AMX)
    if (mt > 0 && buf != nullptr) {
        amx_configure<false>();
        const bool done = amx_gemm<T_Q4_K>(buf, a, mt, y, ldy, n0, n1, [&](int64_t n, KPanel* pb) {
            k4p_prep_panel(w + n * rs, a, pb, end);
            kq_tiles<T_Q4_K>(pb, a, nullptr, mt, M, y + n, ldy, 0xFFFF);  // rows [mt, M), as the buffer is now
            return (__mmask16)0xFFFF;
        });
        _tile_release();
        if (done) return;
    }
#endif
    for (int64_t n = n0; n < n1; n += 16) {
        const uint8_t* panel = w + n * rs;
        if (buf == nullptr) {  // few rows (or no buffer): units used as they are made, 4 rows of x at a time
            for (int64_t m = 0; m < M; m += FLY_ROWS) {
                const ActRows am{xq + m * K, xd + 8 * m * a.nb, xs + m * a.nb, xi + m * a.nb, K, a.nb};
                float* yp = y + m * ldy + n;
                switch (M - m < FLY_ROWS ? M - m : FLY_ROWS) {
                    case 1: k4p_fly<1>(panel, end, am, yp, ldy); break;
                    case 2: k4p_fly<2>(panel, end, am, yp, ldy); break;
                    case 3: k4p_fly<3>(panel, end, am, yp, ldy); break;
                    default: k4p_fly<4>(panel, end, am, yp, ldy); break;
                }
            }
            continue;
        }
        k4p_prep_panel(panel, a, buf, end);
        kq_tiles<T_Q4_K>(buf, a, nullptr, 0, M, y + n, ldy, 0xFFFF);
    }
}
