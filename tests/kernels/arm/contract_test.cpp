// The int8-activation kernels against their order contract, bit for bit, outside Python: a standalone
// program built from one ISA unit's sources (isa_<unit>.cpp, as the extension compiles it) plus the
// portable unit (isa_scalar.cpp), checked against a scalar reference written here from the contract
// (docs/kernels.md "Contract: AVX-512's"; reference.qmatmul_int8_contract in numpy):
//     x quantized per 32: d = amax / 127, q = round_even(x * (1 / d)), s = d * sum(q)
//     isum_ib = exact sum of the unit's integer weights (offsets, Q6_K's sub-scales included) times q
//     acc = fma(float(isum_ib) * dw_ib, xd_ib, acc) over ib in order; mn = fma(mw_ib, xs_ib, mn); y = acc + mn
// Every format, M = 1, 2, 3, 8, 64, several (N, K) with panel tails, whole calls and calls split over
// column ranges (as threads split them). Built natively on x86 (AVX2 / AVX-512 units, where the CPU
// runs them) and cross-compiled for aarch64 (NEON, NEON + dotprod, NEON + i8mm) to run under qemu-aarch64:
// tests/kernels/test_arm_contract.py. Prints one line per unit and format; exit 1 on any difference.
// BF16 weights (their own contract, csrc/kernels_bf16.h) are checked the same way.
//   usage: contract_test [quick]
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <random>
#include <vector>

#include "kernels.h"

#ifndef UNIT_FN
#error "build with -DUNIT_FN=kvlm_kernels_<unit> (the ISA unit under test)"
#endif
#ifndef UNIT_NAME
#define UNIT_NAME "unit"
#endif
extern "C" const KvlmKernels* UNIT_FN(void);

struct Fmt {
    const char* name;
    int qt, be, bb;
    std::vector<int> halves;  // byte offsets of the f16 factors in a block
};
static const Fmt FMTS[] = {
    {"Q4_0", T_Q4_0, 32, 18, {0}},          {"Q4_1", T_Q4_1, 32, 20, {0, 2}},     {"Q8_0", T_Q8_0, 32, 34, {0}},
    {"Q5_0", T_Q5_0, 32, 22, {0}},          {"Q5_1", T_Q5_1, 32, 24, {0, 2}},     {"Q4_K", T_Q4_K, 256, 144, {0, 2}},
    {"Q5_K", T_Q5_K, 256, 176, {0, 2}},     {"Q6_K", T_Q6_K, 256, 210, {208}}};

static std::mt19937 rng(7);

static float half_to_float(uint16_t h) {  // exact for the finite halves used here
    const int e = (h >> 10) & 31, m = h & 1023;
    const float v = e == 0 ? ldexpf((float)m, -24) : ldexpf((float)(1024 + m), e - 25);
    return h & 0x8000 ? -v : v;
}
static float f16at(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

// Random bytes; the f16 factors finite, |v| in [2^-14, 2^-3) (exponent 1..11), either sign.
static std::vector<uint8_t> make_w(const Fmt& f, int64_t N, int64_t K) {
    const int64_t rs = K / f.be * f.bb;
    std::vector<uint8_t> w(N * rs);
    for (auto& b : w) b = (uint8_t)rng();
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < K / f.be; b++)
            for (int h : f.halves) {
                const uint16_t v = (uint16_t)((rng() & 0x8000) | ((1 + rng() % 11) << 10) | (rng() & 1023));
                memcpy(&w[n * rs + b * f.bb + h], &v, 2);
            }
    return w;
}

