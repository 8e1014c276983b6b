"""The AVX2 int8-activation kernel (csrc/kernels_int8_avx2.h), forced with KVLM_KERNEL_ISA=avx2.

Its order contract (the header states it) was kept when the kernel was rewritten for speed (accumulators
in registers, prefetch, vectorized K-quant scales): the bits of every output are those of the row kernel
before it (f97df0a). `test_avx2_int8_bits_unchanged` holds the kernel to digests of that kernel's
outputs; the others check what the rewrite could break: a column's bits wherever it lands in the matrix
(and in the prefetching decode loop), any M, 1 or 2 threads, and the reference bound.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from quantize import random_blocks  # noqa: E402  (tests/helpers)

from kvlm.kernels import native
from kvlm.kernels.backend import kernel_path
from kvlm.kernels.quant import QuantTensor, qmatmul
from kvlm.kernels.reference import dequantize_ref, fake_quantize_act, qmatmul_int8_ref

INT8_FORMATS = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
SUPER = {T.Q4_K, T.Q5_K, T.Q6_K}

# sha256 (first 16 hex digits) of the (9, 37) float32 outputs of `_bits_case` on the AVX2 path, recorded
# with the row kernel of f97df0a. Change them only with a deliberate change of the AVX2 contract.
AVX2_DIGESTS = {
    "Q4_0": "6a9ae9cfbfd13f08", "Q4_1": "4967d50dff6e3926", "Q5_0": "c15b27c61e237658", "Q5_1": "64b8fc205713a616",
    "Q8_0": "0f610ebf68dde199", "Q4_K": "869493f593f33c06", "Q5_K": "be3bff9e80056463", "Q6_K": "ddb17fa0cd149059",
}


@pytest.fixture
def avx2(force_isa) -> None:
    if not native.available():
        pytest.skip("native kernels not built here (test_kernels.py::test_extension_builds says why)")
    if native.ISAS.index(native.best_isa()) < native.ISAS.index("avx2"):
        pytest.skip(f"this CPU lacks avx2 (best: {native.best_isa()})")
    force_isa("avx2")


def _x(m: int, k: int, seed: int, huge: float) -> torch.Tensor:
    """(m, k) activations from numpy's generator (stable across versions) with the quantizer's edge
    blocks: all-zero, negative zero, rounding ties, huge and tiny magnitudes."""
    x = np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)
    x[0, :32] = 0.0
    x[1, :32] = -0.0
    x[2, :32] = [127.0] + [(j % 8) - 3.5 for j in range(31)]
    x[3, -32:] *= huge
    x[4, :32] *= 1e-30
    return torch.from_numpy(x)


def _bits_case(qtype: T) -> torch.Tensor:
    """9 rows of x against 37 weight rows (the edge rows of random_blocks first), K with a tail of
    blocks past the last group of 4 (32-element formats) or 3 super-blocks."""
    k = 768 if qtype in SUPER else 544
    w = random_blocks(qtype, 37, k, seed=31)
    return qmatmul(_x(9, k, seed=32, huge=1e24 if qtype in SUPER else 1e30), w)


def _digest(y: torch.Tensor) -> str:
    return hashlib.sha256(y.contiguous().numpy().tobytes()).hexdigest()[:16]


@pytest.mark.parametrize("qtype", INT8_FORMATS, ids=lambda t: t.name)
def test_avx2_int8_bits_unchanged(qtype: T, avx2: None) -> None:
    assert kernel_path(qtype) == "avx2+int8"
    assert _digest(_bits_case(qtype)) == AVX2_DIGESTS[qtype.name]


@pytest.mark.parametrize("qtype", INT8_FORMATS, ids=lambda t: t.name)
def test_avx2_int8_rows_and_columns_any_shape(qtype: T, avx2: None) -> None:
    """N = 33 (odd), M = 1..40: every row alone at 1 thread equals the same row in the whole batch at 2
    threads; the columns shifted by one weight row (another thread split, panel and prefetch position)
    keep their bits; all within the reference's float32 bound."""
    k = 512 if qtype in SUPER else 288
    pool = random_blocks(qtype, 34, k, seed=33)
    w = QuantTensor(pool.data[1:], qtype, (33, k))
    shifted = QuantTensor(pool.data, qtype, (34, k))
    x = _x(40, k, seed=34, huge=1e24 if qtype in SUPER else 1e30)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = qmatmul(x, w)
        assert torch.equal(qmatmul(x, shifted)[:, 1:], full)
        for m in (1, 2, 3, 5, 7, 17, 40):
            assert torch.equal(qmatmul(x[:m], w), full[:m]), f"M={m}"
        torch.set_num_threads(1)
        for i in range(40):
            assert torch.equal(qmatmul(x[i:i + 1], w), full[i:i + 1]), f"row {i}"
            assert torch.equal(qmatmul(x[i:i + 1], shifted)[:, 1:], full[i:i + 1]), f"row {i}, shifted"
    finally:
        torch.set_num_threads(before)
    ref = qmatmul_int8_ref(x, w).double()
    bound = 1e-5 * (fake_quantize_act(x).double().abs() @ dequantize_ref(w).double().abs().T) + 1e-30
    err = (full.double() - ref).abs()
    assert (err <= bound).all(), f"max error / bound {(err / bound).max():.3g}"
