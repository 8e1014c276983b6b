// Torch bindings (torch.ops.kvlm_kernels.*): argument checks, the thread split (at::parallel_for over
// output rows or attention work items), and the choice of ISA table. The kernels themselves are in
// kernels_impl.h, compiled once per ISA. Only light torch headers here, to keep the one-time build short.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "drivers.h"

namespace kvlm {

int64_t best_isa() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        return __builtin_cpu_supports("avx512vnni") ? ISA_AVX512_VNNI : ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
        __builtin_cpu_supports("bmi2"))
        return ISA_AVX2;
#endif
    return ISA_SCALAR;
}

const KvlmKernels* table(int64_t isa) {
    TORCH_CHECK(isa >= ISA_SCALAR && isa <= best_isa(), "kvlm kernels: ISA ", isa, " is not available on this CPU");
    if (isa == ISA_AVX512_VNNI) return kvlm_kernels_avx512_vnni();
    if (isa == ISA_AVX512) return kvlm_kernels_avx512();
    if (isa == ISA_AVX2) return kvlm_kernels_avx2();
    return kvlm_kernels_scalar();
}

bool has_int8(const KvlmKernels* t, int qtype) {
    return t->gemv_i8 != nullptr && (qtype == T_Q4_0 || qtype == T_Q4_1 || qtype == T_Q8_0);
}

namespace {

// x (M, K) quantized per 32-element block (quantize_act, rows in parallel) into this thread's buffers:
// q (M, K) int8, d (M, K/32, 8) expanded scales, s (M, K/32) block sums d * sum(q), i (M, K/32) sum(q).
// The buffers grow to the largest call and stay, so steady-state calls allocate nothing; they are valid
// until the next call.
struct ActQ {
    const int8_t* q;
    const float* d;
    const float* s;
    const int32_t* i;
};

ActQ quantize_x(const KvlmKernels* t, const float* x, int64_t M, int64_t K) {
    thread_local std::vector<int8_t> xq;
    thread_local std::vector<float> xd, xs;
    thread_local std::vector<int32_t> xi;
    const int64_t nb = K / 32;
    if ((int64_t)xq.size() < M * K) xq.resize(M * K);
    if ((int64_t)xs.size() < M * nb) xd.resize(8 * M * nb), xs.resize(M * nb), xi.resize(M * nb);
    int8_t* q = xq.data();
    float *d = xd.data(), *s = xs.data();
    int32_t* i = xi.data();
    at::parallel_for(0, M, std::max<int64_t>(1, 65536 / K), [&](int64_t m0, int64_t m1) {
        t->quantize_act(x + m0 * K, m1 - m0, K, q + m0 * K, d + 8 * m0 * nb, s + m0 * nb, i + m0 * nb);
    });
    return {q, d, s, i};
}

}  // namespace

bool matmul(const KvlmKernels* t, int qtype, const uint8_t* w, int64_t rs, int64_t K, int64_t N, const float* x,
            int64_t M, float* y, int64_t ldy, int act) {
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, K * M));  // rows per task
    std::atomic<bool> ok{true};
    if (act == ACT_INT8 && has_int8(t, qtype) && K % 32 == 0) {
        // x quantized once, then shared read-only by every thread.
        // Threads take whole panels of 16 columns (the AVX-512 kernel's unit; see kernels_int8_panel.h).
        const ActQ a = quantize_x(t, x, M, K);
        at::parallel_for(0, (N + 15) / 16, std::max<int64_t>(1, grain / 16), [&](int64_t p0, int64_t p1) {
            if (t->gemv_i8(qtype, w, rs, K, a.q, a.d, a.s, a.i, M, y, ldy, 16 * p0, std::min(N, 16 * p1))) ok = false;
        });
        return ok;
    }
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
        if (t->gemv(qtype, w, rs, K, x, M, y, ldy, n0, n1)) ok = false;
    });
    return ok;
}

// Work items of ATTN_CHUNK tokens per sequence (a constant: chunk boundaries, hence every sum's order,
// depend on the sequence's length only), all in one parallel loop; see KvlmPagedAttn for the combine.
// The item list and partial states live in this thread's buffers, which only grow.
constexpr int64_t ATTN_CHUNK = 128;