// The reference: unit ib of row `row` as integer weights iw[32] (the dot with q is isum), dw, mw.
static void ref_unit(const Fmt& f, const uint8_t* row, int64_t ib, int32_t iw[32], float* dw, float* mw) {
    *mw = 0.0f;
    if (f.be == 32) {
        const uint8_t* b = row + ib * f.bb;
        *dw = f16at(b);
        for (int e = 0; e < 32; e++) {
            const int qs = f.qt == T_Q4_0 ? 2 : f.qt == T_Q4_1 ? 4 : f.qt == T_Q5_0 ? 6 : 8;
            const int nib = (b[qs + e % 16] >> (4 * (e / 16))) & 15;
            if (f.qt == T_Q8_0) iw[e] = (int8_t)b[2 + e];
            else if (f.qt == T_Q4_0) iw[e] = nib - 8;
            else if (f.qt == T_Q4_1) iw[e] = nib;
            else {
                uint32_t qh;
                memcpy(&qh, b + qs - 4, 4);
                iw[e] = (nib | (int)((qh >> e) & 1) << 4) - (f.qt == T_Q5_0 ? 16 : 0);
            }
        }
        if (f.qt == T_Q4_1 || f.qt == T_Q5_1) *mw = f16at(b + 2);
        return;
    }
    const uint8_t* b = row + (ib / 8) * f.bb;
    const int s = (int)(ib % 8);
    if (f.qt == T_Q6_K) {
        const int h = s / 4, c = s % 4;
        for (int e = 0; e < 32; e++) {
            const int lo = (b[64 * h + (c & 1) * 32 + e] >> ((c >> 1) * 4)) & 15;
            const int hi = (b[128 + 32 * h + e] >> (2 * c)) & 3;
            iw[e] = ((lo | hi << 4) - 32) * (int8_t)b[192 + 2 * s + e / 16];
        }
        *dw = f16at(b + 208);
        return;
    }
    const uint8_t* sc12 = b + 4;  // 6-bit scales and mins of the 8 sub-blocks
    int sc, m;
    if (s < 4) sc = sc12[s] & 63, m = sc12[s + 4] & 63;
    else sc = (sc12[s + 4] & 15) | ((sc12[s - 4] >> 6) << 4), m = (sc12[s + 4] >> 4) | ((sc12[s] >> 6) << 4);
    const float d = f16at(b), dmin = f16at(b + 2);
    *dw = d * (float)sc;
    *mw = -(dmin * (float)m);
    const uint8_t* q = b + (f.qt == T_Q4_K ? 16 : 48) + 32 * (s / 2);
    for (int e = 0; e < 32; e++) {
        iw[e] = (q[e] >> (4 * (s & 1))) & 15;
        if (f.qt == T_Q5_K) iw[e] |= ((b[16 + e] >> s) & 1) << 4;
    }
}

struct Act {
    std::vector<int8_t> q;
    std::vector<float> d, s;
    std::vector<int32_t> i;
};

static Act ref_quant(const std::vector<float>& x, int64_t M, int64_t K) {
    const int64_t nb = K / 32;
    Act a{std::vector<int8_t>(M * K), std::vector<float>(8 * M * nb), std::vector<float>(M * nb), std::vector<int32_t>(M * nb)};
    for (int64_t i = 0; i < M * nb; i++) {
        float amax = 0.0f;
        for (int e = 0; e < 32; e++) amax = fabsf(x[32 * i + e]) > amax ? fabsf(x[32 * i + e]) : amax;
        const float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int e = 0; e < 32; e++) {
            volatile float p = x[32 * i + e] * inv;
            const int32_t r = (int32_t)nearbyintf(p);
            a.q[32 * i + e] = (int8_t)r;
            sum += r;
        }
        for (int e = 0; e < 8; e++) a.d[8 * i + e] = d;
        a.i[i] = sum;
        volatile float s = d * (float)sum;
        a.s[i] = s;
    }
    return a;
}

static std::vector<float> ref_matmul(const Fmt& f, const std::vector<uint8_t>& w, int64_t N, int64_t K, const Act& a,
                                     int64_t M) {
    const int64_t nb = K / 32, rs = K / f.be * f.bb;
    const bool has_min = f.qt == T_Q4_1 || f.qt == T_Q5_1 || f.qt == T_Q4_K || f.qt == T_Q5_K;
    std::vector<float> y(M * N);
    std::vector<int32_t> iw(nb * 32);
    std::vector<float> dw(nb), mw(nb);
    for (int64_t n = 0; n < N; n++) {
        for (int64_t ib = 0; ib < nb; ib++) ref_unit(f, w.data() + n * rs, ib, &iw[32 * ib], &dw[ib], &mw[ib]);
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.0f, mn = 0.0f;
            for (int64_t ib = 0; ib < nb; ib++) {
                int64_t isum = 0;
                for (int e = 0; e < 32; e++) isum += (int64_t)iw[32 * ib + e] * a.q[m * K + 32 * ib + e];
                volatile float fs = (float)isum * dw[ib];  // rounded on its own
                acc = fmaf(fs, a.d[8 * (m * nb + ib)], acc);
                if (has_min) mn = fmaf(mw[ib], a.s[m * nb + ib], mn);
            }
            y[m * N + n] = has_min ? acc + mn : acc;
        }
    }
    return y;
}

