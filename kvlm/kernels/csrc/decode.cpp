// The fused decode step: every layer of a Llama-family model for B sequences, one new token each, in
// one native call (torch.ops.kvlm_kernels.decode_step). Python builds a plan once (decode_plan_create:
// pointers to the weights, stored in the GGUF block formats, plus the shapes) and calls the step with
// the step's token embeddings, positions, cache slots and block tables. Per layer:
//
//   h = rmsnorm(x) -> qkv = h @ Wqkv.T (+ bias) -> [q/k rmsnorm] -> RoPE(q, k) -> write k, v to the
//   paged cache -> attn = paged attention(q) -> x += attn @ Wo.T -> h = rmsnorm(x)
//   -> gu = h @ Wgate_up.T -> a = silu(gate) * up -> x += a @ Wdown.T
//
// A mixture-of-experts layer runs kvlm::moe_mlp (moe.cpp: router, top-k, grouped experts, weighted sum) in
// place of the last line's matmuls, the function the module path's torch op runs too; OLMoE's q/k norms
// over the whole projection (all heads at once) are one rmsnorm each over q and over k.
//
// then the final rmsnorm. Rows whose request runs under a LoRA adapter (a plan of its own,
// decode_lora_create) get, after each projection's base output, y += B (A h): A on the F32 row kernel, B by
// lora_b_add (elementwise.h), as the module path's LoRARows.apply adds it (kvlm/lora/rows.py).
// The matrix products and attention are the same drivers the torch bindings
// use (drivers.h: kvlm::matmul, kvlm::paged_attention); the element-wise work is elementwise.h's
// functions, the ones the module path calls too (torch.ops.kvlm_kernels.rms_norm / rope / silu_mul). What this saves is the Python and dispatch around ~15 small tensor ops
// per layer and their allocations: all intermediates live in one scratch buffer reused every step.
//
// Exactness: every operation works row by row in a fixed order, so a sequence's result does not depend
// on B or on its neighbours (alone == in a batch, bit for bit). Against the module path (kvlm/model/,
// which prefill runs) it is bit for bit too: the same row kernels, element-wise functions and paged
// attention in the same order, so the same hidden states and K/V bits on float32, float16 and bfloat16
// caches (tests/model/test_fused_decode.py) and on int8 / int4 ones (tests/engine/test_exact_kv_quant.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <omp.h>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "drivers.h"
#include "elementwise.h"
#include "kv_quantize.h"

namespace {

// One token's K or V (n floats) into a cache slot of element type T, rounded to nearest even as
// torch's .to(T) rounds (so the module path's index_copy_ of the same values stores the same bits).
template <typename T>
void store_kv(void* cache, int64_t off, const float* src, int64_t n, int64_t) {
    T* dst = static_cast<T*>(cache) + off;
    if constexpr (std::is_same_v<T, float>) {
        std::memcpy(dst, src, sizeof(float) * n);
    } else {
        for (int64_t i = 0; i < n; i++) dst[i] = T(src[i]);
    }
}

// The int8 / int4 cache: `off` in bytes, n floats (kv heads x D) quantized group by group (kv_quantize.h).
// Rows of D values (heads); those formats rotate each row first (kv_quantize.h), so the step also rotates
// q before attention and the attention output back (decode_step).
void store_kv_q8(void* cache, int64_t off, const float* src, int64_t n, int64_t D) {
    kvlm::kv_quantize_rows(src, n, D, 8, static_cast<uint8_t*>(cache) + off);
}
void store_kv_q4(void* cache, int64_t off, const float* src, int64_t n, int64_t D) {
    kvlm::kv_quantize_rows(src, n, D, 4, static_cast<uint8_t*>(cache) + off);
}

using kvlm::rmsnorm;
using kvlm::rope;
using kvlm::silu_mul;

struct Part {  // rows [n0, n0 + n) of a stacked projection, in one block format
    const uint8_t* w;
    int64_t rs;
    int qtype;
    int64_t n;
};

struct Linear {
    std::vector<Part> parts;
    const float* bias = nullptr;
    int64_t n = 0, k = 0;
};

struct Layer {
    const float *in_norm = nullptr, *post_norm = nullptr, *q_norm = nullptr, *k_norm = nullptr;
    Linear qkv, o, gate_up, down;
    bool rope = true;      // false: a layer without position encoding (SmolLM3's NoPE layers)
    bool qk_full = false;  // q/k norms over the whole q (nh * D) and k (kvh * D), not per head (OLMoE)
    bool moe = false;      // a routed MLP (moe_l) in place of gate_up / down
    kvlm::MoeLayer moe_l{};
};

struct Plan {
    std::vector<at::Tensor> keep;  // the tensors the pointers below point into
    std::vector<Layer> layers;
    const float *final_norm = nullptr, *cos = nullptr, *sin = nullptr;  // cos/sin (max_pos, RD); sin signed
    int64_t hidden = 0, nh = 0, kvh = 0, D = 0, inter = 0, max_pos = 0;
    int64_t rd = 0;  // RoPE rotates the first rd values of each head (D, or fewer: a partial rotary factor)
    float eps = 0.0f;
    // the module path's own numbers: its attention scale (a Python float, rounded to float32 as the
    // attention op rounds it; 1/sqrtf(D) would differ in the last bit for D = 96 or 112) and the residual
    // branches' multiplier (Granite's; 1 elsewhere)
    float attn_scale = 0.0f, resid = 1.0f;
    int act = kvlm::ACT_F32;
    std::vector<float> scratch;  // per-step intermediates, grown to the largest B seen
};

std::mutex plans_mu;
std::unordered_map<int64_t, std::unique_ptr<Plan>> plans;
int64_t next_plan = 1;

Plan& get_plan(int64_t id) {
    std::lock_guard<std::mutex> g(plans_mu);
    auto it = plans.find(id);
    TORCH_CHECK(it != plans.end(), "kvlm decode: no plan ", id);
    return *it->second;
}

const float* f32_ptr(const at::Tensor& t, int64_t numel, const char* what) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == numel,
                "kvlm decode: ", what, " must be a contiguous float32 CPU tensor of ", numel, " elements");
    return t.const_data_ptr<float>();
}

