// The routed MLP of mixture-of-experts models in one native call (drivers.h, moe_mlp): router, top-k, the
// grouped expert matmuls and the weighted sum. The module path (kvlm/model/moe.py, torch op moe_mlp) and the
// fused decode step (decode.cpp) both run this function, so a token's routed-MLP bits are the same whichever
// path computes it, and, every step being row by row, in any batch, chunk or thread split.
// Intermediates live in this thread's buffers, kept between calls; a step too big for moe_budget bytes of
// them runs in passes of whole tokens (rows are independent: the same bits), so they stay bounded.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // _mm_pause
#endif

#include "drivers.h"
#include "elementwise.h"

namespace kvlm {

void moe_route(const float* logits, int64_t E, int64_t k, bool renorm, int32_t* ids, float* w) {
    thread_local std::vector<float> p;
    thread_local std::vector<char> taken;
    if ((int64_t)p.size() < E) p.resize(E), taken.resize(E);
    softmax(logits, p.data(), E);
    std::fill(taken.begin(), taken.begin() + E, 0);
    // The largest logit not taken (the order of the probabilities, without their rounding: the native exp
    // clamps below e^-87.3, which would tie experts whose probabilities torch still tells apart); a tie
    // keeps the lower id (strict >).
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || logits[e] > logits[best])) best = e;
        taken[best] = 1;
        ids[j] = static_cast<int32_t>(best);
        w[j] = p[best];
    }
    if (renorm) {
        float s = 0.0f;
        for (int64_t j = 0; j < k; j++) s += w[j];
        for (int64_t j = 0; j < k; j++) w[j] = w[j] / s;
    }
}

namespace {

// o (n) = 0 + y_0 * w_0 + y_1 * w_1 + ...: each product rounded, then added (never fused, as the module
// path's `out + y * w`), in the order given (ascending expert id).
__attribute__((optimize("fp-contract=off")))
void combine_row(const float* ys, const int64_t* pos, const float* w, int64_t k, int64_t n, float* o) {
    for (int64_t i = 0; i < n; i++) o[i] = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        const float* y = ys + pos[j] * n;
        const float wj = w[j];
        for (int64_t i = 0; i < n; i++) {
            const float v = y[i] * wj;
            o[i] = o[i] + v;
        }
    }
}

template <typename T>
T* grow(std::vector<T>& v, int64_t n) {
    if ((int64_t)v.size() < n) v.resize(n);
    return v.data();
}

template <typename T>
int64_t held(const std::vector<T>& v) { return static_cast<int64_t>(v.capacity() * sizeof(T)); }

// This thread's work buffers: logits (T, E) | w (T, k) | rows (R, H): x gathered by expert (float32 gate /
// up), the down outputs | gu (R, 2I) | a (R, I) | gq, gd, gs, gi: x's int8 codes gathered by expert; aq, ad,
// as, ai: a's (experts_fused); seen (E,): the experts a step's passes touched (stats); ex, off, sync, bound:
// experts_fused's plan.
struct MoeBuffers {
    std::vector<float> logits, w, rows, gu, a, gd, gs, ad, as;
    std::vector<int32_t> ids, gi, ai;
    std::vector<int64_t> counts, next, pos, ex, off, sync, bound;
    std::vector<int8_t> gq, aq;
    std::vector<char> seen;
    int64_t bytes() const {
        return held(logits) + held(w) + held(rows) + held(gu) + held(a) + held(gd) + held(gs) + held(ad) +
               held(as) + held(ids) + held(gi) + held(ai) + held(counts) + held(next) + held(pos) + held(ex) +
               held(off) + held(sync) + held(bound) + held(gq) + held(aq) + held(seen);
    }
};
thread_local MoeBuffers buf;

// The most bytes of buffers one pass may use (at least one token's): 128 MiB is 598 OLMoE-1B-7B tokens
// (224 KB each by token_bytes), so a 512-token prefill stays one pass and a 2,048-token step (420 MB in
// one pass before) takes 4 of 512. moe_buffers changes it (tests).
std::atomic<int64_t> moe_budget{int64_t{128} << 20};

