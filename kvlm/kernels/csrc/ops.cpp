// Torch bindings (torch.ops.kvlm_kernels.*): argument checks, the thread split (at::parallel_for over
// output rows or attention work items), and the choice of ISA table. The kernels themselves are in
// kernels_impl.h, compiled once per ISA. Only light torch headers here, to keep the one-time build short.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <atomic>
#include <optional>
#include <utility>
#include <vector>

#include "drivers.h"

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>  // getauxval: the CPU's feature bits
#endif
#if (defined(__x86_64__) || defined(__i386__)) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>  // arch_prctl: the AMX tile state
#include <unistd.h>
#endif
#if defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>  // sysctlbyname: the CPU's features on macOS
#endif

namespace kvlm {

#if defined(__aarch64__)
// sdot: Linux reports it as HWCAP_ASIMDDP; Apple silicon (M1 and later) always has it.
bool cpu_has_dotprod() {
#if defined(__APPLE__)
    return true;
#elif defined(__linux__)
    return (getauxval(AT_HWCAP) & (1UL << 20)) != 0;  // HWCAP_ASIMDDP
#else
    return false;
#endif
}
// smmla: Linux reports it as HWCAP2_I8MM; macOS as the sysctl hw.optional.arm.FEAT_I8MM (M2 and later).
bool cpu_has_i8mm() {
#if defined(__APPLE__)
    int on = 0;
    size_t size = sizeof on;
    return sysctlbyname("hw.optional.arm.FEAT_I8MM", &on, &size, nullptr, 0) == 0 && on != 0;
#elif defined(__linux__)
    return (getauxval(AT_HWCAP2) & (1UL << 13)) != 0;  // HWCAP2_I8MM
#else
    return false;
#endif
}
#endif

#if defined(__x86_64__) || defined(__i386__)
// The x86 paths in their order (each CPU has every one up to its best): scalar, AVX2, AVX-512, + VNNI.
int64_t x86_level() {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        return __builtin_cpu_supports("avx512vnni") ? ISA_AVX512_VNNI : ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
        __builtin_cpu_supports("bmi2"))
        return ISA_AVX2;
    return ISA_SCALAR;
}

// AVX-VNNI sits beside that order: AVX2 CPUs with it (Alder Lake and later client chips) and AVX-512
// ones without it (Zen 4, Ice Lake) both exist.
bool x86_avx_vnni() {
    __builtin_cpu_init();
    return x86_level() >= ISA_AVX2 && __builtin_cpu_supports("avxvnni");
}

