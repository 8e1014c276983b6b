"""`LoRARows`: which rows of one engine step run under which adapter, and the low-rank update on them.

Built once per step by the model runner from its requests (`LoRARows.of`), carried on the step's
`AttentionMetadata` (`meta.lora`), read by each adapted projection of the model after its base matmul:

    y[rows of a] += B_a (A_a x[rows of a])      (B_a carries the adapter's scale, `kvlm.lora.adapter`)

Why a row's bits do not depend on its neighbours: A's product runs on `kernels.qmatmul` over F32 rows,
the native row kernel whose every output row is computed the same way for any number of rows (the same
kernel the base's dense float32 weights use); B's is `kernels.elementwise.lora_b_add`, per part r
multiply-adds over B's transposed rows in a fixed order, lane by lane, then one add per value into the
complete base output. The fused decode step calls the same two kernels. Rows without an adapter are
untouched. On the reference path (no native build) A's product is BLAS's, exact across batches only to
float32 rounding, as the base's are there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlm.kernels import qmatmul
from kvlm.kernels.elementwise import lora_b_add
from kvlm.lora.adapter import LoRAAdapter


@dataclass(frozen=True, slots=True)
class LoRARows:
    """Per adapter in the step, its rows: (T_a,) int64 indices into the step's T rows, or None for all."""

    groups: tuple[tuple[LoRAAdapter, torch.Tensor | None], ...]

    @classmethod
    def of(cls, adapters: Sequence[LoRAAdapter | None], query_lens: Sequence[int],
           device: torch.device) -> LoRARows | None:
        """The step's rows by adapter, from each sequence's adapter (None: the base) and row count;
        None when no row has an adapter."""
        rows: dict[int, tuple[LoRAAdapter, list[int]]] = {}
        t = 0
        for a, n in zip(adapters, query_lens):
            if a is not None:
                rows.setdefault(id(a), (a, []))[1].extend(range(t, t + n))
            t += n
        if not rows:
            return None
        return cls(tuple((a, None if len(r) == t else torch.tensor(r, dtype=torch.int64, device=device))
                         for a, r in rows.values()))

    def apply(self, y: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> torch.Tensor:
        """y (T, out): the base projection's output of x (T, in), updated in place on adapted rows."""
        for adapter, rows in self.groups:
            w = adapter.on(layer, module)
            if w is None:
                continue
            xr = x if rows is None else x.index_select(0, rows)
            t = qmatmul(xr.float(), w.a)  # (T_a, R)
            if rows is None and y.dtype == torch.float32 and y.dim() == 2 and y.stride(1) == 1:
                lora_b_add(t, w.bt, w.spans, y)
                continue
            yr = (y if rows is None else y.index_select(0, rows)).float().contiguous()
            lora_b_add(t, w.bt, w.spans, yr)
            if rows is None:
                y.copy_(yr)
            else:
                y.index_copy_(0, rows, yr.to(y.dtype))
        return y