// The buffer bytes a pass needs per token: the sizes moe_pass grows buf to, and quantize_x's codes and
// scales (ops.cpp) of x and of the down projection's input (10 floats per 32 codes).
int64_t token_bytes(const MoeLayer& m) {
    const int64_t k = m.k, H = m.H, I = m.I, nb = H / 32;
    return 4 * m.E + k * (4 + 4 + 8) + k * 4 * (H + 3 * I) + k * (H + 4 * nb * 10) + (H + k * I) * 9 / 4;
}

// (token, expert) pairs up to which a pass runs its experts in one parallel region (experts_fused): decode
// at batch 1 to 4 with top 8. Larger steps have enough rows per expert that the per-projection loops of
// expert_matmul_multi split better.
constexpr int64_t FUSED_ROWS = 32;

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

// Few rows, every projection int8: gate, up, SiLU x up and down of the chosen experts in one parallel
// region, without the join between gate/up and down that two expert_matmul_multi calls have (a thread that
// finishes its gate/up panels early idles there; decode reads ~30 MB of experts a layer in ~1 ms, so a
// join's wait and wake-up are a visible share). The items are (expert, projection, 16-column panel) in
// expert-major order: an expert's gate panels, up panels, down panels. Each weighs the bytes its 16 weight
// rows hold times (rows + 2) (a rough cost: reading, plus the per-row arithmetic); unit u of nt (one per
// thread) takes the u-th nt-th of the total weight, a contiguous run of items, so at batch 1 (equal
// experts) each of 2 threads owns 4 whole experts. An expert's down panels wait for its gate and up: the
// unit that completes them (an atomic count of panels) computes the expert's SiLU x up rows and quantizes
// them (quantize_act, row by row), then publishes `ready`. A unit waits only on lower units (items are in
// expert-major order) and runs first its part of an expert it shares with the next unit, so waits are
// short, and units run one after another (nested, 1 thread) finish too. Each output row comes from the
// same kernel call on the same rows as in expert_matmul_multi, the activation from the same row
// functions: the bits of moe_pass's other path.
// g: x's codes gathered by expert (R rows, H); gu (R, 2I), a (R, I), y (R, H): as moe_pass's gu, a, rows.
bool experts_fused(const KvlmKernels* t, const MoeLayer& m, const int64_t* counts, const ActQ& g, int64_t R,
                   float* gu, float* a, float* y) {
    const int64_t E = m.E, H = m.H, I = m.I, nbH = H / 32, nbI = I / 32;
    const int64_t PG = (I + 15) / 16, PD = (H + 15) / 16, per = 2 * PG + PD;  // panels of a projection, an expert
    MoeBuffers& b = buf;
    int64_t* ex = grow(b.ex, E);
    int64_t* off = grow(b.off, E);
    int64_t nex = 0;
    for (int64_t e = 0, r = 0; e < E; r += counts[e], ++e)
        if (counts[e] > 0) ex[nex] = e, off[nex] = r, nex++;
    int8_t* aq = grow(b.aq, R * I);
    float* ad = grow(b.ad, R * nbI * 8);
    float* as = grow(b.as, R * nbI);
    int32_t* ai = grow(b.ai, R * nbI);
    int64_t* sync = grow(b.sync, 2 * nex);  // per expert: gate/up panels done, ready
    std::fill(sync, sync + 2 * nex, 0);
    const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), nex * per));
    // Unit boundaries in item index: bound[u] = the first item whose preceding weight reaches u / nt of all.
    const int64_t rs[3] = {m.gate.rs, m.up.rs, m.down.rs}, np[3] = {PG, PG, PD};
    int64_t total = 0;
    for (int64_t j = 0; j < nex; j++) total += (counts[ex[j]] + 2) * 16 * (rs[0] * PG + rs[1] * PG + rs[2] * PD);
    int64_t* bound = grow(b.bound, nt + 1);
    bound[0] = 0;
    int64_t v = 1;
    for (int64_t j = 0, cum = 0, i = 0; j < nex; j++)
        for (int p = 0; p < 3; cum += np[p] * ((counts[ex[j]] + 2) * 16 * rs[p]), i += np[p], p++) {
            const int64_t w = (counts[ex[j]] + 2) * 16 * rs[p];
            for (; v < nt && (cum + np[p] * w) * nt >= v * total; v++) {
                const int64_t need = v * total - cum * nt;  // the smallest c with (cum + c w) nt >= v total
                bound[v] = i + (need <= 0 ? 0 : (need + w * nt - 1) / (w * nt));
            }
        }
    for (; v <= nt; v++) bound[v] = nex * per;
    std::atomic<bool> ok{true};
    auto run = [&](int64_t jg, int p, int64_t p0, int64_t p1) {  // expert jg's panels [p0, p1) of projection p
        const int64_t e = ex[jg], r0 = off[jg], rows = counts[e];
        int64_t* done = sync + 2 * jg;
        if (p < 2) {
            const MoeWeight& w = p == 0 ? m.gate : m.up;
            if (t->gemv_i8(w.qtype, w.w + e * w.es, w.rs, H, g.q + r0 * H, g.d + 8 * r0 * nbH, g.s + r0 * nbH,
                           g.i + r0 * nbH, rows, gu + r0 * 2 * I + p * I, 2 * I, 16 * p0, std::min(I, 16 * p1)))
                ok = false;
            if (__atomic_add_fetch(done, p1 - p0, __ATOMIC_ACQ_REL) == 2 * PG) {  // this expert's gate and up are in
                for (int64_t r = r0; r < r0 + rows; r++) silu_mul(gu + r * 2 * I, gu + r * 2 * I + I, a + r * I, I);
                t->quantize_act(a + r0 * I, rows, I, aq + r0 * I, ad + 8 * r0 * nbI, as + r0 * nbI, ai + r0 * nbI);
                __atomic_store_n(done + 1, 1, __ATOMIC_RELEASE);
            }
            return;
        }
        for (int spin = 0; !__atomic_load_n(done + 1, __ATOMIC_ACQUIRE); spin++)
            if (spin < 256) cpu_relax(); else std::this_thread::yield();
        if (t->gemv_i8(m.down.qtype, m.down.w + e * m.down.es, m.down.rs, I, aq + r0 * I, ad + 8 * r0 * nbI,
                       as + r0 * nbI, ai + r0 * nbI, rows, y + r0 * H, H, 16 * p0, std::min(H, 16 * p1)))
            ok = false;
    };
    // Unit u's items [i0, i1) as runs of one expert's one projection; a last expert that the next unit
    // continues goes first (the next unit's down of it waits on these). Odd units run expert j + 1's gate
    // and up before expert j's down, so that while one thread streams the memory-bound gate/up of an
    // expert the other computes a down (Q6_K: compute-bound), not both the same kind at once.
    struct Run {
        int64_t key, jg;
        int p;
        int64_t p0, p1;
    };
    auto unit = [&](int64_t u, int64_t i0, int64_t i1) {
        thread_local std::vector<Run> runs;
        runs.clear();
        const int64_t split = i1 < nex * per && i1 % per != 0 ? i1 / per : -1;
        for (int64_t i = i0; i < i1;) {
            const int64_t jg = i / per, li = i % per;
            const int p = li < PG ? 0 : li < 2 * PG ? 1 : 2;
            const int64_t start = jg * per + (p == 0 ? 0 : p == 1 ? PG : 2 * PG), end = std::min(i1, start + np[p]);
            const int64_t key = jg == split ? -1 : p < 2 ? 2 * jg : 2 * (jg + u % 2) + 1;
            runs.push_back({key, jg, p, i - start, end - start});
            i = end;
        }
        std::stable_sort(runs.begin(), runs.end(), [](const Run& x, const Run& y) { return x.key < y.key; });
        for (const Run& r : runs) run(r.jg, r.p, r.p0, r.p1);
    };
    at::parallel_for(0, nt, 1, [&](int64_t u0, int64_t u1) {
        for (int64_t u = u0; u < u1; u++) unit(u, bound[u], bound[u + 1]);
    });
    return ok;
}

