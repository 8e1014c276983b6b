"""The AVX2 int8-activation kernel (csrc/kernels_int8_avx2.h: 8-column panels), forced with
KVLM_KERNEL_ISA=avx2.

Since 2026-12-03 it runs the AVX-512 kernels' order contract (test_kernels.py's
`test_int8_kernel_is_its_contract_bit_for_bit` holds every int8 path to `reference.qmatmul_int8_contract`
bit for bit, so AVX2 and AVX-512 agree). This file checks what panels could break: a column's bits
wherever it lands (panel lane, tail panel, thread split, the decode loop's prefetch), any M (weights
used in place for M <= 4, the transposed buffer beyond), 1 or 2 threads, and the reference bound.
"""

from __future__ import annotations

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


@pytest.mark.parametrize("qtype", INT8_FORMATS, ids=lambda t: t.name)
def test_avx2_int8_rows_and_columns_any_shape(qtype: T, avx2: None) -> None:
    """N = 33 (odd), M = 1..40: every row alone at 1 thread equals the same row in the whole batch at 2
    threads; the columns shifted by one weight row (another thread split, panel and prefetch position)
    keep their bits; all within the reference's float32 bound."""
    assert kernel_path(qtype) == "avx2+int8"
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


def test_avx2_q8_0_rows_past_one_widened_chunk(avx2: None) -> None:
    """Q8_0 at more than 4 rows multiplies int16 pairs, x widened 256 rows at a time (gemm_w8): rows on
    either side of that boundary, and of the 4-row tiles within it, keep the bits they have alone (one row:
    the few-rows path) and in a batch that starts elsewhere."""
    k = 288
    pool = random_blocks(T.Q8_0, 37, k, seed=35)
    w = QuantTensor(pool.data, T.Q8_0, (37, k))
    x = _x(600, k, seed=36, huge=1e30)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = qmatmul(x, w)
        assert torch.equal(qmatmul(x[250:530], w), full[250:530])
        torch.set_num_threads(1)
        for i in (0, 3, 4, 254, 255, 256, 257, 511, 512, 513, 599):
            assert torch.equal(qmatmul(x[i:i + 1], w), full[i:i + 1]), f"row {i}"
    finally:
        torch.set_num_threads(before)
    ref = qmatmul_int8_ref(x, w).double()
    bound = 1e-5 * (fake_quantize_act(x).double().abs() @ dequantize_ref(w).double().abs().T) + 1e-30
    assert ((full.double() - ref).abs() <= bound).all()
