"""The dense row kernels (BF16, F16, F32 weights): decode (one row of x, four weight rows in flight) and
prefill (register blocks of x rows by weight rows). F16 and F32 (float32 activations) run the one contract of
`kernels_impl.h`: output (m, n) sums x[m, k] * W[n, k] in lane k % 16 of a 16-lane accumulator in
increasing k, then a fixed tree, so F16 weights give the bits of the same values stored as F32. BF16 runs
`kernels_bf16.h`'s: x rounded to bf16 and vdpbf16ps's order, spelled out where the CPU lacks the
instruction; `reference.qmatmul_bf16_contract` computes it bit for bit. Either way a row has the same bits
whatever M, the block it ran in and the thread count, and the AVX2 and AVX-512 paths (the AVX-512 VNNI
one with the instruction, on a CPU with AVX-512 BF16) agree bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from deps import need_native

from kvlm.kernels import native
from kvlm.kernels.ggml_types import GGMLQuantizationType as T
from kvlm.kernels.quant import QuantTensor, dequantize, qmatmul
from kvlm.kernels.reference import qmatmul_bf16_contract, qmatmul_ref

WIDTHS = {T.BF16: torch.bfloat16, T.F16: torch.float16, T.F32: torch.float32}
MS = [*range(1, 10), 16, 64]
SHAPES = [(45, 50), (37, 96), (64, 2048 + 7), (9, 13)]  # odd N (block tails), K with and without a scalar tail
FMA_ISAS = [i for i in ("avx2", "avx512", "avx512-vnni") if i in native.ISAS]


def _cpu_flag(name: str) -> bool:
    """Whether Linux lists `name` among this CPU's flags (False elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and name in line.split() for line in f)
    except OSError:
        return False


def dense(values: torch.Tensor, qtype: T) -> QuantTensor:
    """(N, K) float32 values (representable in qtype's width) as a QuantTensor of that width."""
    n, k = values.shape
    return QuantTensor(values.to(WIDTHS[qtype]).contiguous().view(torch.uint8).reshape(n, -1).clone(), qtype, (n, k))


def values(n: int, k: int, qtype: T, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(WIDTHS[qtype]).float()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("qtype", list(WIDTHS), ids=lambda t: t.name)
def test_rows_alone_equal_rows_in_any_m_and_the_widened_bits(qtype: T, shape: tuple[int, int], isa: str) -> None:
    n, k = shape
    wv = values(n, k, qtype, seed=n + k)
    w, w32 = dense(wv, qtype), dense(wv, T.F32)
    x = torch.randn(max(MS), k, generator=torch.Generator().manual_seed(7))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([qmatmul(x[i:i + 1], w) for i in range(x.shape[0])])
        torch.set_num_threads(2)
        if qtype == T.BF16:  # bf16 activations: the contract's bits, and near float32's numbers
            assert torch.equal(alone, qmatmul_bf16_contract(x, w))
            bound = 2.0 ** -8 * (x.abs() @ wv.abs().T) + 1e-30
        else:
            bound = 1e-5 * (x.abs() @ wv.abs().T) + 1e-30
        assert ((alone.double() - qmatmul_ref(x, w).double()).abs() <= bound).all()
        for m in MS:
            assert torch.equal(qmatmul(x[:m], w), alone[:m]), f"M={m}"
            assert torch.equal(qmatmul(x[64 - m:], w), alone[64 - m:]), f"last {m} rows"
        if qtype != T.BF16:
            assert torch.equal(qmatmul(x, w32), alone)  # half width == the same values in float32
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("qtype", [T.BF16, T.F16], ids=lambda t: t.name)
def test_every_half_value_widens_exactly(qtype: T, isa: str) -> None:
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(WIDTHS[qtype])
    keep = ~torch.isnan(bits.float())
    every = bits[keep].float()  # every non-NaN value, zero-padded to (64, 1023): K with a scalar tail
    wv = torch.cat([every, torch.zeros(64 * 1023 - every.numel())]).reshape(64, 1023)
    w = dense(wv, qtype)
    assert torch.equal(dequantize(w), wv)
    finite = torch.where(wv.isinf(), 0.0, wv)  # 0 * inf would be NaN below
    x = torch.zeros(3, 1023)
    x[:, 5] = 1.0  # picks one column: each output is exactly one weight
    col = finite[:, 5]
    if qtype == T.BF16:  # vdpbf16ps's arithmetic reads denormal weights as zero
        col = torch.where(col.abs() < torch.finfo(torch.float32).tiny, col * 0.0, col)
    assert torch.equal(qmatmul(x, dense(finite, qtype)), col.expand(3, -1))


@pytest.mark.parametrize("qtype", list(WIDTHS), ids=lambda t: t.name)
def test_avx2_and_avx512_paths_agree_bit_for_bit(qtype: T, force_isa) -> None:
    need_native("compares the native paths")
    isas = [i for i in FMA_ISAS if native.isa_available(i)]
    if len(isas) < 2:
        pytest.skip(f"needs two of {FMA_ISAS}; this CPU has {native.best_isa()}")
    wv = values(70, 2048 + 7, qtype, seed=1)
    w = dense(wv, qtype)
    x = torch.randn(13, 2048 + 7, generator=torch.Generator().manual_seed(2))
    got = {}
    for i in isas:
        force_isa(i)
        got[i] = (qmatmul(x, w), qmatmul(x[:1], w))
    for i in isas[1:]:
        assert torch.equal(got[i][0], got[isas[0]][0]), f"{i} vs {isas[0]}, M = 13"
        assert torch.equal(got[i][1], got[isas[0]][1]), f"{i} vs {isas[0]}, M = 1"
    if qtype == T.BF16:
        assert torch.equal(got[isas[0]][0], qmatmul_bf16_contract(x, w))


def test_the_bf16_instruction_and_its_spelled_out_form_agree(force_isa) -> None:
    """Where the CPU has AVX-512 BF16, the AVX-512 VNNI path runs vdpbf16ps and the AVX-512 path spells it
    out: inputs that reach every corner of the instruction (denormal weights and activations, sums that
    cancel, results below float32's normal range, infinities) give the same bits on both and in the torch
    contract."""
    need_native("compares the instruction with its spelled-out form")
    if not (native.isa_available("avx512-vnni") and _cpu_flag("avx512_bf16")):
        pytest.skip("needs a CPU with AVX-512 BF16")
    g = torch.Generator().manual_seed(3)
    n, k = 40, 2048 + 9
    raw = torch.randint(-32768, 32768, (n, k), generator=g, dtype=torch.int32).to(torch.int16)
    wv = raw.view(torch.bfloat16).float()
    wv = torch.where(wv.isnan() | wv.isinf(), 1.0, wv)  # extreme but finite: products may still overflow
    wv[:, :64] *= 2.0 ** -120  # denormal weights, and products below float32's range
    x = torch.randn(9, k, generator=g)
    x[:, 64:128] = -x[:, 64:128]  # rows that cancel
    x[0, :32] = 2.0 ** -130  # denormal activations
    w = dense(wv, T.BF16)
    got = {}
    for isa in ("avx512", "avx512-vnni"):
        force_isa(isa)
        got[isa] = (qmatmul(x, w), torch.cat([qmatmul(x[i:i + 1], w) for i in range(x.shape[0])]))
    want = qmatmul_bf16_contract(x, w)
    for isa, (batch, rows) in got.items():
        assert torch.equal(batch.nan_to_num(), want.nan_to_num()), isa
        assert torch.equal(rows.nan_to_num(), want.nan_to_num()), isa
