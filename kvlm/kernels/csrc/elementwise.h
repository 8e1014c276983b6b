// Element-wise kernels of a Llama layer on float32 rows: RMSNorm, rotate-half RoPE, SiLU(gate) x up.
// One implementation for both callers: the fused decode step (decode.cpp) and, through the torch ops in
// elementwise.cpp, the module path (kernels/elementwise.py, used by model.py for prefill and mixed
// steps). So a token's element-wise math has the same bits whichever path computes it: with int8
// activations a last-bit difference in a norm can move an activation across an int8 rounding step.
// Each works on one row in a fixed order, so a row's result never depends on its neighbours.
#pragma once
#include <stdint.h>

namespace kvlm {

// y[i] = x[i] / sqrt(mean(x^2) + eps) * w[i] over n floats (sum of squares in increasing i; y may be x).
void rmsnorm(const float* x, const float* w, float* y, int64_t n, float eps);

// HF rotate-half RoPE of one head of D floats in place: x * cos + roll(x, D/2) * sin, where the sin
// row is signed ([-sin, sin]) so that roll's sign change lives in the table.
void rope(float* x, const float* cos, const float* sin, int64_t D);

// a[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u over n floats (exp by a polynomial, about 2 ulp).
void silu_mul(const float* g, const float* u, float* a, int64_t n);

// a[i] = gelu_tanh(g[i]) * u[i] = g / (1 + exp(-2 sqrt(2/pi) (g + 0.044715 g^3))) * u (Gemma's GeGLU).
void gelu_tanh_mul(const float* g, const float* u, float* a, int64_t n);

// p[i] = exp(x[i] - max x) / sum_j exp(x[j] - max x) over n floats (exp as silu_mul's, the sum in increasing
// j): a mixture-of-experts router's probabilities (moe.cpp). p may be x.
void softmax(const float* x, float* p, int64_t n);

// A LoRA adapter's B product on one row, added to the base output y after it is complete (kvlm/lora/):
// for each of the P parts (spans: P x {r0, r, o0, n}, bt: the parts' B transposed, (r, n) each, packed one
// after another), u = sum_j t[r0 + j] * bt_p[j, :] in increasing j (u = t0 * b0, then u = u + tj * bj: a
// multiply and an add per term, never fused), then y[o0 + i] += u[i]. Columns of y outside the parts are
// untouched; only columns c0 <= o < c1 are computed (the fused step splits them across threads). u: scratch
// of at least c1 - c0 floats. Lane-wise, so a value's bits depend neither on the row's neighbours nor on the
// column split.
void lora_b_add(const float* t, const float* bt, const int64_t* spans, int64_t P, float* y, float* u, int64_t c0,
                int64_t c1);
// The same with B^T in bfloat16 (each value widened to float32 exactly before its multiply): the same bits as
// lora_b_add on those values in float32, half the bytes read.
void lora_b_add_bf16(const float* t, const uint16_t* bt, const int64_t* spans, int64_t P, float* y, float* u,
                     int64_t c0, int64_t c1);

}  // namespace kvlm