// AMX above AVX-512 VNNI: the CPU's AMX-TILE and AMX-INT8 bits (cpuid leaf 7: edx bits 24, 25), and Linux's
// leave to use the tile data (arch_prctl ARCH_REQ_XCOMP_PERM = 0x1023 for XFEATURE_XTILEDATA = 18: without
// it the first tile instruction faults). Asked once; the grant is the process's, every thread's.
bool x86_amx() {
#if defined(__linux__)
    static const bool ok = [] {
        unsigned a, b, c, d;
        if (x86_level() != ISA_AVX512_VNNI || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
        if ((d & (3u << 24)) != (3u << 24)) return false;
        return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }();
    return ok;
#else
    return false;
#endif
}
#endif

int64_t best_isa() {
#if defined(__x86_64__) || defined(__i386__)
    const int64_t level = x86_level();  // AVX-512 first where there is one (16 lanes to AVX-VNNI's 8)
    if (level == ISA_AVX512_VNNI && x86_amx()) return ISA_AVX512_AMX;
    return level == ISA_AVX2 && x86_avx_vnni() ? ISA_AVX2_VNNI : level;
#elif defined(__aarch64__)
    if (!cpu_has_dotprod()) return ISA_NEON;
    return cpu_has_i8mm() ? ISA_NEON_I8MM : ISA_NEON_DOTPROD;
#else
    return ISA_SCALAR;
#endif
}

bool isa_available(int64_t isa) {
    if (isa == ISA_SCALAR) return true;
#if defined(__x86_64__) || defined(__i386__)
    if (isa == ISA_AVX2_VNNI) return x86_avx_vnni();
    if (isa == ISA_AVX512_AMX) return x86_amx();
    return isa >= ISA_AVX2 && isa <= ISA_AVX512_VNNI && isa <= x86_level();
#elif defined(__aarch64__)
    return isa == ISA_NEON || (isa >= ISA_NEON_DOTPROD && isa <= ISA_NEON_I8MM && isa <= best_isa());
#else
    return false;
#endif
}

const KvlmKernels* table(int64_t isa) {
    TORCH_CHECK(isa_available(isa), "kvlm kernels: ISA ", isa, " is not available on this CPU");
#if defined(__x86_64__) || defined(__i386__)
    if (isa == ISA_AVX512_AMX) return kvlm_kernels_avx512_amx();
    if (isa == ISA_AVX512_VNNI) return kvlm_kernels_avx512_vnni();
    if (isa == ISA_AVX512) return kvlm_kernels_avx512();
    if (isa == ISA_AVX2_VNNI) return kvlm_kernels_avx2_vnni();
    if (isa == ISA_AVX2) return kvlm_kernels_avx2();
#elif defined(__aarch64__)
    if (isa == ISA_NEON_I8MM) return kvlm_kernels_neon_i8mm();
    if (isa == ISA_NEON_DOTPROD) return kvlm_kernels_neon_dotprod();
    if (isa == ISA_NEON) return kvlm_kernels_neon();
#endif
    return kvlm_kernels_scalar();
}

bool has_int8(const KvlmKernels* t, int qtype) {
    return t->gemv_i8 != nullptr && (qtype == T_Q4_0 || qtype == T_Q4_1 || qtype == T_Q8_0 || qtype == T_Q5_0 ||
                                     qtype == T_Q5_1 || qtype == T_Q4_K || qtype == T_Q5_K || qtype == T_Q6_K ||
                                     qtype == (T_Q4_K | PANELS16));
}

// x (M, K) quantized per 32-element block (quantize_act, rows in parallel) into this thread's buffers
// (drivers.h, ActQ). The buffers grow to the largest call and stay, so steady-state calls allocate
// nothing; they are valid until the next call on this thread.
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

bool matmul_parts(const KvlmKernels* t, const MatPart* parts, int np, int64_t K, const float* x, int64_t M, int act) {
    bool i8[MAX_PARTS], any8 = false;
    TORCH_CHECK(np >= 1 && np <= MAX_PARTS, "kvlm matmul_parts: 1 to ", MAX_PARTS, " parts");
    int64_t work = 0;
    for (int j = 0; j < np; j++) {
        any8 |= (i8[j] = act == ACT_INT8 && has_int8(t, parts[j].qtype) && K % 32 == 0);
        work += parts[j].N;
    }
    ActQ q{};
    if (any8) q = quantize_x(t, x, M, K);
    // Each task takes the same share of every part's 16-column panels (as a call per part would split it), so
    // parts of different cost (Q4_K q beside a Q6_K v) keep the threads even; small products run on fewer tasks.
    const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), work * K * M / 32768));
    std::atomic<bool> ok{true};
    at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t task = t0; task < t1; task++)
            for (int j = 0; j < np; j++) {
                const MatPart& p = parts[j];
                const int64_t panels = (p.N + 15) / 16, p0 = panels * task / nt, p1 = panels * (task + 1) / nt;
                if (p0 == p1) continue;
                const int64_t n0 = 16 * p0, n1 = std::min(p.N, 16 * p1);
                const int rc = i8[j] ? t->gemv_i8(p.qtype, p.w, p.rs, K, q.q, q.d, q.s, q.i, M, p.y, p.ldy, n0, n1)
                                     : t->gemv(p.qtype, p.w, p.rs, K, x, M, p.y, p.ldy, n0, n1);
                if (rc) ok = false;
            }
    });
    return ok;
}

// Mixture-of-experts, llama.cpp's mul_mat_id, for np projections that read the same rows x (R, K) (gate and
// up): projection j's y_j (R, ldy_j)[:, 0:N_j] = each expert's rows of x times that expert's W_e.T, the rows
// grouped by expert in ascending id (counts[e] rows each), W_e at w + e * es, its rows rs apart. x is
// quantized once for every int8 projection (ACT_INT8; `a`, if given, is x already quantized); one parallel
// loop over (projection, expert, 16-column panel) items, so the threads split over projections, experts and
// columns together. An output's arithmetic is the dense kernel's for that row (fixed per row and column,
// whatever M, the panel or the thread), so each row has the bits of `matmul` on that expert alone.
bool expert_matmul_multi(const KvlmKernels* t, const ExpertProj* proj, int np, int64_t K, const int64_t* counts,
                         int64_t E, const float* x, const ActQ* a, int64_t R, int act) {
    thread_local std::vector<int64_t> ex, off, first;  // the experts with rows, where their rows start; items
    ex.clear(), off.clear(), first.clear();
    for (int64_t e = 0, r = 0; e < E; r += counts[e], ++e)
        if (counts[e] > 0) ex.push_back(e), off.push_back(r);
    bool i8[2], any8 = false;
    TORCH_CHECK(np >= 1 && np <= 2, "kvlm expert matmul: 1 or 2 projections");
    for (int j = 0; j < np; j++) any8 |= (i8[j] = act == ACT_INT8 && has_int8(t, proj[j].qtype) && K % 32 == 0);
    ActQ q{};
    if (any8) q = a ? *a : quantize_x(t, x, R, K);
    const int64_t nb = K / 32, nex = (int64_t)ex.size();
    int64_t items = 0;
    for (int j = 0; j < np; j++) first.push_back(items), items += nex * ((proj[j].N + 15) / 16);
    first.push_back(items);
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, K * std::max<int64_t>(1, R)) / 16);
    std::atomic<bool> ok{true};
    const int64_t* fi = first.data();  // (a thread_local's name would mean each worker's own vector)
    const int64_t *exs = ex.data(), *offs = off.data();
    at::parallel_for(0, items, grain, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1;) {  // a run of one projection's, one expert's panels: one kernel call
            int j = 0;
            while (i >= fi[j + 1]) j++;
            const ExpertProj& p = proj[j];
            const int64_t panels = (p.N + 15) / 16, li = i - fi[j], end = std::min(i1, fi[j + 1]) - fi[j];
            const int64_t g = li / panels, p0 = li % panels, p1 = std::min(panels, p0 + (end - li));
            const int64_t e = exs[g], r0 = offs[g], m = counts[e];
            const uint8_t* we = p.w + e * p.es;
            const int64_t n0 = 16 * p0, n1 = std::min(p.N, 16 * p1);
            const int rc = i8[j] ? t->gemv_i8(p.qtype, we, p.rs, K, q.q + r0 * K, q.d + 8 * r0 * nb, q.s + r0 * nb,
                                              q.i + r0 * nb, m, p.y + r0 * p.ldy, p.ldy, n0, n1)
                                 : t->gemv(p.qtype, we, p.rs, K, x + r0 * K, m, p.y + r0 * p.ldy, p.ldy, n0, n1);
            if (rc) ok = false;
            i += p1 - p0;
        }
    });
    return ok;
}