// tensors/spec layout: see kvlm/fused_decode.py (`_plan_args`), which builds both.
int64_t decode_plan_create(at::TensorList tensors, at::IntArrayRef spec, double eps) {
    auto p = std::make_unique<Plan>();
    size_t ti = 0, si = 0;
    auto next_t = [&]() -> const at::Tensor& {
        TORCH_CHECK(ti < tensors.size(), "kvlm decode: plan lacks tensors");
        p->keep.push_back(tensors[ti]);
        return tensors[ti++];
    };
    auto next_i = [&]() -> int64_t {
        TORCH_CHECK(si < spec.size(), "kvlm decode: plan spec too short");
        return spec[si++];
    };
    const int64_t L = next_i();
    p->hidden = next_i(), p->nh = next_i(), p->kvh = next_i(), p->D = next_i(), p->inter = next_i();
    p->max_pos = next_i();
    p->act = static_cast<int>(next_i());
    p->rd = next_i();
    p->eps = static_cast<float>(eps);
    const int64_t H = p->hidden, D = p->D;
    auto linear = [&](Linear& lin, int64_t n, int64_t k) {
        const int64_t nparts = next_i();
        lin.n = n, lin.k = k;
        int64_t rows = 0;
        for (int64_t i = 0; i < nparts; i++) {
            const int qtype = static_cast<int>(next_i());
            const int64_t pn = next_i();
            const at::Tensor& w = next_t();
            TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.size(0) == pn &&
                            w.stride(1) == 1, "kvlm decode: weight part must be uint8 (n, row_bytes) rows");
            lin.parts.push_back({w.const_data_ptr<uint8_t>(), w.stride(0), qtype, pn});
            rows += pn;
        }
        TORCH_CHECK(rows == n, "kvlm decode: parts give ", rows, " rows, expected ", n);
    };
    for (int64_t l = 0; l < L; l++) {
        Layer ly;
        // 1: q/k/v bias, 2: q/k norms, 4: no RoPE, 8: the q/k norms span all heads, 16: routed experts
        const int64_t flags = next_i();
        ly.rope = !(flags & 4);
        ly.qk_full = flags & 8;
        ly.in_norm = f32_ptr(next_t(), H, "input norm");
        ly.post_norm = f32_ptr(next_t(), H, "post-attention norm");
        if (flags & 2) {
            ly.q_norm = f32_ptr(next_t(), ly.qk_full ? p->nh * D : D, "q norm");
            ly.k_norm = f32_ptr(next_t(), ly.qk_full ? p->kvh * D : D, "k norm");
        }
        const int64_t nqkv = (p->nh + 2 * p->kvh) * D;
        linear(ly.qkv, nqkv, H);
        if (flags & 1) ly.qkv.bias = f32_ptr(next_t(), nqkv, "qkv bias");
        linear(ly.o, H, p->nh * D);
        if (flags & 16) {  // spec: router type, E, k, renorm, I, gate/up/down types; router, stacks, stats
            ly.moe = true;
            kvlm::MoeLayer& m = ly.moe_l;
            m.router_qtype = static_cast<int>(next_i());
            m.E = next_i(), m.k = next_i(), m.renorm = next_i() != 0, m.I = next_i(), m.H = H;
            const at::Tensor& router = next_t();
            TORCH_CHECK(router.device().is_cpu() && router.scalar_type() == at::kByte && router.dim() == 2 &&
                            router.size(0) == m.E && router.stride(1) == 1 && m.k >= 1 && m.k <= m.E,
                        "kvlm decode: router must be uint8 (E, row_bytes) rows, 1 <= k <= E");
            m.router = router.const_data_ptr<uint8_t>(), m.router_rs = router.stride(0);
            for (kvlm::MoeWeight* mw : {&m.gate, &m.up, &m.down}) {
                const int qtype = static_cast<int>(next_i());
                const at::Tensor& w = next_t();
                const int64_t n = mw == &m.down ? H : m.I;
                TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 3 && w.size(0) == m.E &&
                                w.size(1) == n && w.stride(2) == 1, "kvlm decode: expert stacks must be uint8 (E, n, row_bytes)");
                *mw = {qtype, w.const_data_ptr<uint8_t>(), w.stride(0), w.stride(1)};
            }
            const at::Tensor& stats = next_t();
            TORCH_CHECK(stats.scalar_type() == at::kLong && stats.is_contiguous() && stats.numel() == m.E + 2,
                        "kvlm decode: expert stats must be contiguous int64 (E + 2,)");
            m.stats = stats.mutable_data_ptr<int64_t>();
        } else {
            linear(ly.gate_up, 2 * p->inter, H);
            linear(ly.down, H, p->inter);
        }
        p->layers.push_back(std::move(ly));
    }
    p->final_norm = f32_ptr(next_t(), H, "final norm");
    TORCH_CHECK(p->rd > 0 && p->rd <= D && p->rd % 2 == 0, "kvlm decode: bad rotary dimensions ", p->rd);
    p->cos = f32_ptr(next_t(), p->max_pos * p->rd, "rope cos");
    p->sin = f32_ptr(next_t(), p->max_pos * p->rd, "rope sin");
    const float* scalars = f32_ptr(next_t(), 2, "attention scale and residual multiplier");
    p->attn_scale = scalars[0], p->resid = scalars[1];
    TORCH_CHECK(ti == tensors.size() && si == spec.size(), "kvlm decode: plan has unused entries");
    std::lock_guard<std::mutex> g(plans_mu);
    plans[next_plan] = std::move(p);
    return next_plan++;
}

