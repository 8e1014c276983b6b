"""Linear layers and embeddings whose weights stay in their GGUF block formats (`kernels.QuantTensor`).

`QuantLinear` computes `x @ W.T (+ bias)` with `kernels.qmatmul` on the stored blocks. A stacked
projection (q/k/v, gate/up) whose parts have different block formats keeps one `QuantTensor` per part
and concatenates the outputs; parts of one format are concatenated once at load (`stack_quant`), as
byte rows: a view when the parts lie back to back in the mapped file, a copy of the blocks otherwise
(quantized formats only: F32 / F16 / BF16 parts that are not a view stay separate parts).

Where `kernels.kernel_path` says a format has no native kernel (the extension could not be built),
the layer dequantizes its weight once at load and multiplies densely: the same numbers as the
reference `qmatmul`, without dequantizing at every call. `QuantEmbedding` dequantizes only the rows
it looks up. This module knows nothing about the model's architecture or the loader.
"""

from __future__ import annotations

import itertools
import logging

import torch
from torch import nn

from kvlm.kernels import QuantTensor, dequantize, kernel_path, qmatmul, qmatmul_parts

log = logging.getLogger("kvlm")
_warned: set[str] = set()


def _warn_fallback(qtype_name: str) -> None:
    if qtype_name not in _warned:  # once per format per process, not once per layer
        _warned.add(qtype_name)
        log.warning("kvlm: no native kernel for %s weights: dequantized to float32 at load (reference path)",
                    qtype_name)


def back_to_back(a: QuantTensor, b: QuantTensor) -> bool:
    """b's bytes start where a's end, both contiguous in one storage (view_rows can view them)."""
    return (a.data.is_contiguous() and b.data.is_contiguous()
            and a.data.untyped_storage().data_ptr() == b.data.untyped_storage().data_ptr()
            and a.data.data_ptr() + a.data.numel() == b.data.data_ptr())


def view_rows(parts: list[QuantTensor]) -> QuantTensor:
    """Parts of one format, each one's bytes following the previous one's in one storage (e.g. gate and
    up, adjacent in a GGUF file), as one matrix stacked along N: a view, never a copy."""
    first = parts[0]
    assert all(back_to_back(a, b) for a, b in itertools.pairwise(parts)), "view_rows: parts are not back to back"
    rows = sum(p.shape[0] for p in parts)
    rb = first.data.shape[1]
    return QuantTensor(torch.as_strided(first.data, (rows, rb), (rb, 1)), first.qtype, (rows, first.shape[1]),
                       panels=first.panels)


def stack_quant(parts: list[QuantTensor]) -> list[QuantTensor]:
    """Merge neighbouring parts that share a format where they are a view (back to back in the mapped
    file: one qmatmul each); keep the rest apart, multiplied one after another, rather than copied (the
    bits of each output column are the same either way: the kernels compute every column on its own).
    Why: a copy holds a second q/k/v and gate/up (1.3 GB for a 1B model in bf16), and for a 3B Q4_K_M
    whose tensors lie in name order (attn_k before attn_q, ffn_norm between ffn_gate and ffn_up) the copy
    was 43% of an 8-token `kvlm generate` (py-spy, 2026-12-05)."""
    runs: list[list[QuantTensor]] = []
    for p in parts:
        r = runs[-1][0] if runs else None
        if r and (r.qtype, r.shape[1], r.panels) == (p.qtype, p.shape[1], p.panels) and back_to_back(runs[-1][-1], p):
            runs[-1].append(p)
        else:
            runs.append([p])
    return [r[0] if len(r) == 1 else view_rows(r) for r in runs]


class QuantLinear(nn.Module):
    """y = x @ W.T + b with W as one or more QuantTensors stacked along the output dimension."""

    def __init__(self, parts: QuantTensor | list[QuantTensor], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.parts = [parts] if isinstance(parts, QuantTensor) else list(parts)
        self.in_features = self.parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in self.parts)
        if bias is not None and not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias, requires_grad=False)
        self.register_parameter("bias", bias)
        # Dense (K, N) fallback per part without a native kernel: input-major like the dense model's
        # weights (`to_input_major`), so a decode row is x @ W_t, the faster GEMM on CPU.
        self.dense_t: list[torch.Tensor | None] = []
        for p in self.parts:
            if kernel_path(p.qtype) == "reference":
                _warn_fallback(p.qtype.name)
                self.dense_t.append(dequantize(p).t().contiguous())
            else:
                self.dense_t.append(None)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes of weight read per call (the blocks, or the dense fallback)."""
        return sum(p.nbytes if d is None else d.numel() * d.element_size() for p, d in zip(self.parts, self.dense_t))

    def _part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        d = self.dense_t[i]
        return qmatmul(x, self.parts[i]) if d is None else x @ d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()  # (M, K)
        if len(self.parts) == 1:
            out = self._part(x2, 0)  # (M, N)
        else:  # separate parts: one native call on x quantized once, else each part in turn
            out = qmatmul_parts(x2.contiguous(), self.parts) if all(d is None for d in self.dense_t) else None
            if out is None:
                out = torch.cat([self._part(x2, i) for i in range(len(self.parts))], dim=-1)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        kinds = ", ".join(f"{p.qtype.name}[{p.shape[0]}]:{kernel_path(p.qtype)}" for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, parts=({kinds})"


class QuantEmbedding(nn.Module):
    """Token embedding over a QuantTensor (vocab, hidden): a lookup dequantizes only its rows."""

    def __init__(self, weight: QuantTensor) -> None:
        super().__init__()
        self.qweight = weight
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self.qweight.data.index_select(0, flat.to(self.qweight.data.device))  # (T, row_bytes)
        out = dequantize(QuantTensor(rows, self.qweight.qtype, (flat.numel(), self.embedding_dim)))
        return out.to(ids.device).view(*ids.shape, self.embedding_dim)



def weight_ranges(model: nn.Module) -> list[tuple[int, int]]:
    """[start, end) addresses of every QuantTensor's and ExpertStack's bytes in `model` (views of a mapped
    file, or copies): what `loader.mapped_pages.release_unused` must keep (experts no token has chosen stay
    unread, so out of RSS, either way)."""
    from kvlm.model.moe import Experts

    tensors = [t for m in model.modules() for t in (
        m.parts if isinstance(m, QuantLinear) else [m.qweight] if isinstance(m, QuantEmbedding)
        else list(m.stacks.values()) if isinstance(m, Experts) else [])]
    return [(t.data.data_ptr(), t.data.data_ptr() + sum((n - 1) * st for n, st in zip(t.data.shape, t.data.stride()))
             + 1) for t in tensors if t.data.numel()]
