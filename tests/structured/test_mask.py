"""The token mask: the native kernel, its PyTorch reference and a plain numpy unpack give the same bits for
all-zero, all-one and mixed words, vocabularies that are not a multiple of 32 and grammars over fewer or
more ids than the logits; rows without a grammar keep every bit (NaN payloads included)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deps import need_native

from kvlm.structured.mask import (
    allowed_tokens,
    apply_grammar_masks,
    apply_token_bitmask,
    apply_token_bitmask_ref,
    unpack_by_shifts,
)

SHAPES = [(64, 2), (70, 3), (70, 2), (300, 10), (33, 1), (31, 1), (49152, 1536), (49216, 1536)]


def unpacked(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> torch.Tensor:
    """The expected result, by numpy's unpack: -inf where a row's bit is 0 or missing."""
    V = logits.shape[1]
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :V].astype(bool)
    allowed = np.zeros((len(rows), V), dtype=bool)
    allowed[:, : bits.shape[1]] = bits
    out = logits.clone()
    for j, r in enumerate(rows):
        out[r] = torch.where(torch.from_numpy(allowed[j]), logits[r], torch.tensor(float("-inf")))
    return out


def random_case(V: int, words: int, seed: int) -> tuple[torch.Tensor, np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    choices = np.array([0, -1, 5, -7, (1 << 31) - 1, -(1 << 31)], dtype=np.int64)
    rows = sorted(rng.choice(5, size=int(rng.integers(1, 6)), replace=False).tolist())
    bitmask = rng.choice(choices, size=(len(rows), words)).astype(np.int32)
    bitmask[:, rng.integers(words)] = rng.integers(-2**31, 2**31 - 1, size=len(rows))
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(seed))
    logits[0, 0] = float("nan")  # an unconstrained row's NaN keeps its bits too
    return logits, bitmask, rows


@pytest.mark.parametrize("V, words", SHAPES)
def test_reference_equals_unpack(V: int, words: int) -> None:
    for seed in range(10):
        logits, bitmask, rows = random_case(V, words, seed)
        out = logits.clone()
        apply_token_bitmask_ref(out, torch.from_numpy(bitmask), torch.tensor(rows))
        assert torch.equal(out.view(torch.int32), unpacked(logits, bitmask, rows).view(torch.int32))


def test_device_unpack_equals_numpy_unpack() -> None:
    """Off CPU the reference unpacks by shifts; here on CPU it must give numpy's bits."""
    _, bitmask, _ = random_case(300, 10, 3)
    t = torch.from_numpy(bitmask)
    assert torch.equal(unpack_by_shifts(t)[:, :300], allowed_tokens(t, 300))


@pytest.mark.parametrize("V, words", SHAPES)
def test_native_equals_reference(V: int, words: int) -> None:
    need_native("the native mask is what is compared")
    for seed in range(10):
        logits, bitmask, rows = random_case(V, words, seed)
        ref, fast = logits.clone(), logits.clone()
        apply_token_bitmask_ref(ref, torch.from_numpy(bitmask), torch.tensor(rows))
        apply_token_bitmask(fast, torch.from_numpy(bitmask), torch.tensor(rows))
        assert torch.equal(fast.view(torch.int32), ref.view(torch.int32))  # bit for bit, NaN rows included


def test_copy_or_in_place() -> None:
    class Fixed:  # a grammar whose bitmask row is given
        def __init__(self, row: np.ndarray) -> None:
            self.row = torch.from_numpy(row)

        def mask(self) -> torch.Tensor:
            return self.row

    logits, bitmask, rows = random_case(70, 3, 1)
    expect = unpacked(logits, bitmask, rows)
    before = logits.clone()
    out = apply_grammar_masks(logits, rows, [Fixed(m) for m in bitmask])
    assert torch.equal(out.view(torch.int32), expect.view(torch.int32))
    assert torch.equal(logits.view(torch.int32), before.view(torch.int32))  # the input is untouched
    same = apply_grammar_masks(logits, rows, [Fixed(m) for m in bitmask], inplace=True)
    assert same is logits and torch.equal(logits.view(torch.int32), expect.view(torch.int32))
