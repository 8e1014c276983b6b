// Quantized K/V cache element types for the paged attention kernel (kernels_impl.h includes this inside
// its ISA unit, after its vector helpers): int8 and int4 codes read in place, 16 (or 8) values at a time.
//
// Layout (kvlm/kernels/kv_quant.py documents and quantizes it): a token's head row of D values is D / 32
// groups of 32 consecutive values; group j starts at byte j * GB of the row.
//   KvQ8, GB = 34: float16 scale d (bytes 0-1), then 32 int8 codes q_i;         value i = q_i * d
//   KvQ4, GB = 18: float16 scale d, then 16 bytes, byte j = c_j | c_{j+16} << 4; value i = L[c_i] * d, L the
//   16 integer levels of kv_quantize.h (Q4_LEVELS), looked up by a vector permute (vpermps on AVX-512)
// The kernel never builds a float copy of a sequence: each load turns the codes of 16 values into floats
// (exact: small integers, or int4's integer levels) and multiplies by the group's scale, one float32 rounding, the same product
// as the reference's dequantize. So with a quantized cache every row computes exactly what the float32
// kernel computes over the dequantized values (tests/kernels/test_kv_quant.py checks the bits per ISA).
// AVX-512: vpmovsxbd / vpmovzxbd, AVX2 the same on 8-lane halves (load8), the baseline GCC vectors.
#pragma once

struct KvQ8 {
    typedef uint8_t T;
    static constexpr int64_t GB = 34;
    static constexpr int64_t head(int64_t D) { return D / 32 * GB; }
    KVLM_INLINE v16 load(const T* p, int64_t e) {  // e % 16 == 0
        const uint8_t* g = p + (e >> 5) * GB;
        const uint8_t* q = g + 2 + (e & 31);
#if defined(KVLM_AVX512)
        const v16 c = (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)));
#elif defined(KVLM_AVX2)
        const v16 c = join16<v16>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)q))),
                                  _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + 8)))));
#else
        const v16 c = tof_signed(q);
#endif
        return c * splat(f16(g));
    }
#if defined(KVLM_AVX2)
    KVLM_INLINE v8 load8(const T* p, int64_t e) {  // e % 8 == 0
        const uint8_t* g = p + (e >> 5) * GB;
        const v8 c = (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(g + 2 + (e & 31)))));
        return c * splat8(f16(g));
    }
#endif
};

struct KvQ4 {
    typedef uint8_t T;
    static constexpr int64_t GB = 18;
    static constexpr int64_t head(int64_t D) { return D / 32 * GB; }
    KVLM_INLINE v16 load(const T* p, int64_t e) {  // e % 16 == 0: values 0..15 (low nibbles) or 16..31 (high)
        const uint8_t* g = p + (e >> 5) * GB;
        const i16v b = widen(g + 2);
        const i16v c = (e & 16) ? (b >> 4) : (b & 15);
#if defined(__clang__)  // no variable __builtin_shuffle: the same table lookup lane by lane
        v16 t;
        for (int i = 0; i < 16; i++) t[i] = kvlm::Q4_LEVELS[c[i]];
        return t * splat(f16(g));
#else
        return __builtin_shuffle(ld(kvlm::Q4_LEVELS), c) * splat(f16(g));
#endif
    }
#if defined(KVLM_AVX2)
    KVLM_INLINE v8 load8(const T* p, int64_t e) {  // e % 8 == 0: bytes (e & 8) .. + 7, low or high nibbles
        const uint8_t* g = p + (e >> 5) * GB;
        __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(g + 2 + (e & 8))));
        b = (e & 16) ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, _mm256_set1_epi32(15));
        // levels 0..7 or 8..15 by the code's bit 3
        const __m256 lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(kvlm::Q4_LEVELS), b);
        const __m256 hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(kvlm::Q4_LEVELS + 8), b);
        const __m256 c = _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(b, 28)));
        return (v8)c * splat8(f16(g));
    }
#endif
};
