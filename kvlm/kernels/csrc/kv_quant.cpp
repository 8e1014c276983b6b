// torch.ops.kvlm_kernels.kv_quantize: float32 K/V rows -> int8 / int4 KV cache codes (kv_quantize.h),
// the native twin of kvlm/kernels/kv_quant.py's quantize_ref (tests/kernels/test_kv_quant.py: same bits).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "kv_quantize.h"

namespace {

// x (..., n) contiguous float32 head rows, n % 32 == 0; out (..., n / 32 * (bits == 8 ? 34 : 18)) contiguous
// uint8; rows rotated first where the format rotates.
void kv_quantize(const at::Tensor& x, int64_t bits, const at::Tensor& out) {
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() >= 1,
                "kv_quantize: x must be a contiguous float32 CPU tensor");
    TORCH_CHECK(bits == 8 || bits == 4, "kv_quantize: bits must be 8 or 4");
    const int64_t n = x.size(-1), gb = bits == 8 ? 34 : 18, rows = x.numel() / std::max<int64_t>(n, 1);
    TORCH_CHECK(n % 32 == 0 && n <= 1024, "kv_quantize: the last dimension must be a multiple of 32, at most 1024");
    TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.numel() == rows * (n / 32) * gb,
                "kv_quantize: bad out tensor");
    const float* xp = x.const_data_ptr<float>();
    uint8_t* op = out.mutable_data_ptr<uint8_t>();
    at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {  // rows are independent: any split, same bits
        for (int64_t r = r0; r < r1; r++) {
            kvlm::kv_quantize_rows(xp + r * n, n, n, bits, op + r * (n / 32) * gb);
        }
    });
}

// out = x H along the last dimension (kv_quantize.h's hadamard_row): x, out contiguous float32, same shape.
void hadamard(const at::Tensor& x, const at::Tensor& out) {
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() >= 1 &&
                    out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == x.sizes(),
                "hadamard: x and out must be contiguous float32 CPU tensors of one shape");
    const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
    TORCH_CHECK(n > 0, "hadamard: empty rows");
    if (out.data_ptr() != x.data_ptr()) out.copy_(x);
    float* op = out.mutable_data_ptr<float>();
    at::parallel_for(0, rows, 256, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++) kvlm::hadamard_row(op + r * n, n);
    });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvlm_kernels, m) {
    m.def("kv_quantize(Tensor x, int bits, Tensor(a!) out) -> ()", &kv_quantize);
    m.def("hadamard(Tensor x, Tensor(a!) out) -> ()", &hadamard);
}