bool expert_matmul(const KvlmKernels* t, int qtype, const uint8_t* w, int64_t es, int64_t rs, int64_t K, int64_t N,
                   const int64_t* counts, int64_t E, const float* x, int64_t R, float* y, int act) {
    const ExpertProj p{qtype, w, es, rs, N, y, N};
    return expert_matmul_multi(t, &p, 1, K, counts, E, x, nullptr, R, act);
}

// Work items of ATTN_CHUNK tokens per row tile (a constant: chunk boundaries, hence every sum's order,
// depend on the row's context length only), all in one parallel loop; see KvlmPagedAttn for the tiles and
// the combine. The plan (row order, tiles, items) and the partial states live in this thread's buffers,
// which only grow.
constexpr int64_t ATTN_CHUNK = 128;
// Partial states alive at once, in floats: a call whose multi-chunk tiles need more runs in waves of
// whole tiles, each its own parallel loop over the same buffer (long prefills: rows x chunks x H x D).
constexpr int64_t ATTN_PART_CAP = int64_t{8} << 20;

// The first token a row of context length L attends under a sliding window (0: none).
static int64_t window_start(int64_t L, int64_t window) { return window > 0 && L > window ? L - window : 0; }

bool paged_attention_rows(const KvlmKernels* t, int kv_dtype, const float* q, const void* k_cache,
                          const void* v_cache, const int32_t* block_tables, const int32_t* seq_ids,
                          const int32_t* ctx_lens, float* out, int64_t T, int64_t H, int64_t KVH, int64_t D,
                          int64_t BS, int64_t MB, float scale, int64_t window, const float* k0_delta,
                          const uint8_t* k0_seqs) {
    if (kv_dtype != T_F32 && kv_dtype != T_F16 && kv_dtype != T_BF16 && kv_dtype != KV_Q8 && kv_dtype != KV_Q4)
        return false;
    if (T == 0) return true;
    thread_local std::vector<int32_t> order, tiles, items, split, pending;
    thread_local std::vector<int64_t> part_first, item_first, cost, split_cost, bound;
    thread_local std::vector<float> part;
    auto seq = [&](int64_t r) -> int64_t { return seq_ids ? seq_ids[r] : r; };
    // Rows grouped by sequence, by ascending context length within one (the order tiles need; any order
    // gives the same bits). Decode (one row per sequence, in order) and causal prefill are sorted already.
    order.resize(T);
    for (int64_t r = 0; r < T; r++) order[r] = static_cast<int32_t>(r);
    auto before = [&](int32_t x, int32_t y) {
        return seq(x) != seq(y) ? seq(x) < seq(y) : (ctx_lens[x] != ctx_lens[y] ? ctx_lens[x] < ctx_lens[y] : x < y);
    };
    if (!std::is_sorted(order.begin(), order.end(), before)) std::sort(order.begin(), order.end(), before);
    // Tiles: each sequence's rows in ceil(n / KVLM_ATTN_TILE) tiles of near-equal size; per tile its chunk
    // count (its longest row's; L = 0: one, empty) and items, one per chunk.
    tiles.clear();
    items.clear();
    pending.clear();
    part_first.clear();
    item_first.clear();
    cost.clear();
    for (int64_t r0 = 0; r0 < T;) {
        int64_t r1 = r0 + 1;
        while (r1 < T && seq(order[r1]) == seq(order[r0])) r1++;
        const int64_t n = r1 - r0, nt = (n + KVLM_ATTN_TILE - 1) / KVLM_ATTN_TILE;
        for (int64_t i = 0, first = r0; i < nt; i++) {
            const int64_t rows = n / nt + (i < n % nt ? 1 : 0);
            const int64_t k = static_cast<int64_t>(pending.size());
            const int64_t lmax = ctx_lens[order[first + rows - 1]];
            const int64_t nc = std::max<int64_t>(1, (lmax + ATTN_CHUNK - 1) / ATTN_CHUNK);
            // Chunks before the shortest row's window hold no token any row attends (kernels.h).
            const int64_t c0 = window_start(ctx_lens[order[first]], window) / ATTN_CHUNK;
            tiles.push_back(static_cast<int32_t>(first)), tiles.push_back(static_cast<int32_t>(rows));
            pending.push_back(static_cast<int32_t>(nc - c0));
            part_first.push_back(nc - c0 > 1 ? rows * (nc - c0) : 0);  // its partial states (offsets set per wave)
            item_first.push_back(static_cast<int64_t>(items.size() / 3));
            for (int64_t c = c0; c < nc; c++) {
                int64_t w = 0;  // the item's cost: its rows' tokens (16-token groups) plus a per-row overhead
                for (int64_t j = first; j < first + rows; j++) {
                    const int64_t L = ctx_lens[order[j]], len = L - c * ATTN_CHUNK;
                    if (window_start(L, window) >= (c + 1) * ATTN_CHUNK) continue;
                    if (len > 0 || c == 0) w += (std::min(ATTN_CHUNK, std::max<int64_t>(len, 0)) + 15) / 16 * 16 + 32;
                }
                items.push_back(static_cast<int32_t>(k)), items.push_back(static_cast<int32_t>(c));
                items.push_back(0);  // kv-head share 0 of 1 (kv_split below)
                cost.push_back(w);
            }
            first += rows;
        }
        r0 = r1;
    }
    const int64_t n_tiles = static_cast<int64_t>(pending.size());
    item_first.push_back(static_cast<int64_t>(items.size() / 3));
    const int64_t stride = H * (D + 2);
    const int64_t nthreads = std::max<int64_t>(1, at::get_num_threads());
    // Fewer (tile, chunk) items than threads (a decode of fewer sequences than threads, each within one
    // chunk): each item becomes kv_split items of a share of the kv heads, so every thread has one. A head's
    // arithmetic does not depend on which heads share its item: the same bits. The 1B Q4_K_M's decode at 64
    // tokens, 2 threads of the Xeon: attention 0.66-0.69 -> 0.40-0.42 ms a step (avx2), 0.56-0.57 -> 0.37-0.38
    // (avx512-amx) (docs/results/xeon_session28.txt).
    const int64_t n_items = static_cast<int64_t>(items.size() / 3);
    const int64_t kv_split = n_items >= nthreads ? 1 : std::min<int64_t>(KVH, (nthreads + n_items - 1) / n_items);
    if (kv_split > 1) {
        split.clear();
        split_cost.clear();
        for (int64_t i = 0; i < n_items; i++)
            for (int64_t sh = 0; sh < kv_split; sh++) {
                split.push_back(items[3 * i]), split.push_back(items[3 * i + 1]);
                split.push_back(static_cast<int32_t>(sh));
                split_cost.push_back(cost[i]);
            }
        items.swap(split);
        cost.swap(split_cost);
        for (int64_t& f : item_first) f *= kv_split;
        for (int32_t& n : pending) n *= static_cast<int32_t>(kv_split);
    }
    std::atomic<bool> ok{true};
    for (int64_t k0 = 0; k0 < n_tiles;) {
        // A wave: tiles k0 .. k1 - 1, their partial states from the start of `part`.
        int64_t k1 = k0, used = 0;
        while (k1 < n_tiles && (k1 == k0 || (used + part_first[k1]) * stride <= ATTN_PART_CAP)) {
            const int64_t need = part_first[k1];
            part_first[k1] = used;
            used += need;
            k1++;
        }
        if (part.size() < static_cast<size_t>(used * stride)) part.resize(used * stride);
        const int64_t i0 = item_first[k0], i1 = item_first[k1];
        // Threads take contiguous runs of items of about equal cost (a tile's chunks stay together, so its
        // partial states are mostly combined from the cache that wrote them).
        int64_t total = 0;
        for (int64_t i = i0; i < i1; i++) total += cost[i];
        const int64_t parts = std::min<int64_t>(nthreads, i1 - i0);
        bound.assign(parts + 1, i1);
        bound[0] = i0;
        for (int64_t i = i0, p = 1, acc = 0; i < i1 && p < parts; i++) {
            acc += cost[i];
            while (p < parts && acc * parts >= total * p) bound[p++] = i + 1;
        }
        const KvlmPagedAttn a{kv_dtype, q, k_cache, v_cache, block_tables, seq_ids, ctx_lens, out, H, KVH, D, BS, MB,
                              ATTN_CHUNK, scale, order.data(), tiles.data(), items.data(), part_first.data(),
                              part.data(), pending.data(), window, k0_delta, k0_seqs, kv_split};
        const int64_t* bnd = bound.data();  // (a thread_local's name would mean each worker's own vector)
        at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
            thread_local std::vector<float> scratch;  // (KVLM_ATTN_TILE, H, ATTN_CHUNK) scores, (KVLM_ATTN_TILE, 2 H)
            const size_t need = static_cast<size_t>(KVLM_ATTN_TILE * H * (ATTN_CHUNK + 2));
            if (scratch.size() < need) scratch.resize(need);
            for (int64_t p = p0; p < p1; p++)
                if (bnd[p] < bnd[p + 1] && t->paged_attn(&a, scratch.data(), bnd[p], bnd[p + 1])) ok = false;
        });
        k0 = k1;
    }
    return ok;
}

