// Q4_K in 16-row panels on AVX2 (the avx2 and avx2-vnni units): the layout kvlm/kernels/panels.py packs and
// kernels_kquant_panels.h describes, read as two 8-row halves side by side. Included by kernels_kquant.h after
// kernels_int8_avx2.h, whose units, tiles and contract it uses.
//
// A 64-byte line of a packed super-block is 16 dwords, lane c = row c, so its first 32 bytes are rows 0..7 and
// its second rows 8..15: each half is one ymm load per line.
//   - head: lines 0..3 are head8's transposed t[0..3] (d | dmin << 16, the 12 scale bytes) for each half;
//   - quants: line 8 j + t, after nib8, is Panel8's v[t] of unit 2 j (low nibbles) or 2 j + 1 (high): lane c =
//     row c's elements 4 t .. 4 t + 3 of the unit.
// So a unit is 8 loads (shared by 2 units) and 8 or 16 bit ops away from the form tile_unit8 multiplies with x's
// 4 bytes broadcast (one int32 sum per lane, no load_rows8 blends and no sum_rows8), and each thread reads its
// panels as one ascending stream, prefetched as AVX-512's k4p_fly does.
// Why: in the file's layout (fly8) Q4_K at one row of x read 16.7 GB/s from memory on 2 threads of the Xeon
// (read pass 23), while it ran at 24 GB/s hot: the 8 interleaved row streams, not the arithmetic, held it.
// Here: 1.18-1.21x at one row of x from memory, 86-94% of the read pass (the Xeon, avx2 and avx2-vnni; docs/kernels.md
// "Q4_K panels on AVX2").
// The integer sums are exact and each unit's float epilogue is finish8's, in unit order: the bits of fly8 and
// of tile8 on the file's layout (tests/kernels/test_panels.py on every ISA).

