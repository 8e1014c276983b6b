"""Applying grammar masks to a step's logits: only the constrained rows change.

Each constrained request's grammar fills its bitmask (int32 words, bit t % 32 of word t // 32: token t
allowed) into its own buffer; the rows are stacked into one (R, W) tensor and one call writes -inf in place
where a bit is 0 or missing: the native kernel (`kernels/csrc/token_mask.cpp`: an all-ones word is skipped
without touching its 32 logits) on float32 CPU logits, else `apply_token_bitmask_ref` (pure PyTorch, any
device). Rows without a grammar are not read or written, so their logits keep every bit. Not llguidance's
torch helpers: they are `torch.compile` functions, an Inductor C++ build on a CPU's first call.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvlm.kernels.backend import native_isa

if TYPE_CHECKING:
    from kvlm.structured.matcher import RequestGrammar

_SHIFTS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, W) int32 bitmask -> (R, vocab_size) bool, True where a token is allowed (ids past 32 W: False).
    On CPU by numpy's unpack (one pass, ~6 µs a row); elsewhere by shifts on the device."""
    R, W = bitmask.shape
    if bitmask.device.type == "cpu":
        packed = bitmask.contiguous().numpy().view(np.uint8)  # little-endian: byte k of word i = tokens 32i+8k..
        bits = torch.from_numpy(np.unpackbits(packed, axis=1, bitorder="little")).view(torch.bool)  # (R, 32 W)
    else:
        bits = unpack_by_shifts(bitmask)
    if W * 32 >= vocab_size:
        return bits[:, :vocab_size]
    return torch.cat([bits, bits.new_zeros(R, vocab_size - W * 32)], dim=1)


def unpack_by_shifts(bitmask: torch.Tensor) -> torch.Tensor:
    """(R, W) int32 -> (R, 32 W) bool by shifts on the bitmask's device (an arithmetic shift keeps bit b)."""
    R, W = bitmask.shape
    return ((bitmask.unsqueeze(-1) >> _SHIFTS.to(bitmask.device)) & 1).reshape(R, W * 32).bool()


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[j]] gets -inf wherever bitmask[j] has a 0 bit or no bit. logits (B, V) float32,
    bitmask (R, W) int32, rows (R,) int64 (distinct)."""
    rows = rows.to(logits.device)
    allowed = allowed_tokens(bitmask.to(logits.device), logits.shape[1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


@functools.cache
def _native_op() -> Any:
    return torch.ops.kvlm_kernels.apply_token_bitmask.default


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """`apply_token_bitmask_ref`, natively where the logits are float32 CPU rows and the kernels are built."""
    if logits.dim() == 2 and logits.stride(1) == 1 and native_isa(logits) is not None:
        _native_op()(logits, bitmask.contiguous(), rows)
    else:
        apply_token_bitmask_ref(logits, bitmask, rows)


def grammar_bitmask(grammars: Sequence[RequestGrammar]) -> torch.Tensor:
    """(R, W) int32: the bitmask of each grammar's current state (they share one tokenizer, so one width)."""
    return torch.stack([g.mask() for g in grammars])


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], grammars: Sequence[RequestGrammar],
                        inplace: bool = False, bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """logits: (B, V) float32. Returns logits whose rows[j] has -inf wherever grammars[j] forbids a token
    (ids past the grammar's vocabulary included); every other row is the input's, bit for bit. The input
    itself is written when `inplace` (the caller needs no unmasked copy), else a copy is. `bitmask` (R, W):
    the rows' masks when the caller made them (a request's draft rows: `RequestGrammar.masks_along`)."""
    if not rows:
        return logits
    out = logits if inplace else logits.clone()
    apply_token_bitmask(out, grammar_bitmask(grammars) if bitmask is None else bitmask,
                        torch.tensor(rows, dtype=torch.long))
    return out
