"""Weights reordered in 16-row panels, the layout the x86 int8 kernels read in one stream (Q4_K today).

Packed once at load (`loader.gguf` where `backend.weight_panels()` says so): panel p, weight rows 16 p ..
16 p + 15, keeps its 16 x row_bytes bytes, super-block after super-block, and within a super-block the rows'
36 dwords (144 bytes) are transposed: row c's dword i goes to (i, c). The first 4 x 16 dwords are then the
16 rows' heads (d | dmin, the 12 scale bytes), the next 32 x 16 their quants: csrc/kernels_kquant_panels.h
(AVX-512; the AVX2 units read each 64-byte line as two 8-row halves, kernels_kquant_panels_avx2.h), whose comment
gives the reason (decode compute on the file's layout took as long as its memory reads) and
the measurement. Packing permutes dwords, nothing else: `unpack` inverts it exactly, and a path that does
not read panels (float32 activations, the reference, another ISA forced later in the process) computes on
the unpacked bytes, with the same results.
"""

from __future__ import annotations

import torch

from kvlm.kernels import native
from kvlm.kernels.ggml_types import GGMLQuantizationType as Q
from kvlm.kernels.quant_tensor import QuantTensor

PANEL_ROWS = 16
_DWORDS = {Q.Q4_K: 36}  # dwords per block of each format that has a panel kernel


def packable(w: QuantTensor) -> bool:
    """Whether w can be packed: a format with a panel kernel, whole panels, contiguous dword-aligned rows."""
    return (not w.panels and w.qtype in _DWORDS and w.shape[0] % PANEL_ROWS == 0 and w.data.is_contiguous()
            and w.data.data_ptr() % 4 == 0)


def _grid(w: QuantTensor) -> tuple[int, int, int]:
    n, rb = w.data.shape
    d = _DWORDS[w.qtype]
    return n // PANEL_ROWS, rb // (4 * d), d  # panels, blocks per row, dwords per block


def pack(w: QuantTensor, out: torch.Tensor | None = None) -> QuantTensor:
    """w's bytes in panels, written into `out` (w.nbytes uint8, e.g. a slice of one buffer) or a new tensor."""
    if not packable(w):
        raise ValueError(f"{w.qtype.name} {w.shape} cannot be packed in {PANEL_ROWS}-row panels")
    p, nb, d = _grid(w)
    buf = (torch.empty(w.nbytes, dtype=torch.uint8) if out is None else out).view(w.data.shape)
    if native.available():  # the same bytes, faster (the 3B Q4_K_M's packing: 0.76 s, against 0.99)
        torch.ops.kvlm_kernels.pack_panels(w.data, d, buf)
    else:  # (panel, row c, block, dword i) -> (panel, block, dword i, row c)
        buf.view(torch.int32).view(p, nb, d, PANEL_ROWS).copy_(
            w.data.view(torch.int32).view(p, PANEL_ROWS, nb, d).permute(0, 2, 3, 1))
    return QuantTensor(buf, w.qtype, w.shape, panels=True)


def unpack(w: QuantTensor) -> QuantTensor:
    """A panel-packed weight in the file's layout again (a new tensor): `pack`'s exact inverse."""
    if not w.panels:
        return w
    p, nb, d = _grid(w)
    out = torch.empty(w.data.shape, dtype=torch.uint8)
    out.view(torch.int32).view(p, PANEL_ROWS, nb, d).copy_(
        w.data.contiguous().view(torch.int32).view(p, nb, d, PANEL_ROWS).permute(0, 3, 1, 2))
    return QuantTensor(out, w.qtype, w.shape)