bool paged_attention(const KvlmKernels* t, int kv_dtype, const float* q, const void* k_cache, const void* v_cache,
                     const int32_t* block_tables, const int32_t* seq_lens, float* out, int64_t B, int64_t H,
                     int64_t KVH, int64_t D, int64_t BS, int64_t MB, float scale, const float* k0_delta,
                     const uint8_t* k0_seqs) {
    return paged_attention_rows(t, kv_dtype, q, k_cache, v_cache, block_tables, nullptr, seq_lens, out, B, H, KVH, D,
                                BS, MB, scale, 0, k0_delta, k0_seqs);
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

// out (M, sum of N_j) = x (M, K) times each part W_j (N_j, row_bytes, ggml type qtypes[j]) side by side: a
// layer's q / k / v or gate / up kept as separate tensors (they need not be next to each other in the file,
// nor of one type). kvlm::matmul_parts: x quantized once, each part's columns written in place (no
// concatenation). Each column has the bits `qmatmul` / `qmatmul_i8` give its part alone.
void qmatmul_parts(const at::Tensor& x, at::TensorList ws, at::IntArrayRef qtypes, int64_t K, int64_t isa, bool int8,
                   const at::Tensor& out) {
    const int64_t np = (int64_t)ws.size();
    TORCH_CHECK(np >= 1 && np <= kvlm::MAX_PARTS && (int64_t)qtypes.size() == np, "qmatmul_parts: 1 to ",
                kvlm::MAX_PARTS, " parts, one type each");
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() &&
                    x.size(1) == K, "x must be a contiguous float32 (M, K) CPU tensor");
    int64_t cols = 0;
    for (int64_t j = 0; j < np; j++) check_weight(ws[j]), cols += ws[j].size(0);
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == x.size(0) &&
                    out.size(1) == cols, "out must be a contiguous float32 (M, sum of the parts' N) tensor");
    const KvlmKernels* t = table(isa);
    kvlm::MatPart parts[kvlm::MAX_PARTS];
    for (int64_t j = 0, col = 0; j < np; col += ws[j].size(0), j++) {
        parts[j] = {static_cast<int>(qtypes[j]), ws[j].const_data_ptr<uint8_t>(), ws[j].stride(0), ws[j].size(0),
                    out.mutable_data_ptr<float>() + col, cols};
        if (int8)
            TORCH_CHECK(K % 32 == 0 && kvlm::has_int8(t, parts[j].qtype),
                        "kvlm kernels: no int8-activation kernel for ggml type ", parts[j].qtype, " on this ISA path");
    }
    const bool ok = kvlm::matmul_parts(t, parts, (int)np, K, x.const_data_ptr<float>(), x.size(0),
                                       int8 ? kvlm::ACT_INT8 : kvlm::ACT_F32);
    TORCH_CHECK(ok, "kvlm kernels: no kernel for a part's ggml type");
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

