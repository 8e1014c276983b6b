// Element-wise kernels (elementwise.h) and their torch ops. Compiled without an ISA pragma: RMSNorm and
// RoPE are short scalar loops over one row; SiLU x up and GELU x up, the widest, are compiled for AVX-512, AVX2 and the
// baseline with GCC's target_clones and the loader picks the clone the CPU runs.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <vector>

#include "elementwise.h"

namespace kvlm {

// y[i] = x[i] / sqrt(mean(x^2) + eps) * w[i] over n floats (the sum of squares in increasing i).
void rmsnorm(const float* x, const float* w, float* y, int64_t n, float eps) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * r * w[i];
}

// HF rotate-half RoPE of one head in place: x * cos + roll(x, D/2) * sin_signed (sin_signed = [-sin, sin]).
void rope(float* x, const float* cos, const float* sin, int64_t D) {
    const int64_t h = D / 2;
    for (int64_t i = 0; i < h; i++) {
        const float a = x[i], b = x[i + h];
        x[i] = a * cos[i] + b * sin[i];
        x[i + h] = b * cos[i + h] + a * sin[i + h];
    }
}

// exp(x) on 16 lanes, Cephes-style: n = floor(x / ln 2 + 0.5), a degree-6 polynomial on the remainder,
// times 2^n (about 2 ulp); x is clamped to [-87.3, 88.3]. GCC vector extensions, so each target clone
// below compiles it to 1 zmm, 2 ymm or 4 xmm registers.
typedef float v16f __attribute__((vector_size(64)));
typedef float v16fu __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) v16f exp16(v16f x) {
    const v16f lo = (v16f){} - 87.33654f, hi = (v16f){} + 88.3f;
    x = x < lo ? lo : x;
    x = x > hi ? hi : x;
    const v16f fx = x * 1.44269504088896341f + 0.5f;
    v16f n = __builtin_convertvector(__builtin_convertvector(fx, v16i), v16f);
    n = n > fx ? n - 1.0f : n;
    const v16f r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    v16f y = (v16f){} + 1.9875691500E-4f;
    y = y * r + 1.3981999507E-3f;
    y = y * r + 8.3334519073E-3f;
    y = y * r + 4.1665795894E-2f;
    y = y * r + 1.6666665459E-1f;
    y = y * r + 5.0000001201E-1f;
    y = y * (r * r) + r + 1.0f;
    const v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
    v16f p;
    std::memcpy(&p, &bits, sizeof p);
    return y * p;
}

// The activations, as always_inline functions (a lambda would be an out-of-line call compiled for the
// baseline, taking 64-byte vectors from an AVX-512 clone through a different ABI).
// silu(g) = g / (1 + exp(-g)).
struct Silu {
    static inline __attribute__((always_inline)) v16f f(v16f x) { return x / (1.0f + exp16(-x)); }
};
// gelu(g) with the tanh approximation, 0.5 g (1 + tanh(v)) for v = sqrt(2 / pi) (g + 0.044715 g^3), written
// as g / (1 + exp(-2v)) (0.5 (1 + tanh v) is sigmoid(2v)), so it shares exp16 with silu.
struct GeluTanh {
    static inline __attribute__((always_inline)) v16f f(v16f x) {
        const float c = 1.5957691216057308f;  // 2 sqrt(2 / pi)
        return x / (1.0f + exp16(-c * (x + 0.044715f * x * x * x)));
    }
};

// Act::f(g) * u 16 lanes at a time, the tail through a zero-padded copy; inlined into each target clone.
template <class Act>
static inline __attribute__((always_inline)) void gated_mul(const float* g, const float* u, float* a, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const v16f gv = *(const v16fu*)(g + i), uv = *(const v16fu*)(u + i);
        *(v16fu*)(a + i) = Act::f(gv) * uv;
    }
    if (i < n) {
        v16f gv = {}, uv = {};
        std::memcpy(&gv, g + i, sizeof(float) * (n - i));
        std::memcpy(&uv, u + i, sizeof(float) * (n - i));
        const v16f av = Act::f(gv) * uv;
        std::memcpy(a + i, &av, sizeof(float) * (n - i));
    }
}