namespace {

// Lines of [p, p + BYTES) into L2 (kernels_int8_avx2.h's prefetch_slice8), unless p is past end: a quarter (decode)
// or an eighth (the buffer's fill) of a super-block a call. The fill prefetching a whole block at a time ran 9 to
// 16 rows of x at 0.92-0.95x of fly8's buffer path from memory, and at 0.99-1.01x spread this way (the Xeon, avx2).
template <int64_t BYTES>
KVLM_INLINE void prefetch_k4p8(const uint8_t* p, const uint8_t* end) {
    if (p < end) prefetch_slice8<BYTES>(p, 0);
}

// The 8 unit factors of a super-block's half (rows 8 half .. 8 half + 7) at pb.
KVLM_INLINE void k4p8_head(const uint8_t* pb, int half, __m256* dw, __m256* mw) {
    __m256i t[4];
    for (int i = 0; i < 4; i++) t[i] = _mm256_loadu_si256((const __m256i*)(pb + 64 * i + 32 * half));
    k4_scales8(t, dw, mw);
}

// Units ib = 8 b + 2 j and ib + 1 of MT rows of x against NH halves of the super-block (2: both; 1: the half
// whose quants start at qs): each line's low nibbles are unit ib's, its high nibbles unit ib + 1's, so each line
// is loaded once for both. acc[NH i + h] as tile_unit8<T_Q4_K, MT, NH> computes it (its integers, then finish8),
// unit ib then ib + 1; the min terms as direct8's fma into mn. dw / mw [NH e + h]: unit ib + e's factors.
template <int MT, int NH>
KVLM_INLINE void k4p8_pair(const uint8_t* qs, int j, const ActRows& a, int64_t ib, const __m256* dw, const __m256* mw,
                           __m256* acc, __m256* mn) {
    // s[2 NH i + NH e + h]: unit ib + e; AVX-VNNI: int32 sums; AVX2: int16 sums of 8 maddubs
    // (|16 u q| <= 16 * 15 * 127 < 2^15)
    __m256i s[2 * NH * MT];
    const int8_t* xb = a.xq + 32 * ib;
    const __m256i m0f = _mm256_set1_epi8(15);
#pragma GCC unroll 8
    for (int t = 0; t < 8; t++) {
        __m256i w[2 * NH];  // w[NH e + h]
        for (int h = 0; h < NH; h++) {
            const __m256i z = _mm256_loadu_si256((const __m256i*)(qs + 64 * (8 * j + t) + 32 * h));
            w[h] = _mm256_and_si256(z, m0f), w[NH + h] = _mm256_and_si256(_mm256_srli_epi16(z, 4), m0f);
        }
        for (int i = 0; i < MT; i++)
            for (int e = 0; e < 2; e++) {
                int32_t q4;
                memcpy(&q4, xb + i * a.K + 32 * e + 4 * t, 4);
                const __m256i x = _mm256_set1_epi32(q4);
                for (int h = 0; h < NH; h++) {
                    __m256i& v = s[2 * NH * i + NH * e + h];
                    if constexpr (VNNI8) {
                        v = dot8(t == 0 ? _mm256_setzero_si256() : v, w[NH * e + h], x);
                    } else {
                        const __m256i d = _mm256_maddubs_epi16(w[NH * e + h], x);
                        v = t == 0 ? d : _mm256_add_epi16(v, d);
                        __asm__("" : "+x"(v));  // as tile_unit8: a chain of sums, not a spilled tree
                    }
                }
            }
    }
    for (int e = 0; e < 2; e++)
        for (int i = 0; i < MT; i++)
            for (int h = 0; h < NH; h++) {
                const int64_t r = i * a.nb + ib + e;
                const __m256i v = s[2 * NH * i + NH * e + h];
                const __m256i isum = VNNI8 ? v : _mm256_madd_epi16(v, _mm256_set1_epi16(1));
                finish8(isum, dw[NH * e + h], a, r, acc + NH * i + h);
                mn[NH * i + h] = _mm256_fmadd_ps(mw[NH * e + h], _mm256_set1_ps(a.xs[r]), mn[NH * i + h]);
            }
}

// Few rows of x (decode): the outputs of MT rows of x and NH halves of the panel from half h0 (NH = 2: all 16;
// NH = 1 for 3 or 4 rows, whose 2 halves' sums would spill), super-block after super-block.
template <int MT, int NH>
void k4p8_fly(const uint8_t* panel, int h0, const uint8_t* end, const ActRows& a, float* y, int64_t ldy) {
    __m256 acc[NH * MT], mn[NH * MT];
    for (int k = 0; k < NH * MT; k++) acc[k] = mn[k] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a.nb / 8; b++) {
        const uint8_t* pb = panel + b * K4P_BB;
        __m256 dw[NH][8], mw[NH][8];
        for (int h = 0; h < NH; h++) k4p8_head(pb, h0 + h, dw[h], mw[h]);
        for (int j = 0; j < 4; j++) {
            prefetch_k4p8<K4P_BB / 4>(pb + K4P_AHEAD + K4P_BB / 4 * j, end);  // as k4p_fly (K4P_AHEAD's comment)
            prefetch_k4p8<K4P_BB / 4>(pb + 2 * K4P_AHEAD + K4P_BB / 4 * j, end);
            __m256 dwu[2 * NH], mwu[2 * NH];
            for (int e = 0; e < 2; e++)
                for (int h = 0; h < NH; h++) dwu[NH * e + h] = dw[h][2 * j + e], mwu[NH * e + h] = mw[h][2 * j + e];
            k4p8_pair<MT, NH>(pb + 256 + 32 * h0, j, a, 8 * b + 2 * j, dwu, mwu, acc, mn);
        }
    }
    for (int h = 0; h < NH; h++) {
        __m256 ah[MT], mh[MT];
        for (int i = 0; i < MT; i++) ah[i] = acc[NH * i + h], mh[i] = mn[NH * i + h];
        store8<T_Q4_K, MT>(ah, mh, y + 8 * (h0 + h), ldy, 8);
    }
}

