"""Weights kept in their GGUF block formats, and matrix products computed on them.

A `QuantTensor` is a weight matrix of logical shape (N, K) (out x in, Hugging Face orientation) stored as
GGUF stores it: each of the N rows is K / block_elems blocks of `block_bytes` bytes, so `data` is a
(N, row_bytes) uint8 tensor (possibly a view over the memory-mapped file). Row operations (the RoPE
un-permute, stacking q/k/v) are byte-row operations on `data`; nothing is dequantized at load.

`qmatmul(x, w)` computes `x @ dequantize(w).T` on the blocks in place with the native kernels
(`native.py`, `csrc/`) where they are built, else with the reference (`reference.py`):
- few rows (decode, M <= GEMV_MAX_ROWS): the row kernel. Each output row is computed in a fixed order
  that does not depend on M, so a row's result is bit-identical alone and in a batch.
- many rows (prefill chunks, large batches): dequantize a tile of weight rows (TILE_BYTES of float32)
  and multiply with BLAS (`x @ tile.T`): compute-bound there, and BLAS is faster than our row kernel.
  Results then differ from the row kernel's in the last bits (summation order), not in meaning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvlm.kernels import native
from kvlm.kernels.reference import dequantize_ref, qmatmul_ref

# Types with a native kernel (block layouts as in ggml; gguf/quants.py documents them).
NATIVE_TYPES = frozenset({
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
})
GEMV_MAX_ROWS = 8  # up to this many rows of x use the row kernel; more use dequantize-a-tile + BLAS (measured)
TILE_BYTES = 8 << 20  # float32 bytes of one dequantized weight tile: big enough for BLAS to run at full speed


@dataclass(frozen=True, slots=True)
class QuantTensor:
    """A (N, K) weight in GGUF block format: data is (N, K // block_elems * block_bytes) uint8."""

    data: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        n, k = self.shape
        elems, nbytes = GGML_QUANT_SIZES[self.qtype]
        if k % elems:
            raise ValueError(f"{self.qtype.name}: row length {k} is not a multiple of the block size {elems}")
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != (n, k // elems * nbytes):
            raise ValueError(f"{self.qtype.name} data must be uint8 ({n}, {k // elems * nbytes}), "
                             f"got {self.data.dtype} {tuple(self.data.shape)}")

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def _native_isa(w: QuantTensor, device: torch.device) -> str | None:
    if device.type != "cpu" or w.data.device.type != "cpu" or w.qtype not in NATIVE_TYPES:
        return None
    isa = native.active_isa()
    return None if isa == "reference" else isa


def dequantize(w: QuantTensor) -> torch.Tensor:
    """(N, K) float32."""
    isa = _native_isa(w, w.data.device)
    if isa is None:
        return dequantize_ref(w)
    n, k = w.shape
    out = torch.empty(n, k, dtype=torch.float32)
    torch.ops.kvlm_kernels.dequantize(_rows(w), int(w.qtype), k, native.isa_id(isa), out)
    return out


def qmatmul(x: torch.Tensor, w: QuantTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) float32 -> (..., N) float32 = x @ dequantize(w).T.

    `out`, if given, is a contiguous float32 tensor of the result's shape that receives it (a decode
    step can then reuse its buffers instead of allocating per layer); it is also returned.
    """
    n, k = w.shape
    lead = x.shape[:-1]
    if out is not None and (out.dtype != torch.float32 or not out.is_contiguous() or out.shape != (*lead, n)):
        raise ValueError(f"out must be a contiguous float32 tensor of shape {(*lead, n)}")
    isa = _native_isa(w, x.device)
    if isa is None:
        y = qmatmul_ref(x, w)
        return y if out is None else out.copy_(y)
    x2 = x.reshape(-1, k).to(torch.float32).contiguous()  # (M, K); no copy when already so
    m = x2.shape[0]
    if m <= GEMV_MAX_ROWS:
        y = torch.empty(m, n, dtype=torch.float32) if out is None else out.view(m, n)
        torch.ops.kvlm_kernels.qmatmul(x2, _rows(w), int(w.qtype), k, native.isa_id(isa), y)
    else:
        y = _tiled_matmul(x2, w, native.isa_id(isa))
        if out is not None:
            y = out.view(m, n).copy_(y)
    return y.view(*lead, n)


def _tiled_matmul(x: torch.Tensor, w: QuantTensor, isa: int) -> torch.Tensor:
    """x (M, K) @ W.T for many rows: dequantize a tile of weight rows, then one BLAS call per tile."""
    n, k = w.shape
    data = _rows(w)
    tile = max(16, min(n, TILE_BYTES // (4 * k)))
    buf = torch.empty(tile, k, dtype=torch.float32)  # (tile, K) dequantized rows, reused
    if tile == n:
        torch.ops.kvlm_kernels.dequantize(data, int(w.qtype), k, isa, buf)
        return x @ buf.T
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    for n0 in range(0, n, tile):
        rows = min(tile, n - n0)
        torch.ops.kvlm_kernels.dequantize(data[n0:n0 + rows], int(w.qtype), k, isa, buf[:rows])
        out[:, n0:n0 + rows] = x @ buf[:rows].T
    return out


def _rows(w: QuantTensor) -> torch.Tensor:
    """w.data with contiguous bytes in each row (the kernels allow any row stride)."""
    return w.data if w.data.stride(1) == 1 else w.data.contiguous()


def kernel_path(qtype: GGMLQuantizationType) -> str:
    """Which implementation `qmatmul` uses for this tensor type: 'avx512', 'avx2', 'scalar' or 'reference'."""
    if qtype not in NATIVE_TYPES:
        return "reference"
    return native.active_isa()