// Compiled for AVX-512, AVX2 and the baseline; the loader picks the clone this CPU runs (target_clones).
__attribute__((target_clones("avx512f", "avx2", "default")))
void silu_mul(const float* g, const float* u, float* a, int64_t n) { gated_mul<Silu>(g, u, a, n); }

__attribute__((target_clones("avx512f", "avx2", "default")))
void gelu_tanh_mul(const float* g, const float* u, float* a, int64_t n) { gated_mul<GeluTanh>(g, u, a, n); }

// exp(x - max) 16 lanes at a time (the tail through a padded copy), then the sum and the division in
// scalar order.
__attribute__((target_clones("avx512f", "avx2", "default")))
void softmax(const float* x, float* p, int64_t n) {
    if (n <= 0) return;
    float m = x[0];
    for (int64_t i = 1; i < n; i++) m = x[i] > m ? x[i] : m;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) *(v16fu*)(p + i) = exp16(*(const v16fu*)(x + i) - m);
    if (i < n) {
        v16f v = {};
        std::memcpy(&v, x + i, sizeof(float) * (n - i));
        const v16f e = exp16(v - m);
        std::memcpy(p + i, &e, sizeof(float) * (n - i));
    }
    float s = 0.0f;
    for (int64_t j = 0; j < n; j++) s += p[j];
    for (int64_t j = 0; j < n; j++) p[j] = p[j] / s;
}

// LoRA's B product as r axpys over B's transposed rows (B's rank is small, 8 to 64: a dot product per output
// value would spend more on its horizontal sum than on the products). fp-contract=off: no clone fuses the
// multiply and the add (GCC would in C++ mode), so every clone has the same bits as the PyTorch reference's
// separate multiply and add. B^T in float32 or bfloat16 (an adapter whose values bfloat16 holds exactly,
// kvlm/lora/adapter.py: widening is exact, so both give the same bits, and the bfloat16 copy is half the bytes).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
static inline __attribute__((always_inline)) float widen(float b) { return b; }
static inline __attribute__((always_inline)) float widen(uint16_t b) {
    return __builtin_bit_cast(float, static_cast<uint32_t>(b) << 16);
}

template <class B>
static inline __attribute__((always_inline)) void lora_b_add_t(const float* t, const B* bt, const int64_t* spans,
                                                               int64_t P, float* y, float* u, int64_t c0, int64_t c1) {
    for (int64_t p = 0; p < P; p++) {
        const int64_t r0 = spans[4 * p], r = spans[4 * p + 1], o0 = spans[4 * p + 2], n = spans[4 * p + 3];
        const B* b = bt;
        bt += r * n;
        const int64_t i0 = std::max(c0, o0) - o0, i1 = std::min(c1, o0 + n) - o0;  // this part's columns here
        if (r == 0 || i0 >= i1) continue;
        const int64_t w = i1 - i0;
        const float t0 = t[r0];
        const B* b0 = b + i0;
        for (int64_t i = 0; i < w; i++) u[i] = t0 * widen(b0[i]);
        int64_t j = 1;
        // four terms per pass over u (the same adds in the same order: u + t1 b1, then + t2 b2, ...): a quarter
        // of u's loads and stores, and four rows of B^T streaming at once
        for (; j + 4 <= r; j += 4) {
            const float ta = t[r0 + j], tb = t[r0 + j + 1], tc = t[r0 + j + 2], td = t[r0 + j + 3];
            const B* ba = b + j * n + i0;
            const B* bb = ba + n;
            const B* bc = bb + n;
            const B* bd = bc + n;
            for (int64_t i = 0; i < w; i++) {
                float v = u[i];
                v = v + ta * widen(ba[i]);
                v = v + tb * widen(bb[i]);
                v = v + tc * widen(bc[i]);
                v = v + td * widen(bd[i]);
                u[i] = v;
            }
        }
        for (; j < r; j++) {
            const float tj = t[r0 + j];
            const B* bj = b + j * n + i0;
            for (int64_t i = 0; i < w; i++) {
                const float v = tj * widen(bj[i]);
                u[i] = u[i] + v;
            }
        }
        float* yo = y + o0 + i0;
        for (int64_t i = 0; i < w; i++) yo[i] += u[i];
    }
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void lora_b_add(const float* t, const float* bt, const int64_t* spans, int64_t P, float* y, float* u, int64_t c0,
                int64_t c1) {
    lora_b_add_t(t, bt, spans, P, y, u, c0, c1);
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void lora_b_add_bf16(const float* t, const uint16_t* bt, const int64_t* spans, int64_t P, float* y, float* u,
                     int64_t c0, int64_t c1) {
    lora_b_add_t(t, bt, spans, P, y, u, c0, c1);
}
#pragma GCC pop_options

}  // namespace kvlm

namespace {

using kvlm::rmsnorm;
using kvlm::rope;
using kvlm::gelu_tanh_mul;
using kvlm::lora_b_add;
using kvlm::lora_b_add_bf16;
using kvlm::silu_mul;

// ---- The same functions as torch ops (torch.ops.kvlm_kernels.*), for kernels/elementwise.py -------

void check_f32_rows(const at::Tensor& t, int64_t n, const char* what) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(1) == n &&
                    t.stride(1) == 1, "kvlm ", what, ": expected float32 (rows, ", n, ") with contiguous rows");
}

