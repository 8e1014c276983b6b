// The table of kernels one instruction set provides. Each ISA translation unit (isa_*.cpp) compiles
// kernels_impl.h under its own `#pragma GCC target` and returns one of these; ops.cpp picks the table
// at run time. Plain C types only: the ISA units include no torch or C++ standard headers, so no
// inline function compiled for AVX-512 can leak into code that runs on a CPU without it.
#pragma once
#include <stdint.h>

extern "C" {

// ggml type ids of the formats the kernels read (weights; F32/F16/BF16 also as KV cache element types).
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30 };
// A type id's flag: the weight's rows are packed in 16-row panels (kvlm/kernels/panels.py; Q4_K on the
// AVX-512 units' int8 kernel only, kernels_kquant_panels.h). Other kernels refuse such an id.
constexpr int PANELS16 = 0x100;
// Quantized KV cache formats (not ggml ids; kernels_attn_quant.h, kvlm/kernels/kv_quant.py): int8 / int4
// codes with a float16 scale per 32 values, caches (num_blocks, block_size, kv_heads, D / 32 * 34 or 18) bytes.
enum { KV_Q8 = 1008, KV_Q4 = 1004 };

// One paged attention call over T query rows (kvlm::paged_attention_rows in ops.cpp builds it). Row t
// is one query token, q (T, H, D) float32, of the sequence whose block table is row seq_ids[t] of
// block_tables (B, max_blocks) (seq_ids NULL: row t reads table t), attending its first ctx_lens[t]
// cached tokens; out (T, H, D) float32. Caches (num_blocks, block_size, kv_heads, D) of kv_dtype (ggml
// ids: 0 float32, 1 float16, 30 bfloat16; or KV_Q8 / KV_Q4 codes, D % 32 == 0); D % 16 == 0; query head
// h uses kv head h / (H / kv_heads).
//
// Exactness contract: every row is computed as if it were decoded alone with L = ctx_lens[t]: its
// tokens split into chunks of `chunk` (a multiple of 16) at multiples of `chunk`, each chunk in groups of
// 16 tokens (q . K with lane k % 16 accumulating in increasing k, the ISA's fixed sum16 tree, times
// scale; tokens >= L masked to -inf), the chunk's own softmax (max, exp, lane sums) and p * V in token
// order; L <= chunk normalizes straight into out, a longer row combines its chunks' states in chunk
// order (attn_combine). Nothing of that depends on which rows share the call, their order, the tiling
// or the thread split, so a row's bits are the same alone, in any batch, at any thread count.
// A sliding window (window > 0: a row attends its last `window` tokens, positions L - window .. L - 1)
// masks the positions before L - window to -inf in the row's first live chunk and skips the chunks wholly
// before it: still a function of the row's query, L and window only.
//
// Tiling (the speed for prefill rows, which share their sequence's K/V): `order` lists the rows grouped
// by sequence, by ascending ctx_len within one; tile k is rows order[tiles[2k] .. tiles[2k] + tiles[2k+1])
// (at most KVLM_ATTN_TILE rows of one sequence). Work item i is chunk items[3i + 1] of tile items[3i]:
// every row of the tile with tokens in that chunk, the heads of kv-head share items[3i + 2] (all heads when
// kv_split is 1), so each 16-token K/V group is read from memory once per tile and share. A tile whose
// longest row has one chunk writes out directly. Otherwise each item writes the partial softmax states
// of its multi-chunk rows, row j of the tile and chunk c at part + (part_first[k] + j * nc + c) * H * (D + 2)
// (acc (H, D), then max (H), then denominator (H)), nc the tile's chunk count, and decrements pending[k]
// (set by the caller to the tile's items: nc times kv_split); the item that brings it to 0 combines those rows.
enum { KVLM_ATTN_TILE = 16 };  // rows per tile