// Mixture-of-experts: out (R, N) = x (R, K) rows grouped by expert (counts (E,) int64, ascending id), each
// group times its expert's weight; w (E, N, row_bytes) uint8, an expert stack as the GGUF stores it.
// int8: quantize x per 32-element block first (as qmatmul_i8), else float32 activations (as qmatmul).
void expert_qmatmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts, int64_t qtype, int64_t K,
                    int64_t isa, bool int8, const at::Tensor& out) {
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 3 && w.stride(2) == 1,
                "expert weights must be a CPU uint8 (E, N, row_bytes) tensor with contiguous rows");
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() &&
                    x.size(1) == K, "x must be a contiguous float32 (R, K) CPU tensor");
    TORCH_CHECK(counts.device().is_cpu() && counts.scalar_type() == at::kLong && counts.dim() == 1 &&
                    counts.is_contiguous() && counts.size(0) == w.size(0), "counts must be (E,) int64");
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
                    out.size(0) == x.size(0) && out.size(1) == w.size(1), "out must be a contiguous float32 (R, N)");
    const int64_t* c = counts.const_data_ptr<int64_t>();
    int64_t total = 0;
    for (int64_t e = 0; e < counts.size(0); ++e) {
        TORCH_CHECK(c[e] >= 0, "counts must be non-negative");
        total += c[e];
    }
    TORCH_CHECK(total == x.size(0), "counts must sum to the rows of x");
    const KvlmKernels* t = table(isa);
    if (int8)
        TORCH_CHECK(K % 32 == 0 && kvlm::has_int8(t, static_cast<int>(qtype)),
                    "kvlm kernels: no int8-activation kernel for ggml type ", qtype, " on this ISA path");
    const bool ok = kvlm::expert_matmul(t, static_cast<int>(qtype), w.const_data_ptr<uint8_t>(), w.stride(0),
                                        w.stride(1), K, w.size(1), c, w.size(0), x.const_data_ptr<float>(), x.size(0),
                                        out.mutable_data_ptr<float>(), int8 ? kvlm::ACT_INT8 : kvlm::ACT_F32);
    TORCH_CHECK(ok, "kvlm kernels: no kernel for ggml type ", qtype);
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