void decode_plan_free(int64_t id) {
    std::lock_guard<std::mutex> g(plans_mu);
    plans.erase(id);
}

// A LoRA adapter for the fused step: per layer and projection (qkv, o, gate_up, down), A (r, k) float32 or
// bfloat16 rows, and per targeted part its scaled B transposed (packed, with spans {r0, r, o0, n};
// kvlm/lora/adapter.py), float32 or bfloat16 (where bfloat16 holds the values exactly), or none (a == nullptr).
struct LoraMat {
    const void *a = nullptr, *bt = nullptr;
    const int64_t* spans = nullptr;
    int64_t r = 0, k = 0, parts = 0, widest = 0;
    int a_type = T_F32;  // the row kernel's format of A: T_F32 or T_BF16 (same bits on the same values)
    bool bt16 = false;   // B^T in bfloat16 (lora_b_add_bf16)
};
enum { L_QKV = 0, L_O, L_GATE_UP, L_DOWN, L_MODULES };
struct Lora {
    std::vector<at::Tensor> keep;
    std::vector<std::array<LoraMat, L_MODULES>> layers;
};
std::unordered_map<int64_t, std::unique_ptr<Lora>> loras;
int64_t next_lora = 1;

// tensors: per layer, per projection in L_* order, A, packed B transposed and spans (all empty: not adapted there).
int64_t decode_lora_create(at::TensorList tensors, int64_t layers) {
    TORCH_CHECK(static_cast<int64_t>(tensors.size()) == layers * L_MODULES * 3, "kvlm decode: LoRA plan needs ",
                layers * L_MODULES * 3, " tensors");
    auto lo = std::make_unique<Lora>();
    lo->layers.resize(layers);
    for (int64_t l = 0; l < layers; l++)
        for (int m = 0; m < L_MODULES; m++) {
            const at::Tensor& a = tensors[(l * L_MODULES + m) * 3];
            const at::Tensor& bt = tensors[(l * L_MODULES + m) * 3 + 1];
            const at::Tensor& sp = tensors[(l * L_MODULES + m) * 3 + 2];
            if (!a.numel()) continue;
            auto f32_or_bf16 = [](const at::Tensor& x) {
                return x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16;
            };
            TORCH_CHECK(a.device().is_cpu() && bt.device().is_cpu() && sp.device().is_cpu() && f32_or_bf16(a) &&
                            f32_or_bf16(bt) && sp.scalar_type() == at::kLong && a.dim() == 2 && sp.dim() == 2 &&
                            sp.size(1) == 4 && a.is_contiguous() && bt.is_contiguous() && sp.is_contiguous(),
                        "kvlm decode: LoRA A (r, k), B^T (float32 or bfloat16) and spans (P, 4, int64) must be "
                        "contiguous");
            const int64_t* s = sp.const_data_ptr<int64_t>();
            int64_t total = 0, widest = 0;
            for (int64_t p = 0; p < sp.size(0); p++) {
                TORCH_CHECK(s[4 * p] >= 0 && s[4 * p + 1] >= 0 && s[4 * p] + s[4 * p + 1] <= a.size(0),
                            "kvlm decode: LoRA span outside A's rank");
                total += s[4 * p + 1] * s[4 * p + 3];
                widest = std::max(widest, s[4 * p + 3]);
            }
            TORCH_CHECK(bt.numel() == total, "kvlm decode: LoRA B^T does not match its spans");
            lo->keep.insert(lo->keep.end(), {a, bt, sp});
            lo->layers[l][m] = {a.const_data_ptr(), bt.const_data_ptr(), s, a.size(0), a.size(1), sp.size(0), widest,
                                a.scalar_type() == at::kBFloat16 ? T_BF16 : T_F32,
                                bt.scalar_type() == at::kBFloat16};
        }
    std::lock_guard<std::mutex> g(plans_mu);
    loras[next_lora] = std::move(lo);
    return next_lora++;
}