// One pass over T tokens: router, routing, grouping, experts, combine (moe_mlp's contract). Adds the rows
// routed to each expert to stats[0..E) and marks buf.seen.
bool moe_pass(const KvlmKernels* t, const MoeLayer& m, const float* x, int64_t T, float* out, int act) {
    const int64_t E = m.E, k = m.k, H = m.H, I = m.I, R = T * k;
    MoeBuffers& b = buf;
    float* logits = grow(b.logits, T * E);
    float* w = grow(b.w, R);
    float* rows = grow(b.rows, R * H);
    float* gu = grow(b.gu, R * 2 * I);
    float* a = grow(b.a, R * I);
    int32_t* ids = grow(b.ids, R);
    int64_t* counts = grow(b.counts, E);
    int64_t* next = grow(b.next, E);
    int64_t* pos = grow(b.pos, R);
    if (!matmul(t, m.router_qtype, m.router, m.router_rs, H, E, x, T, logits, E, act)) return false;
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
        for (int64_t r = t0; r < t1; r++) {
            int32_t* id = ids + r * k;
            float* wr = w + r * k;
            moe_route(logits + r * E, E, k, m.renorm, id, wr);
            for (int64_t j = 1; j < k; j++)  // the pairs by ascending id: the order the outputs are summed in
                for (int64_t i = j; i > 0 && id[i - 1] > id[i]; i--) std::swap(id[i - 1], id[i]), std::swap(wr[i - 1], wr[i]);
        }
    });
    // Pair r (token r / k) goes to grouped row pos[r]: experts in ascending id, tokens in order within one.
    std::fill(counts, counts + E, 0);
    for (int64_t r = 0; r < R; r++) counts[ids[r]]++;
    for (int64_t e = 0, acc = 0; e < E; acc += counts[e], e++) next[e] = acc;
    for (int64_t r = 0; r < R; r++) pos[r] = next[ids[r]]++;
    if (m.stats)
        for (int64_t e = 0; e < E; e++) m.stats[e] += counts[e], b.seen[e] |= counts[e] > 0;
    const ExpertProj gate_up[2] = {{m.gate.qtype, m.gate.w, m.gate.es, m.gate.rs, I, gu, 2 * I},
                                   {m.up.qtype, m.up.w, m.up.es, m.up.rs, I, gu + I, 2 * I}};
    bool fused = false;
    if (act == ACT_INT8 && has_int8(t, m.gate.qtype) && has_int8(t, m.up.qtype) && H % 32 == 0) {
        // int8 gate and up: quantize the T tokens' rows once (not their k copies; quantize_act is row by
        // row, so a row's codes are the same either way) and gather the codes into expert order.
        const int64_t nb = H / 32;
        int8_t* gq = grow(b.gq, R * H);
        float* gd = grow(b.gd, R * nb * 8);
        float* gs = grow(b.gs, R * nb);
        int32_t* gi = grow(b.gi, R * nb);
        const ActQ xq = quantize_x(t, x, T, H);
        at::parallel_for(0, R, std::max<int64_t>(1, 16384 / H), [&](int64_t r0, int64_t r1) {
            for (int64_t r = r0; r < r1; r++) {
                const int64_t src = r / k, dst = pos[r];
                std::memcpy(gq + dst * H, xq.q + src * H, H);
                std::memcpy(gd + dst * nb * 8, xq.d + src * nb * 8, sizeof(float) * nb * 8);
                std::memcpy(gs + dst * nb, xq.s + src * nb, sizeof(float) * nb);
                std::memcpy(gi + dst * nb, xq.i + src * nb, sizeof(int32_t) * nb);
            }
        });
        const ActQ g{gq, gd, gs, gi};
        fused = R <= FUSED_ROWS && has_int8(t, m.down.qtype) && I % 32 == 0;  // decode: one region
        if (!(fused ? experts_fused(t, m, counts, g, R, gu, a, rows)
                    : expert_matmul_multi(t, gate_up, 2, H, counts, E, nullptr, &g, R, act)))
            return false;
    } else {
        at::parallel_for(0, R, std::max<int64_t>(1, 16384 / H), [&](int64_t r0, int64_t r1) {
            for (int64_t r = r0; r < r1; r++) std::memcpy(rows + pos[r] * H, x + (r / k) * H, sizeof(float) * H);
        });
        if (!expert_matmul_multi(t, gate_up, 2, H, counts, E, rows, nullptr, R, act)) return false;
    }
    if (!fused) {
        at::parallel_for(0, R, std::max<int64_t>(1, 16384 / I), [&](int64_t r0, int64_t r1) {
            for (int64_t r = r0; r < r1; r++) silu_mul(gu + r * 2 * I, gu + r * 2 * I + I, a + r * I, I);
        });
        const ExpertProj down{m.down.qtype, m.down.w, m.down.es, m.down.rs, H, rows, H};  // rows: x is done with
        if (!expert_matmul_multi(t, &down, 1, I, counts, E, a, nullptr, R, act)) return false;
    }
    at::parallel_for(0, T, std::max<int64_t>(1, 8192 / (H * k)), [&](int64_t t0, int64_t t1) {
        for (int64_t r = t0; r < t1; r++) combine_row(rows, pos + r * k, w + r * k, k, H, out + r * H);
    });
    return true;
}

}  // namespace

