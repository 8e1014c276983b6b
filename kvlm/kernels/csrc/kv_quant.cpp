// The int8 / int4 quantizer and the Hadamard rotation (kv_quantize.h), vectorized: GCC vector extensions
// and loops over fixed 32-value groups, compiled per ISA by target_clones; and their torch ops,
// torch.ops.kvlm_kernels.kv_quantize / hadamard, the native twins of kvlm/kernels/kv_quant.py's
// quantize_ref / hadamard_ref (tests/kernels/test_kv_quant.py: same bits).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>

#include "kv_quantize.h"

namespace kvlm {
namespace {

#define KVQ_INLINE static inline __attribute__((always_inline))

typedef float v16q __attribute__((vector_size(64)));
typedef float v16qu __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16q __attribute__((vector_size(64)));

// d (float32) -> its float16 bits (a zero scale +0.0, saturated at 65504) and the float32 inverse of it.
KVQ_INLINE float kv_scale(float d, uint8_t* dst, float* inv) {
    d = d == 0.0f ? 0.0f : std::fmin(std::fmax(d, -65504.0f), 65504.0f);
    const c10::Half h(d);
    std::memcpy(dst, &h.x, 2);
    const float df = static_cast<float>(h);
    *inv = df != 0.0f ? 1.0f / df : 0.0f;
    return df;
}

// The scalar butterflies (any block size): one block of n at b.
KVQ_INLINE void hadamard_block_scalar(float* b, int64_t n, float s) {
    for (int64_t h = 1; h < n; h <<= 1)
        for (int64_t i = 0; i < n; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                const float u = b[j], v = b[j + h];
                b[j] = u + v;
                b[j + h] = u - v;
            }
    for (int64_t j = 0; j < n; j++) b[j] *= s;
}

// One stride-h stage (h < 16) inside 16 lanes: lane j pairs with lane j ^ h; the lane with bit h clear
// gets u + v, the other u - v (u the clear lane's value): the scalar loop's operations, lane by lane.
template <int H>
KVQ_INLINE v16q stage_in(v16q x) {
    const i16q idx = {0 ^ H, 1 ^ H, 2 ^ H, 3 ^ H, 4 ^ H, 5 ^ H, 6 ^ H, 7 ^ H,
                      8 ^ H, 9 ^ H, 10 ^ H, 11 ^ H, 12 ^ H, 13 ^ H, 14 ^ H, 15 ^ H};
    const i16q hi = {0 & H, 1 & H, 2 & H, 3 & H, 4 & H, 5 & H, 6 & H, 7 & H,
                     8 & H, 9 & H, 10 & H, 11 & H, 12 & H, 13 & H, 14 & H, 15 & H};
#if defined(__clang__)  // clang has no __builtin_shuffle; the same constant permutation
    (void)idx;
    const v16q p = __builtin_shufflevector(x, x, 0 ^ H, 1 ^ H, 2 ^ H, 3 ^ H, 4 ^ H, 5 ^ H, 6 ^ H, 7 ^ H, 8 ^ H,
                                           9 ^ H, 10 ^ H, 11 ^ H, 12 ^ H, 13 ^ H, 14 ^ H, 15 ^ H);
#else
    const v16q p = __builtin_shuffle(x, idx);
#endif
    return hi != 0 ? p - x : x + p;
}

// One block of n (a power of two >= 16) at b, 16 lanes at a time.
KVQ_INLINE void hadamard_block_vec(float* b, int64_t n, float s) {
    v16q v[64];  // n <= 1024
    const int64_t nv = n / 16;
    for (int64_t i = 0; i < nv; i++) v[i] = *(const v16qu*)(b + 16 * i);
    for (int64_t i = 0; i < nv; i++) v[i] = stage_in<8>(stage_in<4>(stage_in<2>(stage_in<1>(v[i]))));
    for (int64_t h = 1; h < nv; h <<= 1)  // strides 16, 32, ...: whole vectors
        for (int64_t i = 0; i < nv; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                const v16q u = v[j], w = v[j + h];
                v[j] = u + w;
                v[j + h] = u - w;
            }
    for (int64_t i = 0; i < nv; i++) *(v16qu*)(b + 16 * i) = v[i] * s;
}

KVQ_INLINE void hadamard_one(float* x, int64_t D) {
    const int64_t n = hadamard_block(D);
    const float s = 1.0f / std::sqrt(static_cast<float>(n));
    for (int64_t o = 0; o < D; o += n) {
        if (n >= 16 && n <= 1024) hadamard_block_vec(x + o, n, s);
        else hadamard_block_scalar(x + o, n, s);
    }
}

typedef double v8d __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef int64_t i8d __attribute__((vector_size(64)));

// 32 doubles, as 4 vectors of 8 (p[j] = elements 8j .. 8j + 7) -> their sum in kv_quant._tree_sum's
// order: halves added, 32 -> 16 -> 8 (whole vectors), then 8 -> 4 -> 2 -> 1 inside one vector.
KVQ_INLINE double tree_sum(const v8d* p) {
    v8d t = (p[0] + p[2]) + (p[1] + p[3]);  // element i < 16: e[i] + e[i + 16]; then i < 8: + the i + 8 one
#if defined(__clang__)  // clang: __builtin_shufflevector with the same constant lanes
    t = t + __builtin_shufflevector(t, t, 4, 5, 6, 7, 4, 5, 6, 7);
    t = t + __builtin_shufflevector(t, t, 2, 3, 2, 3, 2, 3, 2, 3);
#else
    t = t + __builtin_shuffle(t, (i8d){4, 5, 6, 7, 4, 5, 6, 7});
    t = t + __builtin_shuffle(t, (i8d){2, 3, 2, 3, 2, 3, 2, 3});
#endif
    return t[0] + t[1];
}

// 32 floats -> 4 vectors of 8 doubles (exact).
KVQ_INLINE void widen32(const float* f, v8d* out) {
    for (int j = 0; j < 4; j++) {
        v8f h;
        std::memcpy(&h, f + 8 * j, sizeof h);
        out[j] = __builtin_convertvector(h, v8d);
    }
}

// One group of 32 floats -> 34 bytes (float16 scale, 32 int8 codes).
KVQ_INLINE void q8_group(const float* x, uint8_t* dst) {
    float a[32];
    for (int i = 0; i < 32; i++) a[i] = std::fabs(x[i]);
    for (int h = 16; h >= 1; h >>= 1)  // max is exact: any order gives amax
        for (int i = 0; i < h; i++) a[i] = a[i] > a[i + h] ? a[i] : a[i + h];
    float inv;
    kv_scale(a[0] / 127.0f, dst, &inv);
    int8_t q[32];
    for (int i = 0; i < 32; i++) {
        float c = std::nearbyint(x[i] * inv);
        c = c < -127.0f ? -127.0f : c;
        c = c > 127.0f ? 127.0f : c;
        q[i] = static_cast<int8_t>(static_cast<int32_t>(c));
    }
    std::memcpy(dst + 2, q, 32);
}

// int4's scale candidates (kv_quant.py Q4_CANDIDATES): d = m / (Q4_LEVELS[0] * t / 8); the first is the plain
// rule, not refitted.
constexpr float Q4_CANDIDATES[] = {8.0f, 7.5f, 8.0f, 8.5f};
constexpr int Q4_N = sizeof(Q4_CANDIDATES) / sizeof(float);
// The midpoints between consecutive int4 levels (kv_quantize.h Q4_LEVELS): a value's code is how many lie below it.
struct Q4Mids {
    float m[15];
    constexpr Q4Mids() : m{} {
        for (int j = 0; j < 15; j++) m[j] = (Q4_LEVELS[j] + Q4_LEVELS[j + 1]) / 2.0f;
    }
};
constexpr Q4Mids Q4_MIDS{};

// One group of 32 floats -> 18 bytes (float16 scale, byte j = c_j | c_{j+16} << 4): kv_quant._q4_search.
KVQ_INLINE void q4_group(const float* x, uint8_t* dst) {
    float hi[16], lo[16];
    for (int i = 0; i < 16; i++) {
        hi[i] = x[i] > x[i + 16] ? x[i] : x[i + 16];
        lo[i] = x[i] < x[i + 16] ? x[i] : x[i + 16];
    }
    for (int h = 8; h >= 1; h >>= 1)
        for (int i = 0; i < h; i++) {
            hi[i] = hi[i] > hi[i + h] ? hi[i] : hi[i + h];
            lo[i] = lo[i] < lo[i + h] ? lo[i] : lo[i + h];
        }
    const float m = hi[0] >= -lo[0] ? hi[0] : lo[0];  // signed extreme, the positive one on a tie
    v8d xd[4];
    widen32(x, xd);
    double best = 0.0;
    uint8_t best_d[2];
    uint8_t best_c[32];
    float prev[32];
    for (int k = 0; k < Q4_N; k++) {
        uint8_t d16[2];
        float inv;
        float df = kv_scale(m / (Q4_LEVELS[0] * Q4_CANDIDATES[k] / 8.0f), d16, &inv);
        float c[32];  // the codes' levels
        uint8_t ci[32];  // the codes
        for (int i = 0; i < 32; i++) {
            const float y = x[i] * inv;
            int n = 0;
            for (int j = 0; j < 15; j++) n += Q4_MIDS.m[j] < y;  // the nearest level (a tie: the lower one)
            ci[i] = static_cast<uint8_t>(n);
            c[i] = Q4_LEVELS[n];
        }
        if (k > 1 && std::memcmp(c, prev, sizeof(c)) == 0) continue;  // the previous refitted candidate's codes:
        // the same scale and error again, and a tie keeps the earlier one, so skipping changes no bit
        v8d cd[4];
        widen32(c, cd);
        if (k > 0) {  // least squares for these levels: sum(x l) / sum(l^2), exact products in float64
            std::memcpy(prev, c, sizeof(c));
            v8d xc[4], cc[4];
            for (int j = 0; j < 4; j++) xc[j] = xd[j] * cd[j], cc[j] = cd[j] * cd[j];
            const double sxc = tree_sum(xc), scc = tree_sum(cc);
            float unused;
            df = kv_scale(scc > 0.0 ? static_cast<float>(sxc / scc) : 0.0f, d16, &unused);
        }
        float r[32];
        for (int i = 0; i < 32; i++) r[i] = x[i] - c[i] * df;  // l * df is exact in float32
        v8d e[4];
        widen32(r, e);
        for (int j = 0; j < 4; j++) e[j] = e[j] * e[j];
        const double err = tree_sum(e);
        if (k == 0 || err < best) {
            best = err;
            std::memcpy(best_d, d16, 2);
            std::memcpy(best_c, ci, sizeof(ci));
        }
    }
    std::memcpy(dst, best_d, 2);
    for (int j = 0; j < 16; j++) dst[2 + j] = static_cast<uint8_t>(best_c[j] | (best_c[j + 16] << 4));
}

}  // namespace

__attribute__((target_clones("avx512f", "avx2", "default")))
void hadamard_rows(float* x, int64_t rows, int64_t D) {
    for (int64_t r = 0; r < rows; r++) hadamard_one(x + r * D, D);
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void kv_quantize_rows(const float* x, int64_t n, int64_t D, int64_t bits, uint8_t* dst) {
    float buf[1024];
    const int64_t gb = bits == 8 ? 34 : 18;
    for (int64_t o = 0; o < n; o += D, dst += D / 32 * gb) {
        const float* src = x + o;
        if (kv_rotates(bits) && D <= 1024) {
            std::memcpy(buf, src, sizeof(float) * D);
            hadamard_one(buf, D);
            src = buf;
        }
        for (int64_t g = 0; g < D / 32; g++) {
            if (bits == 8) q8_group(src + 32 * g, dst + 34 * g);
            else q4_group(src + 32 * g, dst + 18 * g);
        }
    }
}

}  // namespace kvlm

namespace {

// x (..., n) contiguous float32 head rows, n % 32 == 0; out (..., n / 32 * (bits == 8 ? 34 : 18)) contiguous
// uint8; rows rotated first where the format rotates.
void kv_quantize(const at::Tensor& x, int64_t bits, const at::Tensor& out) {
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() >= 1,
                "kv_quantize: x must be a contiguous float32 CPU tensor");
    TORCH_CHECK(bits == 8 || bits == 4, "kv_quantize: bits must be 8 or 4");
    const int64_t n = x.size(-1), gb = bits == 8 ? 34 : 18, rows = x.numel() / std::max<int64_t>(n, 1);
    TORCH_CHECK(n % 32 == 0 && n <= 1024, "kv_quantize: the last dimension must be a multiple of 32, at most 1024");
    TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.numel() == rows * (n / 32) * gb,
                "kv_quantize: bad out tensor");
    const float* xp = x.const_data_ptr<float>();
    uint8_t* op = out.mutable_data_ptr<uint8_t>();
    at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {  // rows are independent: any split, same bits
        for (int64_t r = r0; r < r1; r++) {
            kvlm::kv_quantize_rows(xp + r * n, n, n, bits, op + r * (n / 32) * gb);
        }
    });
}

// out = x H along the last dimension (kv_quantize.h's hadamard_row): x, out contiguous float32, same shape.
void hadamard(const at::Tensor& x, const at::Tensor& out) {
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() >= 1 &&
                    out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == x.sizes(),
                "hadamard: x and out must be contiguous float32 CPU tensors of one shape");
    const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
    TORCH_CHECK(n > 0, "hadamard: empty rows");
    if (out.data_ptr() != x.data_ptr()) out.copy_(x);
    float* op = out.mutable_data_ptr<float>();
    at::parallel_for(0, rows, 256, [&](int64_t r0, int64_t r1) {
        kvlm::hadamard_rows(op + r0 * n, r1 - r0, n);
    });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvlm_kernels, m) {
    m.def("kv_quantize(Tensor x, int bits, Tensor(a!) out) -> ()", &kv_quantize);
    m.def("hadamard(Tensor x, Tensor(a!) out) -> ()", &hadamard);
}