static int compare(const char* what, const float* got, const float* want, int64_t count) {
    for (int64_t i = 0; i < count; i++)
        if (memcmp(got + i, want + i, 4) != 0) {
            fprintf(stderr, "MISMATCH %s at %lld: got %.9g want %.9g\n", what, (long long)i, got[i], want[i]);
            return 1;
        }
    return 0;
}

// One unit on one format and shape: quantization, the whole call, and split calls, against the reference.
static int check(const char* unit, const KvlmKernels* t, const Fmt& f, int64_t M, int64_t N, int64_t K,
                 const std::vector<uint8_t>& w, const std::vector<float>& x, const Act& ra, const std::vector<float>& want) {
    char what[160];
    snprintf(what, sizeof what, "%s %s M=%lld N=%lld K=%lld", unit, f.name, (long long)M, (long long)N, (long long)K);
    const int64_t nb = K / 32, rs = K / f.be * f.bb;
    Act a{std::vector<int8_t>(M * K), std::vector<float>(8 * M * nb), std::vector<float>(M * nb), std::vector<int32_t>(M * nb)};
    t->quantize_act(x.data(), M, K, a.q.data(), a.d.data(), a.s.data(), a.i.data());
    if (memcmp(a.q.data(), ra.q.data(), M * K) || memcmp(a.d.data(), ra.d.data(), 4 * a.d.size()) ||
        memcmp(a.s.data(), ra.s.data(), 4 * a.s.size()) || memcmp(a.i.data(), ra.i.data(), 4 * a.i.size())) {
        fprintf(stderr, "MISMATCH %s: quantize_act\n", what);
        return 1;
    }
    std::vector<float> y(M * N, NAN);
    if (t->gemv_i8(f.qt, w.data(), rs, K, a.q.data(), a.d.data(), a.s.data(), a.i.data(), M, y.data(), N, 0, N) != 0) {
        fprintf(stderr, "MISMATCH %s: gemv_i8 refused the format\n", what);
        return 1;
    }
    if (compare(what, y.data(), want.data(), M * N)) return 1;
    // Column ranges as threads take them: 16-column panels, and an odd split (5 then the rest).
    std::fill(y.begin(), y.end(), NAN);
    for (int64_t p = 0; p < N; p += 16)
        t->gemv_i8(f.qt, w.data(), rs, K, a.q.data(), a.d.data(), a.s.data(), a.i.data(), M, y.data(), N, p, p + 16 < N ? p + 16 : N);
    if (compare(what, y.data(), want.data(), M * N)) return 1;
    std::fill(y.begin(), y.end(), NAN);
    const int64_t cut = N < 5 ? N : 5;
    t->gemv_i8(f.qt, w.data(), rs, K, a.q.data(), a.d.data(), a.s.data(), a.i.data(), M, y.data(), N, 0, cut);
    t->gemv_i8(f.qt, w.data(), rs, K, a.q.data(), a.d.data(), a.s.data(), a.i.data(), M, y.data(), N, cut, N);
    return compare(what, y.data(), want.data(), M * N);
}

