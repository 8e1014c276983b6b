// torch.ops.kvlm_kernels.apply_token_bitmask: a grammar's allowed-token bitmask applied to logits in place, the
// native twin of kvlm/structured/mask.py's apply_token_bitmask_ref (tests/structured/test_mask.py: same bits).
// No ISA pragma: a row is 49k floats that the lm_head has just written (in cache), and a word of all ones
// (most of a JSON string's vocabulary) is skipped without touching its 32 logits. Rows are independent, so
// they are split over torch's threads (any split writes the same bits).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <limits>

namespace {

// One row x (V floats) by its bitmask w (W words): -inf where a bit is 0, or where a token has no bit.
void mask_row(float* x, const uint32_t* w, int64_t V, int64_t W) {
    const int64_t full = std::min(W, V / 32);  // words whose 32 tokens all lie inside the row
    const float neg = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < full; i++) {
        const uint32_t m = w[i];
        if (m == 0xFFFFFFFFu) continue;  // all 32 allowed: untouched
        float* p = x + i * 32;
        if (m == 0) {
            for (int b = 0; b < 32; b++) p[b] = neg;
        } else {
            for (int b = 0; b < 32; b++)
                if (!((m >> b) & 1u)) p[b] = neg;
        }
    }
    for (int64_t t = full * 32; t < V; t++) {  // a last partial word, then ids with no bit at all
        const int64_t i = t / 32;
        if (i >= W || !((w[i] >> (t % 32)) & 1u)) x[t] = neg;
    }
}

// logits (B, V) float32, rows of V contiguous floats; bitmask (R, W) contiguous int32, bit t % 32 of word t / 32
// set where token t is allowed; rows (R,) int64, distinct: bitmask row j applies to logits row rows[j]. Every
// token of those rows whose bit is 0, or that has no bit (t >= 32 W), becomes -inf; nothing else is written.
void apply_token_bitmask(const at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
    TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                    logits.stride(1) == 1,
                "apply_token_bitmask: logits must be a (B, V) float32 CPU tensor with contiguous rows");
    TORCH_CHECK(bitmask.device().is_cpu() && bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 &&
                    bitmask.is_contiguous() && rows.scalar_type() == at::kLong && rows.dim() == 1 &&
                    rows.is_contiguous() && rows.size(0) == bitmask.size(0),
                "apply_token_bitmask: bitmask must be (R, W) contiguous int32 and rows (R,) int64");
    const int64_t B = logits.size(0), V = logits.size(1), ld = logits.stride(0);
    const int64_t R = bitmask.size(0), W = bitmask.size(1);
    float* base = logits.mutable_data_ptr<float>();
    const uint32_t* words = reinterpret_cast<const uint32_t*>(bitmask.const_data_ptr<int32_t>());
    const int64_t* rp = rows.const_data_ptr<int64_t>();
    for (int64_t j = 0; j < R; j++) TORCH_CHECK(rp[j] >= 0 && rp[j] < B, "apply_token_bitmask: row out of range");
    // Grain 4: up to 4 rows stay on the calling thread (waking another costs more than a row).
    at::parallel_for(0, R, 4, [&](int64_t j0, int64_t j1) {
        for (int64_t j = j0; j < j1; j++) mask_row(base + rp[j] * ld, words + j * W, V, W);
    });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvlm_kernels, m) {
    m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()", &apply_token_bitmask);
}