typedef struct KvlmPagedAttn {
    int kv_dtype;
    const float* q;
    const void* k_cache;
    const void* v_cache;
    const int32_t* block_tables;
    const int32_t* seq_ids;   // (T,) or NULL
    const int32_t* ctx_lens;  // (T,)
    float* out;
    int64_t H, kv_heads, D, block_size, max_blocks, chunk;
    float scale;
    const int32_t* order;       // (T,)
    const int32_t* tiles;       // (n_tiles, 2): first index into order, rows
    const int32_t* items;       // (n_items, 3): tile, chunk index, kv-head share (of kv_split)
    const int64_t* part_first;  // (n_tiles,): index of the tile's first partial state
    float* part;                // (sum over multi-chunk tiles of rows * nc, H, D + 2)
    int32_t* pending;           // (n_tiles,)
    int64_t window;             // > 0: each row attends only its last `window` tokens (sliding window)
    // A centered int8 / int4 cache whose position-0 keys are stored centered on their own mean (k0, not mu:
    // kvlm/kv_cache/k_center.py): k0_delta (kv_heads, D) = (k0 - mu) H, NULL for none. The score of a row's
    // token 0 gets scale * (q . k0_delta[kv head]) added (q as given: rotated), for the rows whose
    // sequence's token 0 is its position-0 key: k0_seqs[seq] != 0 (k0_seqs NULL: every sequence).
    const float* k0_delta;
    const uint8_t* k0_seqs;
    // An item of share s covers kv heads [s KVH / kv_split, (s + 1) KVH / kv_split) and their query heads: a
    // call with fewer (tile, chunk) items than threads (a short decode) splits each into kv_split items.
    int64_t kv_split;
} KvlmPagedAttn;

typedef struct KvlmKernels {
    // y[m, n] = sum_k x[m, k] * W[n, k] for rows n in [n0, n1); W row n starts at w + n * row_stride.
    // x (M, K) contiguous, y (M, ldy). Returns 0, or -1 for a type this table does not handle.
    int (*gemv)(int qtype, const uint8_t* w, int64_t row_stride, int64_t K, const float* x, int64_t M,
                float* y, int64_t ldy, int64_t n0, int64_t n1);
    // out[n - n0, :] = dequantized row n for n in [n0, n1); out rows are `ldo` floats apart.
    int (*dequant)(int qtype, const uint8_t* w, int64_t row_stride, int64_t K, float* out, int64_t ldo,
                   int64_t n0, int64_t n1);
    // Paged attention for work items [i0, i1) of a->items (see KvlmPagedAttn); `scores` is this thread's
    // scratch of KVLM_ATTN_TILE * a->H * (a->chunk + 2) floats. Returns 0, or -1 for an unsupported kv_dtype.
    int (*paged_attn)(const struct KvlmPagedAttn* a, float* scores, int64_t i0, int64_t i1);
    // Int8-activation matmul (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; every unit, kernels_int8.h): x is first
    // quantized per 32-element block by quantize_act (xq (M, K) int8, xd (M, K/32, 8) the block scale
    // repeated 8 times, xs (M, K/32) the block's fake-quantized sum d * sum(q), xi (M, K/32) sum(q)).
    // gemv_i8 runs fastest with n0 (and n1, unless n1 == N) multiples of 16 (AVX-512 column panels).
    void (*quantize_act)(const float* x, int64_t M, int64_t K, int8_t* xq, float* xd, float* xs, int32_t* xi);
    int (*gemv_i8)(int qtype, const uint8_t* w, int64_t row_stride, int64_t K, const int8_t* xq, const float* xd,
                   const float* xs, const int32_t* xi, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1);
} KvlmKernels;

const KvlmKernels* kvlm_kernels_scalar(void);
const KvlmKernels* kvlm_kernels_avx2(void);
const KvlmKernels* kvlm_kernels_avx2_vnni(void);  // AVX2 + AVX-VNNI: vpdpbusd on ymm in the int8 kernels
const KvlmKernels* kvlm_kernels_avx512(void);
const KvlmKernels* kvlm_kernels_avx512_vnni(void);  // AVX-512 + VNNI: vpdpbusd in the int8 kernels
const KvlmKernels* kvlm_kernels_avx512_amx(void);   // AVX-512 VNNI + AMX tiles for the int8 kernels' many rows
const KvlmKernels* kvlm_kernels_neon(void);          // aarch64 only: NEON (smull + sadalp in the int8 kernels)
const KvlmKernels* kvlm_kernels_neon_dotprod(void);  // aarch64 only: NEON + sdot
const KvlmKernels* kvlm_kernels_neon_i8mm(void);     // aarch64 only: NEON + sdot + smmla (i8mm)

}
