"""`QuantTensor`: a weight matrix kept in its GGUF block format (the type every kernel module shares).

Logical shape (N, K) (out x in, Hugging Face orientation), stored as GGUF stores it: each of the N rows
is K / block_elems blocks of `block_bytes` bytes, so `data` is a (N, row_bytes) uint8 tensor (possibly a
view over the memory-mapped file). Row operations (the RoPE un-permute, stacking q/k/v) are byte-row
operations on `data`; nothing is dequantized at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlm.kernels.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType

PANELS16 = 0x100  # type id flag of a panel-packed weight (csrc/kernels.h)


@dataclass(frozen=True, slots=True)
class QuantTensor:
    """A (N, K) weight in GGUF block format: data is (N, K // block_elems * block_bytes) uint8.

    panels: the same bytes reordered in 16-row panels for the x86 int8 kernels (`kernels.panels`; rows
    16 p .. 16 p + 15 of data together hold panel p, so a slice of whole panels is still one)."""

    data: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, int]
    panels: bool = False

    def __post_init__(self) -> None:
        n, k = self.shape
        elems, nbytes = GGML_QUANT_SIZES[self.qtype]
        if k % elems:
            raise ValueError(f"{self.qtype.name}: row length {k} is not a multiple of the block size {elems}")
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != (n, k // elems * nbytes):
            raise ValueError(f"{self.qtype.name} data must be uint8 ({n}, {k // elems * nbytes}), "
                             f"got {self.data.dtype} {tuple(self.data.shape)}")
        if self.panels and n % 16:
            raise ValueError(f"a panel-packed weight has whole 16-row panels, got {n} rows")

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def type_id(self) -> int:
        """The id the C++ kernels take: the ggml type, with PANELS16 set for a panel-packed weight."""
        return int(self.qtype) | (PANELS16 if self.panels else 0)


@dataclass(frozen=True, slots=True)
class ExpertStack:
    """The weights of E experts stacked as GGUF stores them: logical shape (E, N, K), `data` (E, N, row_bytes)
    uint8 (a view over the memory-mapped file: an expert no token has used was never read, so costs no
    resident memory). `expert(e)` is expert e's (N, K) `QuantTensor`, a view of its rows."""

    data: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, int, int]

    def __post_init__(self) -> None:
        e, n, k = self.shape
        elems, nbytes = GGML_QUANT_SIZES[self.qtype]
        if k % elems or self.data.dtype != torch.uint8 or tuple(self.data.shape) != (e, n, k // elems * nbytes):
            raise ValueError(f"{self.qtype.name} expert data must be uint8 ({e}, {n}, {k // elems * nbytes}) "
                             f"with rows of whole blocks, got {self.data.dtype} {tuple(self.data.shape)}")

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def expert(self, e: int) -> QuantTensor:
        return QuantTensor(self.data[e], self.qtype, self.shape[1:])
