// Thread-parallel drivers over one ISA table: the C++ entry points shared by the torch bindings
// (ops.cpp) and the fused decode step (decode.cpp). Raw pointers and sizes only; the callers check
// shapes. Each driver splits its work with at::parallel_for (torch's OpenMP pool) so that a row's or
// a sequence's result never depends on the thread split, the batch size or which rows share the call.
#pragma once
#include <stdint.h>

#include "kernels.h"

namespace kvlm {

constexpr int64_t ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_VNNI = 3;  // AVX-512 + vpdpbusd
constexpr int64_t ISA_NEON = 4, ISA_NEON_DOTPROD = 5, ISA_NEON_I8MM = 6;  // aarch64: NEON, + sdot, + sdot and smmla
constexpr int64_t ISA_AVX2_VNNI = 7;  // AVX2 + AVX-VNNI: not in the x86 order above (AVX-512 CPUs may lack it)
constexpr int64_t ISA_AVX512_AMX = 8;  // AVX-512 VNNI + AMX tiles (the int8 kernels' many-row case): past the order's top
// (the ids are not an order across arches)
constexpr int ACT_F32 = 0, ACT_INT8 = 1;  // activation mode of a matmul

int64_t best_isa();
// Whether this CPU runs `isa`'s table: scalar everywhere; on x86 the x86 ids up to the best; on aarch64 neon
// and, where the CPU has sdot, neon-dotprod, and where it also has i8mm, neon-i8mm.
bool isa_available(int64_t isa);
// The table of `isa` (throws a c10::Error if this CPU lacks it).
const KvlmKernels* table(int64_t isa);

// y (M, ldy)[:, 0:N] = x (M, K) @ W.T, W given by N rows of GGUF blocks (row n at w + n * rs).
// act == ACT_INT8 quantizes x per 32-element block first (Q4_0, Q4_1, Q8_0 on the AVX2 / AVX-512
// tables; other types fall back to float32 activations), for any M: a row's result is the same bits
// alone, in a batch or in a prefill chunk. Returns false for a type this table cannot handle.
bool matmul(const KvlmKernels* t, int qtype, const uint8_t* w, int64_t rs, int64_t K, int64_t N, const float* x,
            int64_t M, float* y, int64_t ldy, int act);

// A layer's weight kept in separate parts (q / k / v, gate / up): part j's (N, K) rows at w, rs apart, in ggml
// type qtype; its output columns at y, rows ldy floats apart (the parts side by side in one output).
struct MatPart {
    int qtype;
    const uint8_t* w;
    int64_t rs, N;
    float* y;
    int64_t ldy;
};
constexpr int MAX_PARTS = 4;

// Each part's y (M, ldy)[:, 0:N] = x (M, K) @ W_j.T in one call: x quantized once (ACT_INT8, for the parts with
// an int8 kernel), one parallel loop in which each task takes the same share of every part's panels. Each
// column has the bits `matmul` gives its part alone.
bool matmul_parts(const KvlmKernels* t, const MatPart* parts, int np, int64_t K, const float* x, int64_t M, int act);

// x (M, K) quantized to int8 per 32-element block (quantize_act): q (M, K) int8, d (M, K/32, 8) expanded
// scales, s (M, K/32) block sums d * sum(q), i (M, K/32) sum(q). quantize_x fills this thread's buffers
// (grown to the largest call, kept): valid until its next call on the same thread.
struct ActQ {
    const int8_t* q;
    const float* d;
    const float* s;
    const int32_t* i;
};
ActQ quantize_x(const KvlmKernels* t, const float* x, int64_t M, int64_t K);

// One projection of a mixture-of-experts layer for expert_matmul_multi: expert e's (N, K) weight at
// w + e * es, rows rs apart, in ggml type qtype; its output rows go to y, ldy floats apart.
struct ExpertProj {
    int qtype;
    const uint8_t* w;
    int64_t es, rs, N;
    float* y;
    int64_t ldy;
};

// Mixture-of-experts (llama.cpp's mul_mat_id) for 1 or 2 projections reading the same rows x (R, K) grouped
// by expert in ascending id (counts[e] rows each): x quantized once (ACT_INT8; a: x already quantized, or
// null), one parallel loop over (projection, expert, column panel) items. Each row has the bits `matmul`
// gives it on its expert alone.
bool expert_matmul_multi(const KvlmKernels* t, const ExpertProj* proj, int np, int64_t K, const int64_t* counts,
                         int64_t E, const float* x, const ActQ* a, int64_t R, int act);

// Mixture-of-experts (llama.cpp's mul_mat_id): y (R, N) = x (R, K) rows grouped by expert in ascending id
// (counts[e] rows each), each group times W_e.T (W_e at w + e * es, rows rs apart); x quantized once for
// ACT_INT8. Threads split over (expert, column panel) items; each row has the bits `matmul` gives it on
// its expert alone.
bool expert_matmul(const KvlmKernels* t, int qtype, const uint8_t* w, int64_t es, int64_t rs, int64_t K, int64_t N,
                   const int64_t* counts, int64_t E, const float* x, int64_t R, float* y, int act);

// A mixture-of-experts MLP (moe.cpp): the router's (E, H) rows at router, router_rs apart, in ggml type
// router_qtype; the experts' gate and up (E, I, H) and down (E, H, I) stacks as the GGUF stores them (expert
// e's rows at w + e * es, rs apart); the top k of E per token, renormalised where renorm. stats: null, or
// (E + 2) int64 counters the call adds to: rows routed to each expert, calls, experts touched.
struct MoeWeight {
    int qtype;
    const uint8_t* w;
    int64_t es, rs;
};
struct MoeLayer {
    int router_qtype;
    const uint8_t* router;
    int64_t router_rs;
    MoeWeight gate, up, down;
    int64_t E, k, H, I;
    bool renorm;
    int64_t* stats;
};

// One token's routing from its router logits (E,): softmax (elementwise.h), the top k by logit (the
// probabilities' order) with ties by ascending expert id, the k weights divided by their sum (in that order) where renorm. ids and w
// (k,) in that order (by descending probability).
void moe_route(const float* logits, int64_t E, int64_t k, bool renorm, int32_t* ids, float* w);

// out (T, H) = the routed MLP of rows x (T, H): router logits (matmul), moe_route per row, the (token,
// expert) pairs grouped by expert (tokens in order within one), gate and up in one expert_matmul_multi on x
// quantized once, silu(gate) * up, down, and each token's k outputs times their weights summed in ascending
// expert id from zero (a multiply, then an add). Every step is a function of the row alone: a token's bits
// do not depend on T, its neighbours or the thread split. Returns false for a type without a kernel.
// A step whose work buffers would pass the budget (moe_buffers; 128 MiB) runs in passes of near-equal token
// counts, the same bits (rows are independent), so this thread's buffers stay within about the budget.
bool moe_mlp(const KvlmKernels* t, const MoeLayer& m, const float* x, int64_t T, float* out, int act);

// budget > 0: the bytes of work buffers one moe_mlp pass may use from now on (at least one token's);
// release: free this thread's. Returns the bytes this thread's moe_mlp buffers hold.
int64_t moe_buffers(int64_t budget, bool release);

// Whether `matmul` with ACT_INT8 runs the int8 kernel for this type here (else it uses float32 activations).
bool has_int8(const KvlmKernels* t, int qtype);

// out (T, H, D) = attention of the query rows q (T, H, D): row t over the first ctx_lens[t] cached tokens
// of the sequence whose block table is row seq_ids[t] of block_tables (B, MB) (seq_ids NULL: row t),
// caches (num_blocks, BS, KVH, D) of kv_dtype (ggml id). Row t's bits are those of a decode of that row
// alone with L = ctx_lens[t], at any T, row order, mix of sequences and thread count (KvlmPagedAttn);
// rows of one sequence are tiled so each K/V group is read once per tile. The caller has checked the
// tables. window > 0: row t attends only its last `window` tokens (a sliding-window layer). k0_delta,
// k0_seqs: the position-0 key's center correction (KvlmPagedAttn), NULL for none. Returns false for an
// unsupported kv_dtype.
bool paged_attention_rows(const KvlmKernels* t, int kv_dtype, const float* q, const void* k_cache,
                          const void* v_cache, const int32_t* block_tables, const int32_t* seq_ids,
                          const int32_t* ctx_lens, float* out, int64_t T, int64_t H, int64_t KVH, int64_t D,
                          int64_t BS, int64_t MB, float scale, int64_t window = 0,
                          const float* k0_delta = nullptr, const uint8_t* k0_seqs = nullptr);

// Decode: out (B, H, D) = attention of q (B, H, D), sequence b over its seq_lens[b] cached tokens through
// block table row b; paged_attention_rows with seq_ids = 0 .. B - 1.
bool paged_attention(const KvlmKernels* t, int kv_dtype, const float* q, const void* k_cache, const void* v_cache,
                     const int32_t* block_tables, const int32_t* seq_lens, float* out, int64_t B, int64_t H,
                     int64_t KVH, int64_t D, int64_t BS, int64_t MB, float scale,
                     const float* k0_delta = nullptr, const uint8_t* k0_seqs = nullptr);

}  // namespace kvlm