void check_caches(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& out) {
    TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(), "q must be contiguous float32 (T, H, D)");
    const auto kv_type = k_cache.scalar_type();
    TORCH_CHECK((kv_type == at::kFloat || kv_type == at::kHalf || kv_type == at::kBFloat16 || kv_type == at::kByte) &&
                    k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                    v_cache.scalar_type() == kv_type && v_cache.is_contiguous(),
                "k/v caches must be contiguous float32, float16 or bfloat16 (num_blocks, block_size, kv_heads, D) "
                "or int8 / int4 codes (uint8, last dim D / 32 * 34 or 18)");
    const int64_t D = q.size(2), row = k_cache.size(3);  // codes: D / 32 groups of 34 (int8) or 18 (int4) bytes
    const bool rows_ok = kv_type != at::kByte ? row == D : D % 32 == 0 && (row == D / 32 * 34 || row == D / 32 * 18);
    TORCH_CHECK(rows_ok && D % 16 == 0 && q.size(1) % k_cache.size(2) == 0, "paged attention: inconsistent shapes");
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == q.sizes(), "bad out tensor");
}

int kv_dtype_id(const at::Tensor& k_cache, int64_t D) {  // ggml type ids, or KV_Q8 / KV_Q4 (uint8 codes)
    const auto kv_type = k_cache.scalar_type();
    if (kv_type == at::kByte) return k_cache.size(3) == D / 32 * 34 ? KV_Q8 : KV_Q4;
    return kv_type == at::kFloat ? 0 : (kv_type == at::kHalf ? 1 : 30);
}

// The kernel trusts the tables: check once here that sequence b's first max_len[b] tokens lie in its
// block table and in the cache (B * blocks ints).
void check_tables(const int32_t* bt, const int64_t* max_len, int64_t B, int64_t MB, int64_t BS, int64_t num_blocks) {
    for (int64_t b = 0; b < B; b++) {
        TORCH_CHECK(max_len[b] <= MB * BS, "sequence ", b, ": ", max_len[b], " tokens exceed its block table");
        for (int64_t j = 0; j * BS < max_len[b]; j++)
            TORCH_CHECK(bt[b * MB + j] >= 0 && bt[b * MB + j] < num_blocks, "block_tables[", b, ", ", j,
                        "] = ", bt[b * MB + j], " is outside the cache");
    }
}

// The position-0 key's center correction (KvlmPagedAttn): k0_delta (kv_heads, D) float32, k0_seqs (B,) uint8.
std::pair<const float*, const uint8_t*> k0_args(const std::optional<at::Tensor>& k0_delta,
                                                const std::optional<at::Tensor>& k0_seqs, int64_t KVH, int64_t D,
                                                int64_t B) {
    if (!k0_delta.has_value() || !k0_delta->defined()) return {nullptr, nullptr};
    TORCH_CHECK(k0_delta->scalar_type() == at::kFloat && k0_delta->is_contiguous() && k0_delta->numel() == KVH * D,
                "paged attention: k0_delta must be contiguous float32 (kv_heads, D)");
    if (!k0_seqs.has_value() || !k0_seqs->defined()) return {k0_delta->const_data_ptr<float>(), nullptr};
    TORCH_CHECK(k0_seqs->scalar_type() == at::kByte && k0_seqs->is_contiguous() && k0_seqs->numel() == B,
                "paged attention: k0_seqs must be contiguous uint8 (one per block table row)");
    return {k0_delta->const_data_ptr<float>(), k0_seqs->const_data_ptr<uint8_t>()};
}

