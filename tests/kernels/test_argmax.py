"""`argmax_rows` returns torch.argmax's index on every ISA path: the first of tied maxima, the first NaN
when a row has one (NaN counts as the largest), 0 for a row of -inf, +0 and -0 as equals; rows of any
length (vector bodies, tails, single values), several rows (split over threads), rows with a stride."""

from __future__ import annotations

import pytest
import torch
from deps import need_native

from kvlm.kernels import native
from kvlm.kernels.argmax import argmax_rows

LENGTHS = [1, 7, 16, 31, 32, 33, 63, 64, 65, 100, 129, 4099, 49152]
INF, NAN = float("inf"), float("nan")


def adversarial_rows(V: int, seed: int) -> torch.Tensor:
    """(12, V) rows built to catch an argmax that is not torch's: ties, NaN, infinities, signed zeros,
    the maximum in the first or last slot or in a vector tail, and mostly -inf rows (masked logits)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, V, generator=g)
    pos = torch.randint(V, (8,), generator=g).tolist()
    x[1] = torch.randint(-2, 3, (V,), generator=g).float()  # many ties at the maximum
    x[2, pos[0]] = NAN
    x[3, pos[1]] = NAN
    x[3, pos[2]] = NAN
    x[3, pos[3]] = INF
    x[4] = -INF
    x[5] = -INF
    x[5, pos[4]] = 0.5
    x[6, pos[5]] = INF
    x[6, pos[6]] = INF
    x[7] = 0.0
    x[7, ::3] = -0.0
    x[8, -1] = 100.0  # the last slot (a tail when V is not a multiple of the vector width)
    x[9, 0] = 100.0
    x[10] = -1.0
    x[10, pos[7]] = -0.0
    x[10, (pos[7] + 1) % V] = 0.0
    x[11] = NAN
    return x


def check(x: torch.Tensor, isa: str) -> None:
    assert torch.equal(argmax_rows(x, isa), x.argmax(-1)), isa


@pytest.mark.parametrize("V", LENGTHS)
def test_every_path_equals_torch(isa: str, V: int) -> None:
    for seed in range(4):
        x = adversarial_rows(V, seed)
        check(x, isa)
        for r in range(x.shape[0]):  # one row at a time too (the calling thread only)
            check(x[r:r + 1], isa)


def test_strided_rows_and_many_rows(isa: str) -> None:
    wide = torch.randn(40, 700)
    wide[::5, 3] = NAN
    check(wide[:, :513], isa)  # rows 700 floats apart, 513 used
    check(torch.cat([adversarial_rows(129, s) for s in range(3)]), isa)  # 36 rows over the threads


def test_reference_path_is_torch() -> None:
    x = adversarial_rows(65, 0)
    assert torch.equal(argmax_rows(x, "reference"), x.argmax(-1))
    assert torch.equal(argmax_rows(x.double()), x.double().argmax(-1))  # other dtypes: torch itself


def test_native_is_what_runs_here() -> None:
    """Where the extension is built, the default path is native (not the torch fallback)."""
    need_native("the native argmax is what is checked")
    x = adversarial_rows(64, 1)
    out = torch.empty(x.shape[0], dtype=torch.long)
    torch.ops.kvlm_kernels.argmax_rows.default(x, out, native.isa_id(native.best_isa()))
    assert torch.equal(out, x.argmax(-1))
