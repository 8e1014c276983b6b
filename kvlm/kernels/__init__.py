"""Compute kernels behind small interfaces, each with a pure-PyTorch reference.

`quant.py`: `QuantTensor` (a weight kept in its GGUF block format) and `qmatmul` / `dequantize`.
`paged_attention.py`: `paged_decode_attention`, decode attention over the paged KV cache in place.
`reference.py`: the reference implementations every fast path is tested against.
`native.py`: builds and loads the C++ kernels (`csrc/`) at first use and picks the ISA path.
"""

from kvlm.kernels.paged_attention import paged_decode_attention
from kvlm.kernels.quant import QuantTensor, dequantize, kernel_path, qmatmul

__all__ = ["QuantTensor", "dequantize", "kernel_path", "paged_decode_attention", "qmatmul"]
