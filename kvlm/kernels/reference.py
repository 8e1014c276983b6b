"""Pure-PyTorch/numpy references for the kernels: slow, obviously right, always available on CPU.

Every native kernel is tested against these, and they are the fallback where the native extension
cannot be built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from kvlm.kernels.quant import QuantTensor


def dequantize_ref(w: QuantTensor) -> torch.Tensor:
    """(N, K) float32 from the GGUF blocks, decoded by the `gguf` package's numpy code."""
    from gguf import GGMLQuantizationType, quants

    raw = w.data.cpu().numpy()
    if w.qtype == GGMLQuantizationType.F32:
        arr = raw.view(np.float32)
    elif w.qtype == GGMLQuantizationType.F16:
        arr = raw.view(np.float16).astype(np.float32)
    else:
        arr = quants.dequantize(raw, w.qtype).astype(np.float32, copy=False)
    return torch.from_numpy(np.ascontiguousarray(arr).reshape(w.shape))


def qmatmul_ref(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """x (M, K) float32 @ dequantize(w).T -> (M, N) float32."""
    return x.float() @ dequantize_ref(w).to(x.device).T
