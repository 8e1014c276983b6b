"""Compute kernels behind small interfaces, each with a pure-PyTorch reference.

`quant_tensor.py`: `QuantTensor`, a weight kept in its GGUF block format; `ExpertStack`, E experts' weights
stacked as GGUF stores them (a `QuantTensor` view per expert).
`quant.py`: `qmatmul` / `dequantize` on it; `qmatmul_parts`, a layer's separate parts in one call; `expert_qmatmul`,
one projection of every chosen expert in one call.
`paged_attention.py`: `paged_attention` (query rows of any sequences) and its one-row-per-sequence case
`paged_decode_attention`, attention over the paged KV cache in place. (`kvlm.kernels.paged_attention` as an
attribute is that function; the module is `sys.modules["kvlm.kernels.paged_attention"]`, e.g. to monkeypatch.)
`reference.py`: the reference implementations every fast path is tested against.
`native.py`: builds and loads the C++ kernels (`csrc/`) at first use and picks the ISA path.
"""

from kvlm.kernels.backend import kernel_path
from kvlm.kernels.paged_attention import paged_attention, paged_decode_attention
from kvlm.kernels.quant import dequantize, expert_qmatmul, qmatmul, qmatmul_parts
from kvlm.kernels.quant_tensor import ExpertStack, QuantTensor

__all__ = ["ExpertStack", "QuantTensor", "dequantize", "expert_qmatmul", "kernel_path", "paged_attention",
           "paged_decode_attention", "qmatmul", "qmatmul_parts"]