void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t isa,
                            const at::Tensor& out, const std::optional<at::Tensor>& k0_delta,
                            const std::optional<at::Tensor>& k0_seqs) {
    check_caches(q, k_cache, v_cache, out);
    TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous() &&
                    seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.is_contiguous(),
                "block_tables (B, max_blocks) and seq_lens (B,) must be contiguous int32");
    const int64_t B = q.size(0), H = q.size(1), D = q.size(2), BS = k_cache.size(1), KVH = k_cache.size(2);
    TORCH_CHECK(block_tables.size(0) == B && seq_lens.size(0) == B, "paged attention: inconsistent shapes");
    const int32_t* bt = block_tables.const_data_ptr<int32_t>();
    const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
    const int64_t MB = block_tables.size(1);
    std::vector<int64_t> max_len(B);
    for (int64_t b = 0; b < B; b++) {
        TORCH_CHECK(lens[b] >= 0, "seq_lens[", b, "] = ", lens[b], " is negative");
        max_len[b] = lens[b];
    }
    check_tables(bt, max_len.data(), B, MB, BS, k_cache.size(0));
    const auto [k0d, k0s] = k0_args(k0_delta, k0_seqs, KVH, D, B);
    const bool ok = kvlm::paged_attention(table(isa), kv_dtype_id(k_cache, D), q.const_data_ptr<float>(),
                                          k_cache.const_data_ptr(), v_cache.const_data_ptr(), bt, lens,
                                          out.mutable_data_ptr<float>(), B, H, KVH, D, BS, MB, static_cast<float>(scale),
                                          k0d, k0s);
    TORCH_CHECK(ok, "kvlm kernels: unsupported KV cache dtype");
}

// Any query rows: row t attends the first ctx_lens[t] tokens of the sequence in block_tables row seq_ids[t].
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_ids, const at::Tensor& ctx_lens,
                     double scale, int64_t isa, const at::Tensor& out, int64_t window,
                     const std::optional<at::Tensor>& k0_delta, const std::optional<at::Tensor>& k0_seqs) {
    check_caches(q, k_cache, v_cache, out);
    TORCH_CHECK(window >= 0, "paged attention: window must be >= 0 (0: no sliding window)");
    TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous() &&
                    seq_ids.scalar_type() == at::kInt && seq_ids.dim() == 1 && seq_ids.is_contiguous() &&
                    ctx_lens.scalar_type() == at::kInt && ctx_lens.dim() == 1 && ctx_lens.is_contiguous(),
                "block_tables (B, max_blocks), seq_ids (T,) and ctx_lens (T,) must be contiguous int32");
    const int64_t T = q.size(0), H = q.size(1), D = q.size(2), BS = k_cache.size(1), KVH = k_cache.size(2);
    const int64_t B = block_tables.size(0), MB = block_tables.size(1);
    TORCH_CHECK(seq_ids.size(0) == T && ctx_lens.size(0) == T, "paged attention: seq_ids and ctx_lens need one entry per query row");
    const int32_t* bt = block_tables.const_data_ptr<int32_t>();
    const int32_t* sid = seq_ids.const_data_ptr<int32_t>();
    const int32_t* lens = ctx_lens.const_data_ptr<int32_t>();
    std::vector<int64_t> max_len(B, 0);
    for (int64_t r = 0; r < T; r++) {
        TORCH_CHECK(sid[r] >= 0 && sid[r] < B, "seq_ids[", r, "] = ", sid[r], " is outside block_tables (", B, " rows)");
        TORCH_CHECK(lens[r] >= 0, "ctx_lens[", r, "] = ", lens[r], " is negative");
        max_len[sid[r]] = std::max<int64_t>(max_len[sid[r]], lens[r]);
    }
    check_tables(bt, max_len.data(), B, MB, BS, k_cache.size(0));
    const auto [k0d, k0s] = k0_args(k0_delta, k0_seqs, KVH, D, B);
    const bool ok = kvlm::paged_attention_rows(table(isa), kv_dtype_id(k_cache, D), q.const_data_ptr<float>(),
                                               k_cache.const_data_ptr(), v_cache.const_data_ptr(), bt, sid, lens,
                                               out.mutable_data_ptr<float>(), T, H, KVH, D, BS, MB,
                                               static_cast<float>(scale), window, k0d, k0s);
    TORCH_CHECK(ok, "kvlm kernels: unsupported KV cache dtype");
}

