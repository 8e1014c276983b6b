// torch.ops.kvlm_kernels.argmax_rows: the index of each row's maximum, torch.argmax(x, -1)'s answer
// (kvlm/kernels/argmax.py; tests/kernels/test_argmax.py checks ties, NaN, +-inf and +-0 against torch on
// every ISA path). torch's CPU argmax is a scalar loop, ~1 ns a float: 30-55 us for one warm 49k-token
// row of logits, about half a greedy step's sampling time. Here two vector passes: the maximum (and
// whether there is a NaN), then the first index holding it. torch counts NaN as the largest value and
// picks the first of equal maxima, so the answer is the first NaN if there is one, else the first index
// equal to the maximum (+0 and -0 compare equal, as in torch; a row of -inf gives 0). MAXPS(a, m) is `a > m ? a : m` (a NaN in
// a leaves m), exactly the scalar path's step, so every path returns the same index.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#if defined(__x86_64__) || defined(__i386__)
#define KVLM_ARGMAX_X86 1
#include <immintrin.h>
#endif

#include <cstdint>
#include <limits>

namespace {

// The first index at or after i in [0, V) that holds `best` (a NaN if `nan`), scalar.
int64_t first_from(const float* x, int64_t i, int64_t V, float best, bool nan) {
    for (; i < V; i++)
        if (nan ? x[i] != x[i] : x[i] == best) return i;
    return V;
}

// The vector passes' scalar ends: the largest of n lane maxima and of x[i..V) (the tail), and whether
// the tail holds a NaN (ORed into *nan).
[[maybe_unused]] float reduce_tail(const float* lanes, int n, const float* x, int64_t i, int64_t V, bool* nan) {
    float best = -std::numeric_limits<float>::infinity();
    for (int k = 0; k < n; k++) best = lanes[k] > best ? lanes[k] : best;
    for (; i < V; i++) {
        best = x[i] > best ? x[i] : best;
        *nan |= x[i] != x[i];
    }
    return best;
}

int64_t argmax_scalar(const float* x, int64_t V) {
    float best = -std::numeric_limits<float>::infinity();
    bool nan = false;
    for (int64_t i = 0; i < V; i++) {
        best = x[i] > best ? x[i] : best;
        nan |= x[i] != x[i];
    }
    return first_from(x, 0, V, best, nan);
}

#if defined(KVLM_ARGMAX_X86)  // the vector passes; other CPUs (aarch64) take the scalar one

__attribute__((target("avx2"))) int64_t argmax_avx2(const float* x, int64_t V) {
    const float ninf = -std::numeric_limits<float>::infinity();
    __m256 m0 = _mm256_set1_ps(ninf), m1 = m0;
    __m256 un = _mm256_setzero_ps();  // all ones in a lane that saw a NaN
    int64_t i = 0;
    for (; i + 16 <= V; i += 16) {  // two accumulators hide the max's latency
        const __m256 a = _mm256_loadu_ps(x + i), c = _mm256_loadu_ps(x + i + 8);
        m0 = _mm256_max_ps(a, m0);
        m1 = _mm256_max_ps(c, m1);
        un = _mm256_or_ps(un, _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(c, c, _CMP_UNORD_Q)));
    }
    alignas(32) float lanes[16];
    _mm256_store_ps(lanes, m0);
    _mm256_store_ps(lanes + 8, m1);
    bool nan = _mm256_movemask_ps(un) != 0;
    const float best = reduce_tail(lanes, 16, x, i, V, &nan);
    const __m256 b = _mm256_set1_ps(best);
    int64_t j = 0;
    for (; j + 32 <= V; j += 32) {  // 32 values a test; the block with a hit is then scanned
        const __m256 v0 = _mm256_loadu_ps(x + j), v1 = _mm256_loadu_ps(x + j + 8);
        const __m256 v2 = _mm256_loadu_ps(x + j + 16), v3 = _mm256_loadu_ps(x + j + 24);
        const __m256 h = nan ? _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(v0, v0, _CMP_UNORD_Q),
                                                         _mm256_cmp_ps(v1, v1, _CMP_UNORD_Q)),
                                            _mm256_or_ps(_mm256_cmp_ps(v2, v2, _CMP_UNORD_Q),
                                                         _mm256_cmp_ps(v3, v3, _CMP_UNORD_Q)))
                             : _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(v0, b, _CMP_EQ_OQ),
                                                         _mm256_cmp_ps(v1, b, _CMP_EQ_OQ)),
                                            _mm256_or_ps(_mm256_cmp_ps(v2, b, _CMP_EQ_OQ),
                                                         _mm256_cmp_ps(v3, b, _CMP_EQ_OQ)));
        if (_mm256_movemask_ps(h)) break;
    }
    return first_from(x, j, V, best, nan);
}