int64_t moe_buffers(int64_t budget, bool release) {
    if (budget > 0) moe_budget = budget;
    if (release) buf = MoeBuffers{};
    return buf.bytes();
}

bool moe_mlp(const KvlmKernels* t, const MoeLayer& m, const float* x, int64_t T, float* out, int act) {
    if (T == 0) return true;
    // n passes of near-equal size (the first T % n one token longer), each within the budget
    const int64_t cap = std::max<int64_t>(1, moe_budget / token_bytes(m)), n = (T + cap - 1) / cap;
    if (m.stats) {
        char* seen = grow(buf.seen, m.E);
        std::fill(seen, seen + m.E, 0);
    }
    for (int64_t i = 0, t0 = 0; i < n; i++) {
        const int64_t len = T / n + (i < T % n ? 1 : 0);
        if (!moe_pass(t, m, x + t0 * m.H, len, out + t0 * m.H, act)) return false;
        t0 += len;
    }
    if (m.stats) {
        int64_t touched = 0;
        for (int64_t e = 0; e < m.E; e++) touched += buf.seen[e];
        m.stats[m.E] += 1, m.stats[m.E + 1] += touched;
    }
    return true;
}

}  // namespace kvlm

namespace {

void check_stack(const at::Tensor& w, int64_t E, int64_t N, const char* what) {
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 3 && w.stride(2) == 1 &&
                    w.size(0) == E && w.size(1) == N,
                "kvlm moe_mlp: ", what, " must be a CPU uint8 (", E, ", ", N, ", row_bytes) stack with contiguous rows");
}