// Many rows: the panel's halves as tiles8's two Panel8 buffers (buf: half 0's nb units, then half 1's).
KVLM_INLINE void k4p8_prep_panel(const uint8_t* panel, const ActRows& a, Panel8* buf, const uint8_t* end) {
    for (int64_t b = 0; b < a.nb / 8; b++) {
        const uint8_t* pb = panel + b * K4P_BB;
        // the next panel's block, an eighth per unit pair: it arrives while this panel's tiles run (as
        // gemm_avx2_t's buffer path prefetches the panel after next)
        const uint8_t* next = pb + a.nb / 8 * K4P_BB;
        for (int h = 0; h < 2; h++) {
            __m256 dw[8], mw[8];
            k4p8_head(pb, h, dw, mw);
            Panel8* p = buf + h * a.nb + 8 * b;
            for (int j = 0; j < 4; j++) {  // units 2 j (low nibbles) and 2 j + 1 (high)
                prefetch_k4p8<K4P_BB / 8>(next + K4P_BB / 8 * (4 * h + j), end);
                for (int t = 0; t < 8; t++) {
                    const __m256i z = _mm256_loadu_si256((const __m256i*)(pb + 256 + 64 * (8 * j + t) + 32 * h));
                    p[2 * j].v[t] = nib8(z, 0), p[2 * j + 1].v[t] = nib8(z, 4);
                }
                for (int e = 0; e < 2; e++) p[2 * j + e].dw = dw[2 * j + e], p[2 * j + e].mw = mw[2 * j + e];
            }
        }
    }
}

// Up to this many rows of x: k4p8_fly, 4 at a time (at 5 to 8 rows 1.04-1.18x the buffer path; at 9 to 16 0.93x;
// the Xeon, avx2 and avx2-vnni)
constexpr int64_t K4P8_FLY = 8;

// gemm_avx2_t<T_Q4_K> on panel-packed weights: columns [n0, n1), both multiples of 16 (checked by gemv_kq).
void gemm_k4p8(const uint8_t* w, int64_t rs, int64_t K, const int8_t* xq, const float* xd, const float* xs,
               const int32_t* xi, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
    const ActRows a{xq, xd, xs, xi, K, K / 32};
    Panel8* buf = M > K4P8_FLY ? thread_buffer<Panel8>(2 * a.nb) : nullptr;
    const uint8_t* end = w + n1 * rs;
    for (const uint8_t* p = w + n0 * rs; p < w + std::min(n1, n0 + 32) * rs; p += 64)  // the first two panels
        _mm_prefetch((const char*)p, _MM_HINT_T1);
    const int lives[2] = {8, 8};
    for (int64_t n = n0; n < n1; n += 16) {
        const uint8_t* panel = w + n * rs;
        if (buf == nullptr) {  // few rows (or no buffer): up to 2 rows of x on both halves, 3 or 4 a half at a time
            for (int64_t m = 0; m < M; m += FLY_ROWS2) {
                const ActRows am{xq + m * K, xd + 8 * m * a.nb, xs + m * a.nb, xi + m * a.nb, K, a.nb};
                float* yp = y + m * ldy + n;
                switch (M - m < FLY_ROWS2 ? M - m : FLY_ROWS2) {
                    case 1: k4p8_fly<1, 2>(panel, 0, end, am, yp, ldy); break;
                    case 2: k4p8_fly<2, 2>(panel, 0, end, am, yp, ldy); break;
                    case 3: for (int h = 0; h < 2; h++) k4p8_fly<3, 1>(panel, h, end, am, yp, ldy); break;
                    default: for (int h = 0; h < 2; h++) k4p8_fly<4, 1>(panel, h, end, am, yp, ldy); break;
                }
            }
            continue;
        }
        k4p8_prep_panel(panel, a, buf, end);
        tiles8<T_Q4_K, 2>(buf, a, nullptr, M, y + n, ldy, lives);
    }
}

}  // namespace