__attribute__((target("avx512f"))) int64_t argmax_avx512(const float* x, int64_t V) {
    const float ninf = -std::numeric_limits<float>::infinity();
    __m512 m0 = _mm512_set1_ps(ninf), m1 = m0;
    __mmask16 un = 0;  // lanes that saw a NaN
    int64_t i = 0;
    for (; i + 32 <= V; i += 32) {  // two accumulators hide the max's latency
        const __m512 a = _mm512_loadu_ps(x + i), c = _mm512_loadu_ps(x + i + 16);
        m0 = _mm512_max_ps(a, m0);
        m1 = _mm512_max_ps(c, m1);
        un = un | _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(c, c, _CMP_UNORD_Q);
    }
    alignas(64) float lanes[32];
    _mm512_store_ps(lanes, m0);
    _mm512_store_ps(lanes + 16, m1);
    bool nan = un != 0;
    const float best = reduce_tail(lanes, 32, x, i, V, &nan);
    const __m512 b = _mm512_set1_ps(best);
    int64_t j = 0;
    for (; j + 64 <= V; j += 64) {  // 64 values a test; the block with a hit is then scanned
        const __m512 v0 = _mm512_loadu_ps(x + j), v1 = _mm512_loadu_ps(x + j + 16);
        const __m512 v2 = _mm512_loadu_ps(x + j + 32), v3 = _mm512_loadu_ps(x + j + 48);
        const __mmask16 h = nan ? (_mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q) |
                                   _mm512_cmp_ps_mask(v2, v2, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v3, v3, _CMP_UNORD_Q))
                                : (_mm512_cmp_ps_mask(v0, b, _CMP_EQ_OQ) | _mm512_cmp_ps_mask(v1, b, _CMP_EQ_OQ) |
                                   _mm512_cmp_ps_mask(v2, b, _CMP_EQ_OQ) | _mm512_cmp_ps_mask(v3, b, _CMP_EQ_OQ));
        if (h) break;
    }
    return first_from(x, j, V, best, nan);
}

#endif

// x (B, V) float32 with contiguous rows (any row stride), V >= 1; out (B,) int64 contiguous; isa as in
// drivers.h (0 scalar, 1 AVX2, 2, 3 and 8 AVX-512, 7 AVX2 + AVX-VNNI: the caller passes one this CPU has;
// the aarch64 ids 4-6 take the scalar pass).
void argmax_rows(const at::Tensor& x, const at::Tensor& out, int64_t isa) {
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 &&
                    x.size(1) > 0,
                "argmax_rows: x must be a (B, V) float32 CPU tensor with contiguous rows and V >= 1");
    TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kLong && out.dim() == 1 && out.is_contiguous() &&
                    out.size(0) == x.size(0),
                "argmax_rows: out must be a contiguous (B,) int64 CPU tensor");
    TORCH_CHECK(isa >= 0 && isa <= 8, "argmax_rows: isa must be 0..8");
    if (isa == 7) isa = 1;  // AVX2 + AVX-VNNI: the AVX2 pass (no integer products here)
    if (isa == 8) isa = 2;  // AVX-512 + AMX: the AVX-512 pass
#if defined(KVLM_ARGMAX_X86)
    TORCH_CHECK(isa == 0 || isa > 3 || (isa == 1 ? __builtin_cpu_supports("avx2") : __builtin_cpu_supports("avx512f")),
                "argmax_rows: this CPU lacks the requested ISA");
    int64_t (*row)(const float*, int64_t) = isa > 3    ? argmax_scalar
                                             : isa >= 2 ? argmax_avx512
                                             : isa == 1 ? argmax_avx2
                                                        : argmax_scalar;
#else
    int64_t (*row)(const float*, int64_t) = argmax_scalar;
#endif
    const int64_t B = x.size(0), V = x.size(1), ld = x.stride(0);
    const float* base = x.const_data_ptr<float>();
    int64_t* o = out.mutable_data_ptr<int64_t>();
    // Grain 8: up to 8 rows (a few us each) stay on the calling thread (waking another costs about as much).
    at::parallel_for(0, B, 8, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++) o[r] = row(base + r * ld, V);
    });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvlm_kernels, m) {
    m.def("argmax_rows(Tensor x, Tensor(a!) out, int isa) -> ()", &argmax_rows);
}
