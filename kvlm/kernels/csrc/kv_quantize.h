// Quantize-on-write for the int8 / int4 KV cache (layout: kernels_attn_quant.h, kvlm/kernels/kv_quant.py).
// Plain C++ (no ISA pragmas): the fused decode step stores each new token's K/V with it, and
// torch.ops.kvlm_kernels.kv_quantize serves the module path. The bits equal kv_quant.quantize_ref's:
// every step is one IEEE float32 operation in the same order (the Hadamard rotation's butterflies, amax
// or signed max, d = amax / 127 or m / -8, float16 by round-to-nearest-even (c10::Half), inv = 1 / d,
// q = nearbyint(x * inv) under the default round-half-even mode, clamped), so a token's codes are the
// same on every path.
//
// Rotation: each head row is multiplied by a normalized Hadamard matrix (block-diagonal, blocks of the
// largest power of two dividing D) before it is quantized, spreading an outlier channel over the block
// so that one group's scale no longer has to cover it. H is orthonormal and symmetric (H H = I): attention
// rotates q the same way (q H . k H = q . k) and rotates its output back (kv_quant.py says which formats
// rotate: `kv_rotates`).
#pragma once
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvlm {

// Whether the format of `bits` stores Hadamard-rotated rows (kv_quant.py's KVQuantFormat.rotate).
constexpr bool kv_rotates(int64_t bits) { return bits == 4 || bits == 8; }

// The rotation's block: the largest power of two dividing D.
inline int64_t hadamard_block(int64_t D) { return D & -D; }

// x (D floats) <- x H in place: per block of n, butterflies (a, b) -> (a + b, a - b) at strides 1, 2, 4,
// ..., then times 1 / sqrt(n) (float32): kv_quant.hadamard_ref's operations, in its order.
inline void hadamard_row(float* x, int64_t D) {
    const int64_t n = hadamard_block(D);
    const float s = 1.0f / std::sqrt(static_cast<float>(n));
    for (int64_t o = 0; o < D; o += n) {
        float* b = x + o;
        for (int64_t h = 1; h < n; h <<= 1)
            for (int64_t i = 0; i < n; i += 2 * h)
                for (int64_t j = i; j < i + h; j++) {
                    const float u = b[j], v = b[j + h];
                    b[j] = u + v;
                    b[j + h] = u - v;
                }
        for (int64_t j = 0; j < n; j++) b[j] *= s;
    }
}

// d (float32) -> its float16 bits (a zero scale +0.0, saturated at 65504) and the float32 inverse of it.
inline void kv_scale(float d, uint8_t* dst, float* inv) {
    d = d == 0.0f ? 0.0f : std::fmin(std::fmax(d, -65504.0f), 65504.0f);
    const c10::Half h(d);
    std::memcpy(dst, &h.x, 2);
    const float df = static_cast<float>(h);
    *inv = df != 0.0f ? 1.0f / df : 0.0f;
}

// n floats (n % 32 == 0) -> n / 32 groups of 34 bytes (float16 scale, 32 int8 codes).
inline void kv_quantize_q8(const float* x, int64_t n, uint8_t* dst) {
    for (int64_t g = 0; g < n; g += 32, dst += 34) {
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = std::fmax(amax, std::fabs(x[g + i]));
        float inv;
        kv_scale(amax / 127.0f, dst, &inv);
        for (int i = 0; i < 32; i++) {
            const float q = std::fmin(std::fmax(std::nearbyint(x[g + i] * inv), -127.0f), 127.0f);
            dst[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(q));
        }
    }
}

// n floats (n % 32 == 0) -> n / 32 groups of 18 bytes (float16 scale, byte j = c_j | c_{j+16} << 4).
inline void kv_quantize_q4(const float* x, int64_t n, uint8_t* dst) {
    for (int64_t g = 0; g < n; g += 32, dst += 18) {
        float hi = x[g], lo = x[g];
        for (int i = 1; i < 32; i++) hi = std::fmax(hi, x[g + i]), lo = std::fmin(lo, x[g + i]);
        float inv;
        kv_scale((hi >= -lo ? hi : lo) / -8.0f, dst, &inv);
        uint8_t c[32];
        for (int i = 0; i < 32; i++)
            c[i] = static_cast<uint8_t>(std::fmin(std::fmax(std::nearbyint(x[g + i] * inv), -8.0f), 7.0f) + 8.0f);
        for (int j = 0; j < 16; j++) dst[2 + j] = static_cast<uint8_t>(c[j] | (c[j + 16] << 4));
    }
}

// n floats (heads of D values each, n % D == 0, D % 32 == 0) -> their codes of `bits` (8 or 4), each head
// row rotated first where the format rotates (kv_rotates).
inline void kv_quantize_rows(const float* x, int64_t n, int64_t D, int64_t bits, uint8_t* dst) {
    float buf[1024];
    const int64_t gb = bits == 8 ? 34 : 18;
    for (int64_t o = 0; o < n; o += D, dst += D / 32 * gb) {
        const float* src = x + o;
        if (kv_rotates(bits) && D <= 1024) {
            std::memcpy(buf, src, sizeof(float) * D);
            hadamard_row(buf, D);
            src = buf;
        }
        if (bits == 8) kv_quantize_q8(src, D, dst);
        else kv_quantize_q4(src, D, dst);
    }
}

}  // namespace kvlm