// Rows per task of the row-wise ops below: at least ~32k floats, so a decode step's few rows stay on the
// calling thread, and a prefill's rows split over the threads (a row's bits do not depend on the split).
int64_t row_grain(int64_t n) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, n)); }

// out (T, n) = rmsnorm of each row of x (T, n) with weight w (n,).
void rms_norm_op(const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor& out) {
    const int64_t n = w.numel();
    check_f32_rows(x, n, "rms_norm x");
    check_f32_rows(out, n, "rms_norm out");
    TORCH_CHECK(out.size(0) == x.size(0), "kvlm rms_norm: out rows differ");
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous(), "kvlm rms_norm: weight must be contiguous float32");
    const float* wp = w.const_data_ptr<float>();
    at::parallel_for(0, x.size(0), row_grain(n), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++)
            rmsnorm(x.const_data_ptr<float>() + r * x.stride(0), wp, out.mutable_data_ptr<float>() + r * out.stride(0),
                    n, static_cast<float>(eps));
    });
}

// out (T, I) = f(gu[:, :I], gu[:, I:]) row by row for gu (T, 2I): f is silu_mul or gelu_tanh_mul.
void gated_op(const at::Tensor& gu, const at::Tensor& out, void (*f)(const float*, const float*, float*, int64_t),
              const char* name) {
    const int64_t I = out.size(1);
    check_f32_rows(gu, 2 * I, name);
    check_f32_rows(out, I, name);
    TORCH_CHECK(out.size(0) == gu.size(0), "kvlm ", name, ": out rows differ");
    at::parallel_for(0, gu.size(0), row_grain(I), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++) {
            const float* g = gu.const_data_ptr<float>() + r * gu.stride(0);
            f(g, g + I, out.mutable_data_ptr<float>() + r * out.stride(0), I);
        }
    });
}

void silu_mul_op(const at::Tensor& gu, const at::Tensor& out) { gated_op(gu, out, silu_mul, "silu_mul"); }

// Gemma's GeGLU.
void gelu_tanh_mul_op(const at::Tensor& gu, const at::Tensor& out) {
    gated_op(gu, out, gelu_tanh_mul, "gelu_tanh_mul");
}

