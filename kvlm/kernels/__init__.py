"""Compute kernels behind small interfaces, each with a pure-PyTorch reference.

`quant.py`: `QuantTensor` (a weight kept in its GGUF block format) and `qmatmul` / `dequantize`.
`reference.py`: the reference implementations every fast path is tested against.
"""

from kvlm.kernels.quant import QuantTensor, dequantize, kernel_path, qmatmul

__all__ = ["QuantTensor", "dequantize", "kernel_path", "qmatmul"]