void decode_lora_free(int64_t id) {
    std::lock_guard<std::mutex> g(plans_mu);
    loras.erase(id);
}

// y (B, n) = x @ W.T (+ bias) for projection m of layer l (run_linear's products), then += B_b (A_b x_b) for
// each row b whose adapter (rows[b], null: none) adapts it: x (B, k). A's product is the row kernel's (t->gemv,
// what kvlm::matmul runs for T_F32 / T_BF16: its rows' bits do not depend on M or on which rows share a call),
// B's is lora_b_add (elementwise.h, lane by lane): the module path's kernels (kvlm/lora/rows.py), so the same
// bits. The whole projection is one parallel region, the adapter adding no fork of its own: the threads split
// every adapted row's A rows and say so (a counter), then each computes the base output of its 16-column
// panels (the kernel kvlm::matmul calls on the same panels, x quantized once before the region as matmul
// quantizes it) and its bias, and only then waits for every thread's A rows (B needs all of A's product; by
// then they are long done, so the wait is a check, where a barrier right after A would hold each thread for
// the slowest) before B's add on its own columns: a value's add follows its base product on the same thread.
// No split changes a bit. Returns false when no row adapts this projection (the caller runs run_linear).
bool linear_lora(const KvlmKernels* t, const Linear& lin, const std::vector<const Lora*>& rows, int64_t l, int m,
                 const float* x, int64_t B, float* y, int act, std::vector<float>& tmp) {
    struct Job {
        int64_t b, t0;  // the row, and where its A product starts in tmp
        const LoraMat* w;
    };
    thread_local std::vector<Job> this_threads_jobs;  // reused: no allocation per call
    std::vector<Job>& jobs = this_threads_jobs;  // a reference, so the lambdas on other threads read this one
    jobs.clear();
    int64_t R = 0;
    for (size_t b = 0; b < rows.size(); b++)
        if (rows[b] && rows[b]->layers[l][m].a) {
            jobs.push_back({static_cast<int64_t>(b), R, &rows[b]->layers[l][m]});
            R += rows[b]->layers[l][m].r;
        }
    if (jobs.empty()) return false;
    if (tmp.size() < static_cast<size_t>(R)) tmp.resize(R);
    float* tr = tmp.data();
    const int64_t n = lin.n, K = lin.k;
    // matmul's choice per part: int8 activations where the table has them for the type
    bool any8 = false;
    for (const Part& p : lin.parts) any8 |= act == kvlm::ACT_INT8 && kvlm::has_int8(t, p.qtype) && K % 32 == 0;
    const kvlm::ActQ q8 = any8 ? kvlm::quantize_x(t, x, B, K) : kvlm::ActQ{};
    const int64_t panels = (n + 15) / 16;
    std::atomic<bool> ok{true};
    // thread `id` of `nth`: its share of the A rows (all jobs' rows in one range)
    auto a_part = [&](int64_t id, int64_t nth) {
        const int64_t i0 = R * id / nth, i1 = R * (id + 1) / nth;
        for (const Job& j : jobs) {
            const int64_t r0 = std::max(i0, j.t0) - j.t0, r1 = std::min(i1, j.t0 + j.w->r) - j.t0;
            const int64_t row_bytes = j.w->k * (j.w->a_type == T_BF16 ? 2 : 4);
            if (r0 < r1 && t->gemv(j.w->a_type, static_cast<const uint8_t*>(j.w->a), row_bytes, j.w->k,
                                   x + j.b * j.w->k, 1, tr + j.t0, j.w->r, r0, r1))
                ok = false;
        }
    };
    // then its panels' columns [c0, c1): the base product of every row and the bias; after `a_done` reaches
    // nth (every thread's A rows written), each adapted row's B
    std::atomic<int> a_done{0};
    auto out_part = [&](int64_t id, int64_t nth) {
        const int64_t c0 = 16 * (panels * id / nth), c1 = std::min(n, 16 * (panels * (id + 1) / nth));
        if (c0 >= c1) return;
        int64_t off = 0;
        for (const Part& p : lin.parts) {
            const int64_t lo = std::max(c0, off) - off, hi = std::min(c1, off + p.n) - off;
            if (lo < hi) {
                const bool i8 = act == kvlm::ACT_INT8 && kvlm::has_int8(t, p.qtype) && K % 32 == 0;
                const int bad = i8 ? t->gemv_i8(p.qtype, p.w, p.rs, K, q8.q, q8.d, q8.s, q8.i, B, y + off, n, lo, hi)
                                   : t->gemv(p.qtype, p.w, p.rs, K, x, B, y + off, n, lo, hi);
                if (bad) ok = false;
            }
            off += p.n;
        }
        if (lin.bias)
            for (int64_t b = 0; b < B; b++)
                for (int64_t i = c0; i < c1; i++) y[b * n + i] += lin.bias[i];
        for (int spins = 0; a_done.load(std::memory_order_acquire) < nth; spins++)
            if (spins > 64) std::this_thread::yield();  // a thread still in its A rows (descheduled?)
        thread_local std::vector<float> u;
        if (u.size() < static_cast<size_t>(c1 - c0)) u.resize(c1 - c0);
        for (const Job& j : jobs) {
            if (j.w->bt16)
                kvlm::lora_b_add_bf16(tr + j.t0, static_cast<const uint16_t*>(j.w->bt), j.w->spans, j.w->parts,
                                      y + j.b * n, u.data(), c0, c1);
            else
                kvlm::lora_b_add(tr + j.t0, static_cast<const float*>(j.w->bt), j.w->spans, j.w->parts, y + j.b * n,
                                 u.data(), c0, c1);
        }
    };
    const int nt = at::in_parallel_region() ? 1 : at::get_num_threads();
    if (nt <= 1) {
        a_part(0, 1);
        a_done = 1;
        out_part(0, 1);
    } else {
#pragma omp parallel num_threads(nt)
        {
            const int64_t id = omp_get_thread_num(), nth = omp_get_num_threads();
            a_part(id, nth);
            a_done.fetch_add(1, std::memory_order_release);  // this thread's A rows are in tmp
            out_part(id, nth);
        }
    }
    TORCH_CHECK(ok, "kvlm decode: LoRA projection failed (no kernel for a weight type)");
    return true;
}

