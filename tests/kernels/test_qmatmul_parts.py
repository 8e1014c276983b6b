"""`qmatmul_parts`: a layer's separate weight parts (q / k / v, gate / up) in one native call, x quantized once,
each part's columns written in place. It must give the bits of each part's own `qmatmul`, concatenated, on
every ISA path, at decode and prefill row counts, with mixed types, tail panels and packed panels."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from quantize import random_blocks  # tests/helpers

from kvlm.kernels import qmatmul, qmatmul_parts
from kvlm.kernels.backend import native_isa, panel_kernel
from kvlm.kernels.panels import pack, packable
from kvlm.model.quant_layers import QuantLinear

K = 512


def _parts(types: list[tuple[T, int]], seed: int = 7) -> list:
    return [random_blocks(t, n, K, seed=seed + i) for i, (t, n) in enumerate(types)]


@pytest.mark.parametrize("types", [
    [(T.Q4_K, 32), (T.Q4_K, 48), (T.Q6_K, 37)],     # a Q4_K_M layer's q / k / v, v with a tail panel
    [(T.Q4_K, 64), (T.Q4_K, 64)],                   # gate / up
    [(T.Q8_0, 16), (T.Q4_0, 24), (T.Q5_0, 8), (T.Q4_1, 40)],
    [(T.F16, 24), (T.BF16, 16)],                    # float parts (float32 activations)
], ids=["q4k-q4k-q6k", "gate-up", "four-types", "float"])
@pytest.mark.parametrize("m", [1, 3, 5, 33, 64])
def test_parts_are_each_part_alone_bit_for_bit(isa: str, types: list[tuple[T, int]], m: int) -> None:
    parts = _parts(types)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
    got = qmatmul_parts(x, parts)
    want = torch.cat([qmatmul(x, w) for w in parts], dim=-1)
    if native_isa() is None:  # the reference path: no native call, the caller runs the parts
        assert got is None
        return
    assert got is not None and torch.equal(got, want)


def test_packed_panels_and_the_file_layout_together(isa: str) -> None:
    """A packed Q4_K part beside Q6_K (never packed): where this path reads panels the call takes both, and
    elsewhere it declines (the caller's qmatmul unpacks)."""
    parts = _parts([(T.Q4_K, 48), (T.Q6_K, 32)])
    assert packable(parts[0])
    packed = [pack(parts[0]), parts[1]]
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(1))
    want = torch.cat([qmatmul(x, w) for w in parts], dim=-1)
    got = qmatmul_parts(x, packed)
    if native_isa() is not None and panel_kernel(native_isa()):
        assert got is not None and torch.equal(got, want)
    else:
        assert got is None


def test_quant_linear_with_parts_matches_the_concatenation(isa: str) -> None:
    parts = _parts([(T.Q4_K, 32), (T.Q6_K, 16), (T.Q8_0, 24)])
    layer = QuantLinear(parts, bias=torch.randn(72))
    x = torch.randn(2, 3, K, generator=torch.Generator().manual_seed(3))
    want = torch.cat([qmatmul(x.reshape(-1, K), w) for w in parts], dim=-1) + layer.bias
    assert torch.equal(layer(x), want.view(2, 3, 72))


def test_declines_what_it_cannot_take_in_one_call(isa: str) -> None:
    x = torch.randn(2, K)
    assert qmatmul_parts(x, _parts([(T.Q4_K, 32)])) is None  # one part: plain qmatmul
    assert qmatmul_parts(x, _parts([(T.Q4_0, 16)] * 5)) is None  # more than 4
    assert qmatmul_parts(x.t().contiguous().t(), _parts([(T.Q4_0, 16)] * 2)) is None  # not contiguous
