"""`argmax_rows`: each row's argmax, torch.argmax(x, -1)'s exact answer, natively on float32 CPU rows.

torch's CPU argmax is a scalar loop (~1 ns a float): 30-55 us for one warm row of SmolLM2's 49,152
logits (`scripts/experiments/argmax_decode_ab.py` at f97df0a), about half a greedy step's sampling time. The native
kernel (`csrc/argmax.cpp`) takes two vectorized passes and returns the same index: the first NaN if the
row has one (torch counts NaN as the largest value), else the first index of the maximum. Other dtypes
and devices, and builds without the extension, call torch.argmax itself, the reference.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvlm.kernels import native
from kvlm.kernels.backend import native_isa


@functools.cache
def _native_op() -> Any:
    return torch.ops.kvlm_kernels.argmax_rows.default


def argmax_rows(x: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """x (B, V) -> (B,) int64: the index of each row's maximum, as `x.argmax(-1)` gives it. `isa`: a
    native path to take (tests), default `backend.native_isa()`."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] == 0 or x.stride(1) != 1:
        return x.argmax(-1)
    isa = native_isa() if isa is None else isa
    if isa is None or isa == "reference" or not native.available():
        return x.argmax(-1)
    out = torch.empty(x.shape[0], dtype=torch.long)
    _native_op()(x, out, native.isa_id(isa))
    return out