enum { T_NORM = 0, T_MATMUL, T_KV_WRITE, T_ATTENTION, T_OTHER, T_PARTS };

struct Timer {
    double* acc;  // (T_PARTS,) seconds, or null when not profiling
    std::chrono::steady_clock::time_point t0;
    explicit Timer(double* a) : acc(a) {
        if (acc) t0 = std::chrono::steady_clock::now();
    }
    void lap(int part) {
        if (!acc) return;
        auto t = std::chrono::steady_clock::now();
        acc[part] += std::chrono::duration<double>(t - t0).count();
        t0 = t;
    }
};

// x += h * r: the module path's `x + (h * r)`, two roundings (this unit is built without FMA contraction
// targets); r == 1 adds h as it is.
void residual_add(float* x, const float* h, int64_t n, float r) {
    if (r == 1.0f) {
        for (int64_t i = 0; i < n; i++) x[i] += h[i];
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        const float t = h[i] * r;
        x[i] += t;
    }
}

void run_linear(const KvlmKernels* t, const Linear& lin, const float* x, int64_t B, float* y, int act) {
    int64_t off = 0;
    for (const Part& p : lin.parts) {
        TORCH_CHECK(kvlm::matmul(t, p.qtype, p.w, p.rs, lin.k, p.n, x, B, y + off, lin.n, act),
                    "kvlm decode: no kernel for ggml type ", p.qtype);
        off += p.n;
    }
    if (lin.bias)
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < lin.n; i++) y[b * lin.n + i] += lin.bias[i];
}

