// Quantize-on-write for the int8 / int4 KV cache (layout: kernels_attn_quant.h, kvlm/kernels/kv_quant.py).
// The fused decode step stores each new token's K/V with kv_quantize_rows, and
// torch.ops.kvlm_kernels.kv_quantize serves the module path. Defined in kv_quant.cpp, compiled for
// AVX-512, AVX2 and the baseline with GCC's target_clones (the loader picks the clone this CPU runs); every
// clone computes the same bits, kv_quant.quantize_ref's: each step is one IEEE operation in the same
// order (the Hadamard rotation's butterflies, amax or signed max (exact in any order), d = amax / 127
// (int8) or int4's scale search (kv_quant.py: candidates d = m / (Q4_LEVELS[0] t / 8), least-squares
// refits and squared errors summed in float64 in a fixed tree of halves), float16 by round-to-nearest-even
// (c10::Half), inv = 1 / d, int8: q = nearbyint(x * inv) under the default round-half-even mode, clamped;
// int4: the nearest of Q4_LEVELS to x * inv, counted by midpoints below it), so a token's codes are the
// same on every path. (The only multiply-adds a compiler may fuse, x - c d, x c and e^2 in float64, have
// exact products, so fusing them changes no bit.)
//
// Rotation: each head row is multiplied by a normalized Hadamard matrix (block-diagonal, blocks of the
// largest power of two dividing D) before it is quantized, spreading an outlier channel over the block
// so that one group's scale no longer has to cover it. H is orthonormal and symmetric (H H = I): attention
// rotates q the same way (q H . k H = q . k) and rotates its output back (kv_quant.py says which formats
// rotate: `kv_rotates`).
#pragma once
#include <cstdint>

namespace kvlm {

// int4's 16 levels in code order (kv_quant.py Q4_LEVELS): value = Q4_LEVELS[code] * d.
constexpr float Q4_LEVELS[16] = {-127, -102, -82, -66, -51, -38, -25, -12, 0, 13, 25, 39, 53, 69, 87, 111};

// Whether the format of `bits` stores Hadamard-rotated rows (kv_quant.py's KVQuantFormat.rotate).
constexpr bool kv_rotates(int64_t bits) { return bits == 4 || bits == 8; }

// The rotation's block: the largest power of two dividing D.
inline int64_t hadamard_block(int64_t D) { return D & -D; }

// rows x D floats <- each row times H, in place: per block of n, butterflies (a, b) -> (a + b, a - b) at
// strides 1, 2, 4, ..., then times 1 / sqrt(n) (float32): kv_quant.hadamard_ref's operations, in its order.
void hadamard_rows(float* x, int64_t rows, int64_t D);

// n floats (heads of D values each, n % D == 0, D % 32 == 0, D <= 1024) -> their codes of `bits` (8: groups
// of 34 bytes, float16 scale then 32 int8 codes; 4: groups of 18 bytes, float16 scale then byte j =
// c_j | c_{j+16} << 4), each head row rotated first where the format rotates (kv_rotates).
void kv_quantize_rows(const float* x, int64_t n, int64_t D, int64_t bits, uint8_t* dst);

}  // namespace kvlm