bool paged_attention(const KvlmKernels* t, int kv_dtype, const float* q, const void* k_cache, const void* v_cache,
                     const int32_t* block_tables, const int32_t* seq_lens, float* out, int64_t B, int64_t H,
                     int64_t KVH, int64_t D, int64_t BS, int64_t MB, float scale) {
    if (kv_dtype != T_F32 && kv_dtype != T_F16 && kv_dtype != T_BF16) return false;
    thread_local std::vector<int32_t> items, first, pending;
    thread_local std::vector<float> part;
    items.clear();
    first.resize(B);
    pending.resize(B);
    for (int64_t b = 0; b < B; b++) {
        const int64_t nc = std::max<int64_t>(1, (seq_lens[b] + ATTN_CHUNK - 1) / ATTN_CHUNK);  // L = 0: one, empty
        first[b] = static_cast<int32_t>(items.size() / 2);
        pending[b] = static_cast<int32_t>(nc);
        for (int64_t c = 0; c < nc; c++) items.push_back(static_cast<int32_t>(b)), items.push_back(static_cast<int32_t>(c));
    }
    const int64_t n = static_cast<int64_t>(items.size() / 2);
    if (part.size() < static_cast<size_t>(n * H * (D + 2))) part.resize(n * H * (D + 2));
    const KvlmPagedAttn a{kv_dtype, q, k_cache, v_cache, block_tables, seq_lens, out, H, KVH, D, BS, MB, ATTN_CHUNK,
                          scale, items.data(), first.data(), part.data(), pending.data()};
    std::atomic<bool> ok{true};
    at::parallel_for(0, n, 1, [&](int64_t i0, int64_t i1) {
        thread_local std::vector<float> scores;  // (H, ATTN_CHUNK) scores, 2 H floats, (H, 16, 16) dot products
        if (scores.size() < static_cast<size_t>(H * (ATTN_CHUNK + 2 + 256))) scores.resize(H * (ATTN_CHUNK + 2 + 256));
        if (t->paged_attn(&a, scores.data(), i0, i1)) ok = false;
    });
    return ok;
}

}  // namespace kvlm

namespace {

using kvlm::table;

void check_weight(const at::Tensor& w) {
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.stride(1) == 1,
                "weight data must be a CPU uint8 (N, row_bytes) tensor with contiguous rows");
}

void check_matmul(const at::Tensor& x, const at::Tensor& w, int64_t K, const at::Tensor& out) {
    check_weight(w);
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() &&
                    x.size(1) == K, "x must be a contiguous float32 (M, K) CPU tensor");
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == x.size(0) &&
                    out.size(1) == w.size(0), "out must be a contiguous float32 (M, N) tensor");
}

// out (M, N) = x (M, K) @ W.T, W given by its GGUF blocks (N, row_bytes); float32 activations.
void qmatmul(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t K, int64_t isa, const at::Tensor& out) {
    check_matmul(x, w, K, out);
    const bool ok = kvlm::matmul(table(isa), static_cast<int>(qtype), w.const_data_ptr<uint8_t>(), w.stride(0), K,
                                 w.size(0), x.const_data_ptr<float>(), x.size(0), out.mutable_data_ptr<float>(),
                                 w.size(0), kvlm::ACT_F32);
    TORCH_CHECK(ok, "kvlm kernels: no kernel for ggml type ", qtype);
}

// As qmatmul, with x quantized to int8 per 32-element block first (Q4_0, Q4_1, Q8_0 on AVX2 / AVX-512).
void qmatmul_i8(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t K, int64_t isa, const at::Tensor& out) {
    check_matmul(x, w, K, out);
    const KvlmKernels* t = table(isa);
    TORCH_CHECK(K % 32 == 0 && kvlm::has_int8(t, static_cast<int>(qtype)),
                "kvlm kernels: no int8-activation kernel for ggml type ", qtype, " on this ISA path");
    const bool ok = kvlm::matmul(t, static_cast<int>(qtype), w.const_data_ptr<uint8_t>(), w.stride(0), K, w.size(0),
                                 x.const_data_ptr<float>(), x.size(0), out.mutable_data_ptr<float>(), w.size(0),
                                 kvlm::ACT_INT8);
    TORCH_CHECK(ok, "kvlm kernels: no int8-activation kernel for ggml type ", qtype);
}

// out (M, K) = x fake-quantized as the int8 kernels see it: q * d per 32-element block (K % 32 == 0).
// For many rows, "fake-quantize x, dequantize a weight tile, BLAS" gives the int8 kernels' numerics
// up to the float32 summation order.
void fake_quantize_act(const at::Tensor& x, int64_t isa, const at::Tensor& out) {
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() &&
                    x.size(1) % 32 == 0, "x must be a contiguous float32 (M, K) CPU tensor, K a multiple of 32");
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == x.sizes(), "bad out tensor");
    const KvlmKernels* t = table(isa);
    TORCH_CHECK(t->quantize_act != nullptr, "kvlm kernels: no int8 activations on this ISA path");
    const int64_t M = x.size(0), K = x.size(1);
    const kvlm::ActQ a = kvlm::quantize_x(t, x.const_data_ptr<float>(), M, K);
    float* o = out.mutable_data_ptr<float>();
    at::parallel_for(0, M * K / 32, 256, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; b++)
            for (int j = 0; j < 32; j++) o[b * 32 + j] = (float)a.q[b * 32 + j] * a.d[b * 8];
    });
}