// out (T, H, D) = RoPE of x (T, H, D) (any row stride, heads D apart) with cos, sin (T, D) per token.
void rope_op(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& out) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
                "kvlm rope: x must be float32 (T, H, D) with heads D apart");
    const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
    check_f32_rows(cos, D, "rope cos");
    check_f32_rows(sin, D, "rope sin");
    TORCH_CHECK(cos.size(0) == T && sin.size(0) == T && out.is_contiguous() && out.sizes() == x.sizes() &&
                    out.scalar_type() == at::kFloat, "kvlm rope: inconsistent shapes");
    at::parallel_for(0, T, row_grain(H * D), [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; t++) {
            float* o = out.mutable_data_ptr<float>() + t * H * D;
            std::memcpy(o, x.const_data_ptr<float>() + t * x.stride(0), sizeof(float) * H * D);
            for (int64_t h = 0; h < H; h++)
                rope(o + h * D, cos.const_data_ptr<float>() + t * cos.stride(0),
                     sin.const_data_ptr<float>() + t * sin.stride(0), D);
        }
    });
}

// y (T, N) += each row's LoRA B product (lora_b_add) of t (T, R); bt float32 (sum of r * n,), spans int64 (P, 4).
void lora_b_add_op(const at::Tensor& t, const at::Tensor& bt, const at::Tensor& spans, const at::Tensor& y) {
    TORCH_CHECK(spans.device().is_cpu() && spans.scalar_type() == at::kLong && spans.dim() == 2 && spans.size(1) == 4 &&
                    spans.is_contiguous(), "kvlm lora_b_add: spans must be contiguous int64 (P, 4)");
    const bool bf16 = bt.scalar_type() == at::kBFloat16;
    TORCH_CHECK(bt.device().is_cpu() && (bt.scalar_type() == at::kFloat || bf16) && bt.is_contiguous(),
                "kvlm lora_b_add: bt must be contiguous float32 or bfloat16");
    const int64_t P = spans.size(0), R = t.size(1), N = y.size(1);
    const int64_t* sp = spans.const_data_ptr<int64_t>();
    int64_t total = 0, widest = 0;
    for (int64_t p = 0; p < P; p++) {
        const int64_t r0 = sp[4 * p], r = sp[4 * p + 1], o0 = sp[4 * p + 2], n = sp[4 * p + 3];
        TORCH_CHECK(r0 >= 0 && r >= 0 && r0 + r <= R && o0 >= 0 && n >= 0 && o0 + n <= N,
                    "kvlm lora_b_add: span outside t or y");
        total += r * n;
        widest = std::max(widest, n);
    }
    TORCH_CHECK(bt.numel() == total, "kvlm lora_b_add: bt holds ", bt.numel(), " floats, the spans need ", total);
    check_f32_rows(t, R, "lora_b_add t");
    check_f32_rows(y, N, "lora_b_add y");
    TORCH_CHECK(y.size(0) == t.size(0), "kvlm lora_b_add: t and y rows differ");
    at::parallel_for(0, y.size(0), std::max<int64_t>(1, 65536 / std::max<int64_t>(1, R * N)), [&](int64_t a, int64_t b) {
        std::vector<float> u(widest);
        for (int64_t row = a; row < b; row++) {
            const float* tr = t.const_data_ptr<float>() + row * t.stride(0);
            float* yr = y.mutable_data_ptr<float>() + row * y.stride(0);
            if (bf16)
                lora_b_add_bf16(tr, static_cast<const uint16_t*>(bt.const_data_ptr()), sp, P, yr, u.data(), 0, N);
            else
                lora_b_add(tr, bt.const_data_ptr<float>(), sp, P, yr, u.data(), 0, N);
        }
    });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvlm_kernels, m) {
    m.def("lora_b_add(Tensor t, Tensor bt, Tensor spans, Tensor(a!) y) -> ()", &lora_b_add_op);
    m.def("rms_norm(Tensor x, Tensor w, float eps, Tensor(a!) out) -> ()", &rms_norm_op);
    m.def("silu_mul(Tensor gu, Tensor(a!) out) -> ()", &silu_mul_op);
    m.def("gelu_tanh_mul(Tensor gu, Tensor(a!) out) -> ()", &gelu_tanh_mul_op);
    m.def("rope(Tensor x, Tensor cos, Tensor sin, Tensor(a!) out) -> ()", &rope_op);
}