// out (T, H) = the routed MLP of x (T, H) float32 (kvlm::moe_mlp). router (E, row_bytes) uint8 blocks of
// router_qtype; gate, up (E, I, row_bytes) and down (E, H, row_bytes) uint8 stacks of qtypes[0..2]; stats
// empty or (E + 2,) int64 counters (added to).
void moe_mlp_op(const at::Tensor& x, const at::Tensor& router, int64_t router_qtype, const at::Tensor& gate,
                const at::Tensor& up, const at::Tensor& down, at::IntArrayRef qtypes, int64_t k, bool renorm,
                int64_t isa, bool int8, const at::Tensor& stats, const at::Tensor& out) {
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
                "kvlm moe_mlp: x must be a contiguous float32 (T, H) CPU tensor");
    const int64_t T = x.size(0), H = x.size(1);
    TORCH_CHECK(router.device().is_cpu() && router.scalar_type() == at::kByte && router.dim() == 2 &&
                    router.stride(1) == 1, "kvlm moe_mlp: router must be a CPU uint8 (E, row_bytes) tensor");
    const int64_t E = router.size(0), I = gate.dim() == 3 ? gate.size(1) : -1;
    check_stack(gate, E, I, "gate");
    check_stack(up, E, I, "up");
    check_stack(down, E, H, "down");
    TORCH_CHECK(qtypes.size() == 3 && k >= 1 && k <= E, "kvlm moe_mlp: 3 expert types and 1 <= k <= E");
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == x.sizes(),
                "kvlm moe_mlp: out must be a contiguous float32 (T, H) tensor");
    int64_t* st = nullptr;
    if (stats.numel()) {
        TORCH_CHECK(stats.scalar_type() == at::kLong && stats.is_contiguous() && stats.numel() == E + 2,
                    "kvlm moe_mlp: stats must be contiguous int64 (E + 2,)");
        st = stats.mutable_data_ptr<int64_t>();
    }
    auto wt = [&](const at::Tensor& w, int64_t q) {
        return kvlm::MoeWeight{static_cast<int>(q), w.const_data_ptr<uint8_t>(), w.stride(0), w.stride(1)};
    };
    const kvlm::MoeLayer m{static_cast<int>(router_qtype), router.const_data_ptr<uint8_t>(), router.stride(0),
                           wt(gate, qtypes[0]), wt(up, qtypes[1]), wt(down, qtypes[2]), E, k, H, I, renorm, st};
    TORCH_CHECK(kvlm::moe_mlp(kvlm::table(isa), m, x.const_data_ptr<float>(), T, out.mutable_data_ptr<float>(),
                              int8 ? kvlm::ACT_INT8 : kvlm::ACT_F32),
                "kvlm moe_mlp: no kernel for a weight type");
}