// A read-only pass over src for bench.latency.read_bandwidth: each of torch's threads reads its share as
// `streams` parts side by side, a 64-byte line of each in turn; returns the sum of the 64-bit words (so
// the reads happen). Why: a CPU may read faster from several streams than from one (a 2-core Xeon read
// ~25-26 GB/s this way, ~22-24 by torch's sum), and decode reads 16 weight rows or a panel stream.
int64_t read_pass(const at::Tensor& src, int64_t streams) {
    TORCH_CHECK(src.is_cpu() && src.is_contiguous() && streams >= 1, "read_pass: a contiguous CPU tensor");
    const auto* p = static_cast<const uint64_t*>(src.const_data_ptr());
    const int64_t words = static_cast<int64_t>(src.nbytes() / 8), nt = at::get_num_threads();
    std::vector<uint64_t> part(nt, 0);
    typedef uint64_t V2 __attribute__((vector_size(16)));  // SSE2 / NEON: 16-byte loads and adds
    constexpr int64_t W = 16;  // words a stream per turn: two 64-byte lines (8 to 64 measured alike)
    at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; t++) {
            const int64_t lo = words * t / nt, len = (words * (t + 1) / nt - lo) / streams / W * W;
            std::vector<const uint64_t*> q(streams);
            for (int64_t s = 0; s < streams; s++) q[s] = p + lo + s * len;
            V2 acc[4] = {};
            for (int64_t i = 0; i < len; i += W)
                for (int64_t s = 0; s < streams; s++)
                    for (int64_t j = 0; j < W; j += 8) {
                        V2 v[4];
                        memcpy(v, q[s] + i + j, 64);
                        for (int k = 0; k < 4; k++) acc[k] += v[k];
                    }
            for (int k = 0; k < 4; k++) part[t] += acc[k][0] + acc[k][1];
        }
    });
    uint64_t sum = 0;
    for (uint64_t v : part) sum += v;
    return static_cast<int64_t>(sum);
}

// kernels/panels.py's pack on whole-dword blocks: out (N, rb) = src (N, rb) with each 16-row panel's blocks of
// `dwords` dwords transposed (row c's dword i of block b -> (b, i, c)); panels in parallel. What torch's strided
// copy does at ~1.4 GB/s (0.99 s of the 3B Q4_K_M's load), as a plain loop over L1-resident blocks.
void pack_panels(const at::Tensor& src, int64_t dwords, const at::Tensor& out) {
    TORCH_CHECK(src.is_cpu() && out.is_cpu() && src.is_contiguous() && out.is_contiguous() && src.dim() == 2 &&
                    src.sizes() == out.sizes() && src.scalar_type() == at::kByte && out.scalar_type() == at::kByte &&
                    dwords > 0 && src.size(0) % 16 == 0 && src.size(1) % (4 * dwords) == 0,
                "pack_panels: contiguous uint8 (N, row_bytes) tensors of whole panels and blocks");
    const int64_t rw = src.size(1) / 4, nb = rw / dwords;  // dwords a row, blocks a row
    const uint8_t* s = src.const_data_ptr<uint8_t>();
    uint8_t* o = out.mutable_data_ptr<uint8_t>();
    at::parallel_for(0, src.size(0) / 16, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; p++)
            for (int64_t b = 0; b < nb; b++)
                for (int64_t i = 0; i < dwords; i++)
                    for (int64_t c = 0; c < 16; c++)
                        memcpy(o + 4 * (((p * nb + b) * dwords + i) * 16 + c), s + 4 * ((16 * p + c) * rw + b * dwords + i), 4);
    });
}

}  // namespace

TORCH_LIBRARY(kvlm_kernels, m) {
    m.def("pack_panels(Tensor src, int dwords, Tensor(a!) out) -> ()", &pack_panels);
    m.def("read_pass(Tensor src, int streams) -> int", &read_pass);
    m.def("best_isa() -> int", &kvlm::best_isa);
    m.def("isa_available(int isa) -> bool", &kvlm::isa_available);
    m.def("qmatmul(Tensor x, Tensor w, int qtype, int K, int isa, Tensor(a!) out) -> ()", &qmatmul);
    m.def("qmatmul_i8(Tensor x, Tensor w, int qtype, int K, int isa, Tensor(a!) out) -> ()", &qmatmul_i8);
    m.def("qmatmul_parts(Tensor x, Tensor[] ws, int[] qtypes, int K, int isa, bool int8, Tensor(a!) out) -> ()",
          &qmatmul_parts);
    m.def("expert_qmatmul(Tensor x, Tensor w, Tensor counts, int qtype, int K, int isa, bool int8, Tensor(a!) out) -> ()",
          &expert_qmatmul);
    m.def("fake_quantize_act(Tensor x, int isa, Tensor(a!) out) -> ()", &fake_quantize_act);
    m.def("dequantize(Tensor w, int qtype, int K, int isa, Tensor(a!) out) -> ()", &dequantize);
    m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
          "float scale, int isa, Tensor(a!) out, Tensor? k0_delta=None, Tensor? k0_seqs=None) -> ()",
          &paged_decode_attention);
    m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_ids, "
          "Tensor ctx_lens, float scale, int isa, Tensor(a!) out, int window=0, Tensor? k0_delta=None, "
          "Tensor? k0_seqs=None) -> ()", &paged_attention);
}