// out (N, K) = the dequantized weight rows.
void dequantize(const at::Tensor& w, int64_t qtype, int64_t K, int64_t isa, const at::Tensor& out) {
    check_weight(w);
    const int64_t N = w.size(0);
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 && out.size(0) == N &&
                    out.size(1) == K, "out must be a float32 (N, K) tensor with contiguous rows");
    const KvlmKernels* t = table(isa);
    const uint8_t* wp = w.const_data_ptr<uint8_t>();
    float* op = out.mutable_data_ptr<float>();
    const int64_t rs = w.stride(0), ldo = out.stride(0);
    int rc = 0;
    at::parallel_for(0, N, std::max<int64_t>(1, 16384 / K), [&](int64_t n0, int64_t n1) {
        if (t->dequant(static_cast<int>(qtype), wp, rs, K, op + n0 * ldo, ldo, n0, n1)) rc = -1;
    });
    TORCH_CHECK(rc == 0, "kvlm kernels: no kernel for ggml type ", qtype);
}

void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t isa,
                            const at::Tensor& out) {
    TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(), "q must be contiguous float32 (B, H, D)");
    const auto kv_type = k_cache.scalar_type();
    TORCH_CHECK((kv_type == at::kFloat || kv_type == at::kHalf || kv_type == at::kBFloat16) && k_cache.dim() == 4 &&
                    k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                    v_cache.scalar_type() == kv_type && v_cache.is_contiguous(),
                "k/v caches must be contiguous float32, float16 or bfloat16 (num_blocks, block_size, kv_heads, D)");
    const int kv_dtype = kv_type == at::kFloat ? 0 : (kv_type == at::kHalf ? 1 : 30);  // ggml type ids
    TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous() &&
                    seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.is_contiguous(),
                "block_tables (B, max_blocks) and seq_lens (B,) must be contiguous int32");
    const int64_t B = q.size(0), H = q.size(1), D = q.size(2), BS = k_cache.size(1), KVH = k_cache.size(2);
    TORCH_CHECK(k_cache.size(3) == D && D % 16 == 0 && H % KVH == 0 && block_tables.size(0) == B &&
                    seq_lens.size(0) == B, "paged attention: inconsistent shapes");
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == q.sizes(), "bad out tensor");
    const KvlmKernels* t = table(isa);
    const float* qp = q.const_data_ptr<float>();
    const void* kp = k_cache.const_data_ptr();
    const void* vp = v_cache.const_data_ptr();
    const int32_t* bt = block_tables.const_data_ptr<int32_t>();
    const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
    float* op = out.mutable_data_ptr<float>();
    const int64_t MB = block_tables.size(1), num_blocks = k_cache.size(0);
    for (int64_t b = 0; b < B; b++) {  // the kernel trusts the tables: check them once here (B * blocks ints)
        TORCH_CHECK(lens[b] >= 0 && lens[b] <= MB * BS, "seq_lens[", b, "] = ", lens[b], " exceeds its block table");
        for (int64_t j = 0; j * BS < lens[b]; j++)
            TORCH_CHECK(bt[b * MB + j] >= 0 && bt[b * MB + j] < num_blocks, "block_tables[", b, ", ", j,
                        "] = ", bt[b * MB + j], " is outside the cache");
    }
    const bool ok = kvlm::paged_attention(t, kv_dtype, qp, kp, vp, bt, lens, op, B, H, KVH, D, BS, MB,
                                          static_cast<float>(scale));
    TORCH_CHECK(ok, "kvlm kernels: unsupported KV cache dtype");
}

}  // namespace

TORCH_LIBRARY(kvlm_kernels, m) {
    m.def("best_isa() -> int", &kvlm::best_isa);
    m.def("qmatmul(Tensor x, Tensor w, int qtype, int K, int isa, Tensor(a!) out) -> ()", &qmatmul);
    m.def("qmatmul_i8(Tensor x, Tensor w, int qtype, int K, int isa, Tensor(a!) out) -> ()", &qmatmul_i8);
    m.def("fake_quantize_act(Tensor x, int isa, Tensor(a!) out) -> ()", &fake_quantize_act);
    m.def("dequantize(Tensor w, int qtype, int K, int isa, Tensor(a!) out) -> ()", &dequantize);
    m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
          "float scale, int isa, Tensor(a!) out) -> ()", &paged_decode_attention);
}