// ids (T, k) int64, weights (T, k) float32 = each row of logits (T, E) routed (kvlm::moe_route), by
// descending probability.
void moe_route_op(const at::Tensor& logits, int64_t k, bool renorm, const at::Tensor& ids, const at::Tensor& weights) {
    TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                    logits.is_contiguous(), "kvlm moe_route: logits must be contiguous float32 (T, E)");
    const int64_t T = logits.size(0), E = logits.size(1);
    TORCH_CHECK(k >= 1 && k <= E, "kvlm moe_route: need 1 <= k <= E");
    TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.dim() == 2 && ids.size(0) == T &&
                    ids.size(1) == k && weights.scalar_type() == at::kFloat && weights.is_contiguous() &&
                    weights.sizes() == ids.sizes(), "kvlm moe_route: ids (T, k) int64 and weights (T, k) float32");
    std::vector<int32_t> id(k);
    for (int64_t r = 0; r < T; r++) {
        kvlm::moe_route(logits.const_data_ptr<float>() + r * E, E, k, renorm, id.data(),
                        weights.mutable_data_ptr<float>() + r * k);
        for (int64_t j = 0; j < k; j++) ids.mutable_data_ptr<int64_t>()[r * k + j] = id[j];
    }
}

// kvlm::moe_buffers: budget > 0 sets the bytes of work buffers one moe_mlp pass may use; release frees
// this thread's; returns the bytes this thread's buffers hold.
int64_t moe_buffers_op(int64_t budget, bool release) { return kvlm::moe_buffers(budget, release); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvlm_kernels, m) {
    m.def("moe_mlp(Tensor x, Tensor router, int router_qtype, Tensor gate, Tensor up, Tensor down, int[] qtypes, "
          "int k, bool renorm, int isa, bool int8, Tensor(a!) stats, Tensor(b!) out) -> ()", &moe_mlp_op);
    m.def("moe_route(Tensor logits, int k, bool renorm, Tensor(a!) ids, Tensor(b!) weights) -> ()", &moe_route_op);
    m.def("moe_buffers(int budget, bool release) -> int", &moe_buffers_op);
}