// x (B, hidden) float32: the step's token embeddings. out (B, hidden): final-normed hidden states.
// positions, slots (B,) int64; block_tables (B, MB) int32; context_lens (B,) int32 (after this token);
// k_caches/v_caches: per layer (num_blocks, block_size, kv_heads, D) float32, float16 or bfloat16, or int8 / int4
// codes (uint8, last dim D / 32 * 34 or 18; each new token quantized on write). profile: empty, or a
// float64 (5,) tensor that accumulates seconds in norm/elementwise, matmul, kv write, attention, other.
// k_center: empty, or (layers, kv_heads, D) float32 subtracted from each new key before it is stored (a
// centered int8 / int4 cache, kvlm/kv_cache/k_center.py): one float32 subtraction per value, kv_quant.centered's.
// k0_center: empty, or (layers, kv_heads, D) float32, what a key at position 0 is centered on instead (k0).
// k0_delta: empty, or (layers, kv_heads, D) float32, the position-0 key's center correction per layer (rotated,
// KvlmPagedAttn), with k0_seqs empty (every sequence) or (B,) uint8. k0_center and k0_delta come together.
void decode_step(int64_t plan_id, const at::Tensor& x, const at::Tensor& positions, const at::Tensor& slots,
                 const at::Tensor& block_tables, const at::Tensor& context_lens, at::TensorList k_caches,
                 at::TensorList v_caches, const at::Tensor& k_center, const at::Tensor& k0_center,
                 const at::Tensor& k0_delta,
                 const at::Tensor& k0_seqs, at::IntArrayRef lora_ids, int64_t isa, const at::Tensor& out,
                 const at::Tensor& profile) {
    Plan& p = get_plan(plan_id);
    const KvlmKernels* t = kvlm::table(isa);
    const int64_t H = p.hidden, nh = p.nh, kvh = p.kvh, D = p.D, I = p.inter, L = p.layers.size();
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == H && x.is_contiguous(),
                "kvlm decode: x must be contiguous float32 (B, hidden)");
    const int64_t B = x.size(0);
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == x.sizes(), "bad out tensor");
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == B && positions.is_contiguous() &&
                    slots.scalar_type() == at::kLong && slots.numel() == B && slots.is_contiguous(),
                "kvlm decode: positions and slots must be contiguous int64 (B,)");
    TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.size(0) == B &&
                    block_tables.is_contiguous() && context_lens.scalar_type() == at::kInt &&
                    context_lens.numel() == B && context_lens.is_contiguous(),
                "kvlm decode: block_tables (B, max_blocks) and context_lens (B,) must be contiguous int32");
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == L && static_cast<int64_t>(v_caches.size()) == L,
                "kvlm decode: one K and one V cache per layer");
    const at::Tensor& kc0 = k_caches[0];
    const at::ScalarType kv_type = kc0.scalar_type();
    // row: a head row's length in the cache's elements (D, or the int8 / int4 codes' bytes)
    const int64_t row_len = kc0.dim() == 4 ? kc0.size(3) : -1;
    const bool q8 = kv_type == at::kByte && D % 32 == 0 && row_len == D / 32 * 34;
    const bool q4 = kv_type == at::kByte && D % 32 == 0 && row_len == D / 32 * 18;
    TORCH_CHECK(((kv_type == at::kFloat || kv_type == at::kHalf || kv_type == at::kBFloat16) && row_len == D || q8 ||
                 q4) &&
                    kc0.size(2) == kvh,
                "kvlm decode: caches must be float32, float16 or bfloat16 (num_blocks, block_size, kv_heads, D) "
                "or int8 / int4 codes");
    const int kv_dtype = q8 ? KV_Q8 : q4 ? KV_Q4 : kv_type == at::kFloat ? T_F32 : kv_type == at::kHalf ? T_F16 : T_BF16;
    const bool rotated = (q8 && kvlm::kv_rotates(8)) || (q4 && kvlm::kv_rotates(4));
    const auto store = q8 ? store_kv_q8 : q4 ? store_kv_q4 : kv_type == at::kFloat ? store_kv<float>
                       : kv_type == at::kHalf ? store_kv<c10::Half> : store_kv<c10::BFloat16>;
    const int64_t NB = kc0.size(0), BS = kc0.size(1), MB = block_tables.size(1);
    for (int64_t l = 0; l < L; l++)
        TORCH_CHECK(k_caches[l].is_contiguous() && v_caches[l].is_contiguous() && k_caches[l].sizes() == kc0.sizes() &&
                        v_caches[l].sizes() == kc0.sizes() && k_caches[l].scalar_type() == kv_type &&
                        v_caches[l].scalar_type() == kv_type, "kvlm decode: layer ", l, " cache differs");
    const float* mu = nullptr;
    if (k_center.numel()) {
        TORCH_CHECK(k_center.scalar_type() == at::kFloat && k_center.is_contiguous() && k_center.numel() == L * kvh * D,
                    "kvlm decode: k_center must be contiguous float32 (layers, kv_heads, D)");
        mu = k_center.const_data_ptr<float>();
    }
    const float* k0d = nullptr;
    const float* k0c = nullptr;
    const uint8_t* k0s = nullptr;
    if (k0_delta.numel()) {
        TORCH_CHECK(mu && k0_delta.scalar_type() == at::kFloat && k0_delta.is_contiguous() && k0_delta.numel() == L * kvh * D,
                    "kvlm decode: k0_delta must be contiguous float32 (layers, kv_heads, D), with k_center");
        TORCH_CHECK(k0_center.scalar_type() == at::kFloat && k0_center.is_contiguous() && k0_center.numel() == L * kvh * D,
                    "kvlm decode: k0_center must be contiguous float32 (layers, kv_heads, D), with k0_delta");
        k0d = k0_delta.const_data_ptr<float>();
        k0c = k0_center.const_data_ptr<float>();
        if (k0_seqs.numel()) {
            TORCH_CHECK(k0_seqs.scalar_type() == at::kByte && k0_seqs.is_contiguous() && k0_seqs.numel() == B,
                        "kvlm decode: k0_seqs must be contiguous uint8 (B,)");
            k0s = k0_seqs.const_data_ptr<uint8_t>();
        }
    }
    const int64_t* pos = positions.const_data_ptr<int64_t>();
    const int64_t* slot = slots.const_data_ptr<int64_t>();
    const int32_t* bt = block_tables.const_data_ptr<int32_t>();
    const int32_t* lens = context_lens.const_data_ptr<int32_t>();
    for (int64_t b = 0; b < B; b++) {  // the kernels trust these: check them once per step
        TORCH_CHECK(pos[b] >= 0 && pos[b] < p.max_pos, "kvlm decode: position ", pos[b], " beyond the RoPE table");
        TORCH_CHECK(slot[b] >= 0 && slot[b] < NB * BS, "kvlm decode: slot ", slot[b], " outside the cache");
        TORCH_CHECK(lens[b] >= 1 && lens[b] <= MB * BS, "kvlm decode: context length ", lens[b], " exceeds its table");
        for (int64_t j = 0; j * BS < lens[b]; j++)
            TORCH_CHECK(bt[b * MB + j] >= 0 && bt[b * MB + j] < NB, "kvlm decode: block id outside the cache");
    }
    double* prof = nullptr;
    if (profile.numel()) {
        TORCH_CHECK(profile.scalar_type() == at::kDouble && profile.numel() == T_PARTS && profile.is_contiguous(),
                    "kvlm decode: profile must be float64 (5,)");
        prof = profile.mutable_data_ptr<double>();
    }
    // lora_ids: empty (no adapter in the step), or (B,) each row's LoRA plan (0: the base)
    std::vector<const Lora*> lora_rows;
    if (!lora_ids.empty()) {
        TORCH_CHECK(static_cast<int64_t>(lora_ids.size()) == B, "kvlm decode: one LoRA id per row");
        std::lock_guard<std::mutex> g(plans_mu);
        for (int64_t id : lora_ids) {
            const Lora* lo = nullptr;
            if (id) {
                auto it = loras.find(id);
                TORCH_CHECK(it != loras.end() && static_cast<int64_t>(it->second->layers.size()) == L,
                            "kvlm decode: no LoRA plan ", id, " for this model");
                lo = it->second.get();
            }
            lora_rows.push_back(lo);
        }
    }
    thread_local std::vector<float> lora_tmp;
    Timer tm(prof);

    const int64_t nqkv = (nh + 2 * kvh) * D;
    // Scratch: residual (B, H) | h (B, H) | qkv (B, nqkv) | q (B, nh, D) | attn (B, nh * D) | gu (B, 2I) | a (B, I)
    // | mo (B, H): a routed MLP's output
    const size_t need = static_cast<size_t>(B * (3 * H + nqkv + 2 * nh * D + 3 * I));
    if (p.scratch.size() < need) p.scratch.resize(need);
    float* xr = p.scratch.data();
    float* h = xr + B * H;
    float* qkv = h + B * H;
    float* q = qkv + B * nqkv;
    float* attn = q + B * nh * D;
    float* gu = attn + B * nh * D;
    float* a = gu + B * 2 * I;
    float* mo = a + B * I;
    std::memcpy(xr, x.const_data_ptr<float>(), sizeof(float) * B * H);
    const float scale = p.attn_scale, r = p.resid;
    const int64_t RD = p.rd;
    tm.lap(T_OTHER);

    for (int64_t l = 0; l < L; l++) {
        const Layer& ly = p.layers[l];
        for (int64_t b = 0; b < B; b++) rmsnorm(xr + b * H, ly.in_norm, h + b * H, H, p.eps);
        tm.lap(T_NORM);
        if (lora_rows.empty() || !linear_lora(t, ly.qkv, lora_rows, l, L_QKV, h, B, qkv, p.act, lora_tmp))
            run_linear(t, ly.qkv, h, B, qkv, p.act);
        tm.lap(T_MATMUL);
        for (int64_t b = 0; b < B; b++) {
            float* row = qkv + b * nqkv;  // [q (nh, D) | k (kvh, D) | v (kvh, D)]
            if (ly.q_norm && ly.qk_full) {
                rmsnorm(row, ly.q_norm, row, nh * D, p.eps);
                rmsnorm(row + nh * D, ly.k_norm, row + nh * D, kvh * D, p.eps);
            } else if (ly.q_norm) {
                for (int64_t i = 0; i < nh + kvh; i++) rmsnorm(row + i * D, i < nh ? ly.q_norm : ly.k_norm, row + i * D, D, p.eps);
            }
            const float* c = p.cos + pos[b] * RD;
            const float* s = p.sin + pos[b] * RD;
            if (ly.rope)  // the first RD values of each head, as the module path rotates a contiguous copy of them
                for (int64_t i = 0; i < nh + kvh; i++) rope(row + i * D, c, s, RD);
            std::memcpy(q + b * nh * D, row, sizeof(float) * nh * D);
        }
        tm.lap(T_NORM);
        void* kc = k_caches[l].mutable_data_ptr();
        void* vc = v_caches[l].mutable_data_ptr();
        for (int64_t b = 0; b < B; b++) {
            float* row = qkv + b * nqkv;
            if (mu) {  // the key is not read again this step (q was copied out): center it in place
                // on k0 at position 0 (a 1-token prompt's row), on mu elsewhere: kv_quant.centered's rule
                const float* c = (k0c && pos[b] == 0 ? k0c : mu) + l * kvh * D;
                for (int64_t i = 0; i < kvh * D; i++) row[nh * D + i] -= c[i];
            }
            store(kc, slot[b] * kvh * row_len, row + nh * D, kvh * D, D);
            store(vc, slot[b] * kvh * row_len, row + (nh + kvh) * D, kvh * D, D);
        }
        tm.lap(T_KV_WRITE);
        if (rotated)  // q H . k H = q . k; the output comes back as (p V) H
            kvlm::hadamard_rows(q, B * nh, D);
        TORCH_CHECK(kvlm::paged_attention(t, kv_dtype, q, kc, vc, bt, lens, attn, B, nh, kvh, D, BS, MB, scale,
                                          k0d ? k0d + l * kvh * D : nullptr, k0s),
                    "kvlm decode: attention failed");
        if (rotated)
            kvlm::hadamard_rows(attn, B * nh, D);
        tm.lap(T_ATTENTION);
        if (lora_rows.empty() || !linear_lora(t, ly.o, lora_rows, l, L_O, attn, B, h, p.act, lora_tmp))
            run_linear(t, ly.o, attn, B, h, p.act);
        tm.lap(T_MATMUL);
        residual_add(xr, h, B * H, r);
        for (int64_t b = 0; b < B; b++) rmsnorm(xr + b * H, ly.post_norm, h + b * H, H, p.eps);
        tm.lap(T_NORM);
        if (ly.moe) {
            TORCH_CHECK(kvlm::moe_mlp(t, ly.moe_l, h, B, mo, p.act), "kvlm decode: no kernel for an expert type");
            tm.lap(T_MATMUL);
            residual_add(xr, mo, B * H, r);
            tm.lap(T_NORM);
            continue;
        }
        if (lora_rows.empty() || !linear_lora(t, ly.gate_up, lora_rows, l, L_GATE_UP, h, B, gu, p.act, lora_tmp))
            run_linear(t, ly.gate_up, h, B, gu, p.act);
        tm.lap(T_MATMUL);
        for (int64_t b = 0; b < B; b++) silu_mul(gu + b * 2 * I, gu + b * 2 * I + I, a + b * I, I);
        tm.lap(T_NORM);
        if (lora_rows.empty() || !linear_lora(t, ly.down, lora_rows, l, L_DOWN, a, B, h, p.act, lora_tmp))
            run_linear(t, ly.down, a, B, h, p.act);
        tm.lap(T_MATMUL);
        residual_add(xr, h, B * H, r);
        tm.lap(T_NORM);
    }
    float* o = out.mutable_data_ptr<float>();
    for (int64_t b = 0; b < B; b++) rmsnorm(xr + b * H, p.final_norm, o + b * H, H, p.eps);
    tm.lap(T_NORM);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvlm_kernels, m) {
    m.def("decode_plan_create(Tensor[] tensors, int[] spec, float eps) -> int", &decode_plan_create);
    m.def("decode_plan_free(int plan) -> ()", &decode_plan_free);
    m.def("decode_lora_create(Tensor[] tensors, int layers) -> int", &decode_lora_create);
    m.def("decode_lora_free(int lora) -> ()", &decode_lora_free);
    m.def("decode_step(int plan, Tensor x, Tensor positions, Tensor slots, Tensor block_tables, Tensor context_lens, "
          "Tensor[] k_caches, Tensor[] v_caches, Tensor k_center, Tensor k0_center, Tensor k0_delta, Tensor k0_seqs, "
          "int[] lora_ids, int isa, "
          "Tensor(a!) out, "
          "Tensor(b!) profile) -> ()", &decode_step);
}