// BF16 weights (csrc/kernels_bf16.h): x rounded to bf16 (nearest even), per output lane l and 32-element
// chunk fma(x[2l+1], w[2l+1], acc) then fma(x[2l], w[2l], acc), zero-padded, denormals flushed; the fixed tree
// (lanes i and i + 8, then i + 4, ...); reference.qmatmul_bf16_contract in torch.
static float bf(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static float flush(float v) { return fabsf(v) < 1.17549435e-38f ? copysignf(0.0f, v) : v; }
static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // finite inputs here
}
static std::vector<float> ref_bf16(const std::vector<uint16_t>& w, int64_t N, int64_t K, const std::vector<float>& x,
                                   int64_t M) {
    std::vector<float> y(M * N);
    const int64_t nc = (K + 31) / 32;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            float acc[16] = {};
            for (int64_t c = 0; c < nc; c++)
                for (int l = 0; l < 16; l++)
                    for (int e : {1, 0}) {
                        const int64_t k = 32 * c + 2 * l + e;
                        const float xv = k < K ? flush(bf(to_bf16(x[m * K + k]))) : 0.0f;
                        const float wv = k < K ? flush(bf(w[n * K + k])) : 0.0f;
                        acc[l] = flush(fmaf(xv, wv, acc[l]));
                    }
            for (int h = 8; h >= 1; h /= 2)
                for (int l = 0; l < h; l++) acc[l] = flush(acc[l] + acc[l + h]);
            y[m * N + n] = acc[0];
        }
    return y;
}
static int check_bf16(const char* unit, const KvlmKernels* t, int64_t M, int64_t N, int64_t K) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<uint16_t> w(N * K);
    std::vector<float> x(M * K), y(M * N, NAN);
    for (auto& v : w) v = to_bf16(nd(rng));
    for (auto& v : x) v = nd(rng);
    char what[160];
    snprintf(what, sizeof what, "%s BF16 M=%lld N=%lld K=%lld", unit, (long long)M, (long long)N, (long long)K);
    const std::vector<float> want = ref_bf16(w, N, K, x, M);
    const uint8_t* wb = (const uint8_t*)w.data();
    if (t->gemv(T_BF16, wb, 2 * K, K, x.data(), M, y.data(), N, 0, N) != 0) {
        fprintf(stderr, "MISMATCH %s: gemv refused BF16\n", what);
        return 1;
    }
    if (compare(what, y.data(), want.data(), M * N)) return 1;
    std::fill(y.begin(), y.end(), NAN);
    const int64_t cut = N < 5 ? N : 5;
    t->gemv(T_BF16, wb, 2 * K, K, x.data(), M, y.data(), N, 0, cut);
    t->gemv(T_BF16, wb, 2 * K, K, x.data(), M, y.data(), N, cut, N);
    return compare(what, y.data(), want.data(), M * N);
}

int main(int argc, char** argv) {
    const bool quick = argc > 1 && strcmp(argv[1], "quick") == 0;
    struct Shape { int64_t M, N, K, Kk; };  // Kk: K for the 256-element K-quants
    std::vector<Shape> shapes = {{1, 37, 544, 768}, {2, 38, 544, 768}, {3, 37, 544, 768}, {8, 67, 576, 768}, {64, 23, 576, 512},
                                 {1, 1536, 576, 768}, {3, 576, 1536, 1536}};
    if (!quick) shapes.push_back({8, 1536, 576, 768}), shapes.push_back({1, 17, 32, 256});
    const KvlmKernels* units[2] = {UNIT_FN(), kvlm_kernels_scalar()};
    const char* names[2] = {UNIT_NAME, "scalar"};
    int bad = 0;
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (const Fmt& f : FMTS) {
        int64_t checks = 0;
        for (const Shape& s : shapes) {
            const int64_t K = f.be == 256 ? s.Kk : s.K;
            const std::vector<uint8_t> w = make_w(f, s.N, K);
            std::vector<float> x(s.M * K);
            for (auto& v : x) v = nd(rng);
            for (int64_t e = 0; e < 32 && e < K; e++) x[e] = 0.0f;  // an all-zero block (d = 0)
            if (s.M > 1) x[K + 3] = 1e4f;  // a block dominated by one value
            const Act ra = ref_quant(x, s.M, K);
            const std::vector<float> want = ref_matmul(f, w, s.N, K, ra, s.M);
            for (int u = 0; u < 2; u++) {
                bad |= check(names[u], units[u], f, s.M, s.N, K, w, x, ra, want);
                checks++;
            }
        }
        printf("%s %s: %lld checks\n", UNIT_NAME, f.name, (long long)checks);
    }
    int64_t bchecks = 0;
    for (const Shape& s : shapes)
        for (int u = 0; u < 2; u++) bad |= check_bf16(names[u], units[u], s.M, s.N, s.K + 5), bchecks++;  // a tail
    printf("%s BF16: %lld checks\n", UNIT_NAME, (long long)bchecks);
    printf(bad ? "FAIL\n" : "OK\n");
    return bad;
}
