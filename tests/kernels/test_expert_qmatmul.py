"""`expert_qmatmul`, the grouped expert matmul (llama.cpp's mul_mat_id): one native call for every chosen
expert's rows has, row for row, the bits of `qmatmul` on that expert alone, for each weight format the
kernels cover, on every ISA path this CPU has, at 1 and 2 threads, with experts that no row chose, and at
column counts that are not a multiple of the 16-column panel. A bad call is one error, not a crash."""

from __future__ import annotations

import pytest
import torch
from deps import need_native
from gguf import GGMLQuantizationType as T
from quantize import random_blocks

from kvlm.kernels import ExpertStack, expert_qmatmul, native, qmatmul

FORMATS = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q4_K, T.Q5_K, T.Q6_K, T.BF16, T.F16, T.F32]


def stack(qtype: T, e: int, n: int, k: int, seed: int = 0) -> ExpertStack:
    ws = [random_blocks(qtype, n, k, seed + i) for i in range(e)]
    return ExpertStack(torch.stack([w.data for w in ws]), qtype, (e, n, k))


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [40, 64])
def test_rows_have_the_bits_of_qmatmul_on_their_expert(qtype: T, n: int, isa: str) -> None:
    need_native()
    k, E = 256, 6
    w = stack(qtype, E, n, k)
    counts = [3, 0, 1, 7, 0, 2]  # experts 1 and 4 chose no row
    x = torch.randn(sum(counts), k, generator=torch.Generator().manual_seed(1)) * 2
    want = torch.cat([qmatmul(x[s:s + c], w.expert(e)) for e, (s, c) in
                      enumerate(zip([sum(counts[:i]) for i in range(E)], counts)) if c])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = expert_qmatmul(x, w, counts)
            assert torch.equal(got, want), f"{isa}, {threads} threads: max |diff| {(got - want).abs().max():.3g}"
    finally:
        torch.set_num_threads(before)


def test_bad_counts_are_one_error() -> None:
    need_native()
    w = stack(T.Q8_0, 3, 16, 64)
    ops = native.ops()
    with pytest.raises(RuntimeError, match="counts must sum"):
        ops.expert_qmatmul(torch.zeros(4, 64), w.data, torch.tensor([1, 1, 1]), int(T.Q8_0), 64,
                           native.ISAS.index(native.best_isa()), True, torch.empty(4, 16))
    with pytest.raises(RuntimeError, match="counts must be"):
        ops.expert_qmatmul(torch.zeros(3, 64), w.data, torch.tensor([1, 2]), int(T.Q8_0), 64,
                           native.ISAS.index(native.best_isa()), True, torch.empty(3, 16))
