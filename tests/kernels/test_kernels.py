"""Kernel exactness: every native path against its pure-PyTorch reference.

Paths are forced with KVLM_KERNEL_ISA (scalar, avx2, avx512, avx512-vnni; those this CPU lacks are
skipped), at 1 and 2 threads. Tolerances:
- dequantize: bit-identical to the gguf package's decoder, except Q4_1 / Q4_K / Q5_K whose `q * d + m`
  may be one fused multiply-add here (one rounding instead of two): within 2 ulp of the magnitude.
- qmatmul: |kernel - reference| <= 1e-5 * (|x| @ |W|.T) + 1e-30, the bound for float32 sums of the
  same products added in another order (K <= 1536 here). The reference is `qmatmul_ref` for float32
  activations, `qmatmul_int8_ref` (fake-quantized x, same bound with |x_fq|) where the path quantizes
  activations to int8 (Q4_0 / Q4_1 / Q8_0 on the AVX2 / AVX-512 paths, the default). BF16 weights on the
  row kernels (bf16 activations, csrc/kernels_bf16.h) equal `qmatmul_bf16_contract` bit for bit.
- paged attention: within 2e-5 (absolute and relative) of gather + SDPA on the same cache values (float16
  / bfloat16 caches are widened exactly, so the tolerance is the float32 one): the kernel sums in chunks
  of 128 tokens, 16-lane trees and an online softmax, SDPA in its own order.
And bit-exact: a row's result from the row kernel does not depend on M, on which rows share the call,
or on the thread count; a sequence's attention output does not depend on the batch around it or on
the thread count.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from deps import in_ci, need_native
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from quantize import random_blocks  # noqa: E402  (tests/helpers)

from kvlm.kernels import native, paged_decode_attention, quant
from kvlm.kernels.backend import kernel_path
from kvlm.kernels.quant import (
    INT8_ACT_TYPES,
    QuantTensor,
    dequantize,
    qmatmul,
)
from kvlm.kernels.reference import (
    dequantize_ref,
    fake_quantize_act,
    paged_decode_attention_ref,
    qmatmul_bf16_contract,
    qmatmul_int8_contract,
    qmatmul_int8_ref,
    qmatmul_ref,
)

ROWS = 8  # the row kernel decodes a weight block once for up to this many rows of x

FORMATS = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.F16, T.BF16, T.F32]
ROUNDED = {T.Q4_1, T.Q5_1, T.Q4_K, T.Q5_K}  # q * d + m: fused here, two roundings in the reference
ISAS = list(native.ISAS)
INT8_ISAS = set(native.ISAS)  # paths with the int8-activation kernel: all (portable and NEON too)
INT8_FORMATS = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]  # int8 activations there
SUPER = {T.Q4_K, T.Q5_K, T.Q6_K}  # 256-element blocks


def int8_path(qtype: T, isa: str) -> bool:
    """Whether qmatmul quantizes activations to int8 for this type on this path (the default)."""
    return qtype in INT8_ACT_TYPES and isa in INT8_ISAS and native.int8_activations()


def expected_path(qtype: T, isa: str) -> str:
    return f"{isa}+int8" if int8_path(qtype, isa) else isa


def reference(x: torch.Tensor, w: QuantTensor, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference result, error bound) for qmatmul(x, w) on this path."""
    if w.qtype == T.BF16 and native.available() and x.shape[0] <= quant.GEMV_MAX_ROWS:  # the row kernels
        return qmatmul_bf16_contract(x, w), torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    xr = fake_quantize_act(x) if int8_path(w.qtype, isa) else x
    return qmatmul_ref(xr, w), matmul_bound(xr, w)
def row_length(qtype: T) -> int:
    """A K that is a multiple of the block size but not of 256 where the format allows it."""
    elems = GGML_QUANT_SIZES[qtype][0]
    return 50 if elems == 1 else (2 * 256 if elems == 256 else 3 * 32)


@pytest.mark.parametrize("qtype", INT8_FORMATS, ids=lambda t: t.name)
def test_int8_activations_within_their_rounding(qtype: T, isa: str) -> None:
    """Int8 activations (the default here) against float32 activations: error bounded by the
    activation rounding (half a step of each 32-block's int8 scale, times the weights' magnitudes)
    plus float32 summation; rows still independent."""
    if isa not in INT8_ISAS:
        pytest.skip("the int8-activation kernel exists on the AVX2 and AVX-512 paths")
    assert kernel_path(qtype) == f"{isa}+int8"
    k = 512 if qtype in SUPER else 96
    w = random_blocks(qtype, 45, k, seed=14)
    x = torch.randn(ROWS, k, generator=torch.Generator().manual_seed(15))
    x[0, :32] = 0.0  # an all-zero activation block (scale 0)
    got = qmatmul(x, w)
    step = x.abs().reshape(x.shape[0], -1, 32).amax(-1, keepdim=True) / 127  # (M, K/32, 1) int8 scale
    wabs = dequantize_ref(w).double().abs().reshape(45, -1, 32).sum(-1)  # (N, K/32)
    bound = 0.5001 * (step.squeeze(-1).double() @ wabs.T) + matmul_bound(x, w)
    err = (got.double() - qmatmul_ref(x, w).double()).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g}"
    for i in (0, 3, ROWS - 1):
        assert torch.equal(qmatmul(x[i:i + 1], w), got[i:i + 1])


def test_unknown_activation_mode_is_a_readable_error(monkeypatch: pytest.MonkeyPatch, force_isa) -> None:
    monkeypatch.setenv(native.ENV_ACT, "fp8")
    native.refresh()
    with pytest.raises(ValueError, match="KVLM_KERNEL_ACT must be f32 or int8"):
        native.int8_activations()


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def matmul_bound(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    return 1e-5 * (x.double().abs() @ dequantize_ref(w).double().abs().T) + 1e-30


def test_extension_builds() -> None:
    """Where a C++ compiler exists on x86-64, the native kernels must build (else CI would only test the fallback).
    In CI (`CI=true`) the compiler must exist too: .ci/run installs g++."""
    import platform
    import shutil

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"the native kernels target x86-64, this is {platform.machine()}")
    if shutil.which(os.environ.get("CXX", "c++")) is None and not in_ci():
        pytest.skip("no C++ compiler here (Debian: apt install g++)")
    assert native.available()
    assert native.best_isa() in ISAS


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_dequantize_matches_reference(qtype: T, isa: str) -> None:
    w = random_blocks(qtype, 37, row_length(qtype), seed=1)
    assert kernel_path(qtype) == expected_path(qtype, isa)
    got, ref = dequantize(w), dequantize_ref(w)
    if qtype in ROUNDED:
        torch.testing.assert_close(got, ref, rtol=2.4e-7, atol=0.0, equal_nan=False)
    else:
        assert torch.equal(got, ref)
        # negative zero survives decoding where the reference keeps it
        assert torch.equal(torch.signbit(got), torch.signbit(ref))


@pytest.mark.parametrize("tiled", [False, True], ids=["row-kernel", "tiled-blas"])
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_qmatmul_matches_reference(qtype: T, isa: str, threads: int, tiled: bool,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if tiled:  # the dequantize-a-tile + BLAS path, reachable by lowering the limit
        monkeypatch.setattr(quant, "GEMV_MAX_ROWS", ROWS)
        monkeypatch.setattr(quant, "INT8_ROW_MAX_ROWS", ROWS)
    k = row_length(qtype)
    w = random_blocks(qtype, 45, k, seed=2)  # N = 45: not a multiple of any block or vector width
    gen = torch.Generator().manual_seed(3)
    for m in (1, 2, 3, 5, 7, ROWS, ROWS + 1, 33, 64):
        x = torch.randn(m, k, generator=gen)
        ref, bound = reference(x, w, isa)
        err = (qmatmul(x, w).double() - ref.double()).abs()
        assert (err <= bound).all(), f"M={m}: max error {err.max():.3g}"


def test_qmatmul_keeps_leading_dims(isa: str) -> None:
    w = random_blocks(T.Q4_1, 20, 64, seed=4)
    x = torch.randn(2, 3, 64)
    assert qmatmul(x, w).shape == (2, 3, 20)
    assert torch.equal(qmatmul(x, w), qmatmul(x.reshape(6, 64), w).reshape(2, 3, 20))


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_row_result_independent_of_batch_and_threads(qtype: T, isa: str) -> None:
    """A row alone == the same row in a batch of any size (decode batches, prefill chunks), bit for bit,
    at any thread count: every format's default path is row-invariant."""
    k = row_length(qtype)
    w = random_blocks(qtype, 300, k, seed=5)
    x = torch.randn(41, k, generator=torch.Generator().manual_seed(6))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = qmatmul(x, w)
        torch.set_num_threads(1)
        for i in range(x.shape[0]):
            assert torch.equal(qmatmul(x[i:i + 1], w), batch[i:i + 1]), f"row {i}"
        assert torch.equal(qmatmul(x[5:11], w), batch[5:11])
        assert torch.equal(qmatmul(x[3:36], w), batch[3:36])
    finally:
        torch.set_num_threads(before)


def test_lora_kernels_bfloat16_equals_float32_on_the_same_values(isa: str) -> None:
    """LoRA's two products (`kvlm.lora.adapter`): A as F32 rows, one row of x (four weight rows at a time,
    then the rest; a row tail past the last 32) == that row in a batch; B (`lora_b_add`) with B^T in
    bfloat16 (`compact`) == float32 == the reference, bit for bit. (A is never kept as BF16 rows: those run
    with bf16 activations, csrc/kernels_bf16.h.)"""
    from kvlm.kernels.elementwise import lora_b_add
    from kvlm.kernels.reference import lora_b_add_ref
    from kvlm.lora.adapter import compact, f32_rows

    g = torch.Generator().manual_seed(11)
    a = torch.randn(19, 72, generator=g).bfloat16().float()  # 19 rows: 4 x 4 + 3; 72 = 2 x 32 + a tail of 8
    assert compact(a).dtype == torch.bfloat16 and compact(a + 1e-3).dtype == torch.float32
    x = torch.randn(3, 72, generator=g)
    a32 = f32_rows(a)
    assert a32.qtype == T.F32
    batch = qmatmul(x, a32)
    for i in range(3):
        assert torch.equal(qmatmul(x[i:i + 1], a32), batch[i:i + 1])
    spans = torch.tensor([[0, 8, 0, 40], [8, 11, 40, 24]])  # two parts: ranks 8 and 11, outputs 40 and 24
    bt = (torch.randn(8 * 40 + 11 * 24, generator=g) * 0.5).bfloat16().float()
    y0 = torch.randn(3, 64, generator=g)
    want = lora_b_add_ref(batch, bt, spans, y0.clone())
    for b in (bt, compact(bt)):
        assert torch.equal(lora_b_add(batch, b, spans, y0.clone()), want), b.dtype


def test_reference_path_forced(force_isa) -> None:
    force_isa("reference")
    w = random_blocks(T.Q4_1, 10, 64, seed=7)
    x = torch.randn(3, 64)
    assert kernel_path(T.Q4_1) == "reference"
    assert torch.equal(qmatmul(x, w), qmatmul_ref(x, w))
    assert torch.equal(dequantize(w), dequantize_ref(w))


def test_unknown_isa_is_a_readable_error(force_isa) -> None:
    force_isa("avx9000")
    with pytest.raises(ValueError, match="KVLM_KERNEL_ISA must be one of"):
        kernel_path(T.Q4_1)


def test_types_without_kernel_use_reference(isa: str) -> None:
    assert kernel_path(T.Q2_K) == "reference"


_FALLBACK_SCRIPT = (
    "import torch\n"
    "from gguf import GGMLQuantizationType as T\n"
    "from quantize import random_blocks\n"
    "from kvlm.kernels import kernel_path, qmatmul, paged_decode_attention\n"
    "from kvlm.kernels.reference import qmatmul_ref\n"
    "w = random_blocks(T.Q4_1, 10, 64, seed=0); x = torch.randn(2, 64)\n"
    "assert torch.equal(qmatmul(x, w), qmatmul_ref(x, w))\n"
    "q = torch.randn(1, 2, 16); kv = torch.randn(2, 4, 1, 16)\n"
    "paged_decode_attention(q, kv, kv, torch.tensor([[0, 1]], dtype=torch.int32),"
    " torch.tensor([5], dtype=torch.int32), 0.25)\n"
    "print(kernel_path(T.Q4_1))\n"
)


def _run_with_compiler(cxx: str, home: Path) -> list[str]:
    """Run kernels in a fresh process whose build uses `cxx`; return its stderr's lines, having checked
    that it fell back to the reference kernels and gave correct results without a crash."""
    path = f"{Path(__file__).parents[2]}:{Path(__file__).parents[1] / 'helpers'}"  # kvlm, and tests/helpers
    env = {**os.environ, "KVLM_HOME": str(home), "CXX": cxx, "PYTHONPATH": path}
    env.pop(native.ENV_ISA, None)
    r = subprocess.run([sys.executable, "-c", _FALLBACK_SCRIPT], check=False, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "reference"
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    # One line of ours, and nothing of torch's: its cpp_extension warning block ("!! WARNING !!", "Your
    # compiler (...) is not compatible") or a traceback would be noise around the one thing to do.
    assert len(lines) == 1, r.stderr
    for noise in ("WARNING", "!!", "cpp_extension", "Traceback", "compatible"):
        assert noise not in r.stderr, r.stderr
    assert lines[0].startswith("kvlm: ") and "PyTorch reference" in lines[0] and "much slower" in lines[0], lines
    return lines


@pytest.mark.parametrize(("cxx", "what"), [("/bin/false", "the C++ compiler /bin/false does not work"),
                                           ("/nonexistent/c++", "no C++ compiler (/nonexistent/c++ not found)")],
                         ids=["broken", "missing"])
def test_fallback_when_there_is_no_compiler(tmp_path: Path, cxx: str, what: str) -> None:
    """No working compiler: one line saying which compiler is missing or broken, what it costs and how to fix it."""
    (line,) = _run_with_compiler(cxx, tmp_path)
    assert what in line, line
    assert "apt install g++" in line and "CXX" in line, line


def test_fallback_when_the_build_fails(tmp_path: Path) -> None:
    """A compiler that works but fails on our sources (a stand-in for missing headers): one line with the
    compiler's first error and where the whole output is, and none of torch's warnings. The wrapper answers
    `-v` as no gcc does, so torch's build does warn that it does not recognise the compiler: that is held back."""
    import shutil

    gxx = shutil.which("g++")
    if gxx is None:
        (pytest.fail if in_ci() else pytest.skip)("no g++ to wrap (.ci/run installs it)")
    wrapper = tmp_path / "cxx-wrapper"
    wrapper.write_text("#!/bin/sh\n"
                       '[ "$1" = -v ] && { echo "some compiler"; exit 0; }\n'
                       'for a in "$@"; do [ "$a" = -c ] && { echo "x.cpp:1:1: error: simulated" >&2; exit 1; }; done\n'
                       f'exec {gxx} "$@"\n')
    wrapper.chmod(0o755)
    (line,) = _run_with_compiler(str(wrapper), tmp_path / "home")
    assert "the native kernels failed to build (x.cpp:1:1: error: simulated; full output in " in line, line
    log = Path(line.split("full output in ")[1].split("):")[0])
    assert "error: simulated" in log.read_text()


@pytest.fixture
def no_attention_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make sure the native kernel, not the reference, is what a test measures."""
    def refuse(*args, **kwargs):
        raise AssertionError("paged_decode_attention fell back to the reference")

    # The module itself: kvlm.kernels.paged_attention as an attribute is the function of that name.
    monkeypatch.setattr(sys.modules["kvlm.kernels.paged_attention"], "paged_decode_attention_ref", refuse)


def _paged_case(seed: int, lens: list[int], heads: int, kv_heads: int, d: int = 64, block_size: int = 16):
    gen = torch.Generator().manual_seed(seed)
    b = len(lens)
    max_blocks = max(1, max((n + block_size - 1) // block_size for n in lens))
    num_blocks = b * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[: b * max_blocks].reshape(b, max_blocks).to(torch.int32)
    q = torch.randn(b, heads, d, generator=gen)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def _paged_lens(b: int) -> list[int]:
    """b ragged lengths: empty, one token, block-size multiples and neighbours, and long ones (several
    128-token chunks, a partial last chunk)."""
    return [0, 1, 700, 16, 17, 128, 129, 1000][:b]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize(("heads", "kv_heads"), [(3, 3), (9, 3), (8, 2)], ids=["G1", "G3", "G4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_paged_attention_ragged_batches(isa: str, threads: int, dtype: torch.dtype, heads: int, kv_heads: int,
                                        d: int, no_attention_fallback: None) -> None:
    """B 1..8 of ragged lengths (0, 1, block-size multiples, > several chunks), GQA groups 1 / 3 / 4."""
    q, kc, vc, tables, seq_lens = _paged_case(21, _paged_lens(8), heads, kv_heads, d=d)
    kc, vc = kc.to(dtype), vc.to(dtype)
    for b in (1, 2, 5, 8):
        got = paged_decode_attention(q[:b], kc, vc, tables[:b], seq_lens[:b], d ** -0.5)
        ref = paged_decode_attention_ref(q[:b], kc, vc, tables[:b], seq_lens[:b], d ** -0.5)
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
        assert torch.equal(got[0], torch.zeros_like(got[0]))  # length 0: attends to nothing


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_paged_attention_other_block_sizes(isa: str, block_size: int, no_attention_fallback: None) -> None:
    """16-token groups and 128-token chunks cross block boundaries anywhere."""
    q, kc, vc, tables, seq_lens = _paged_case(22, [5, 300, 33], 6, 2, block_size=block_size)
    got = paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125)
    ref = paged_decode_attention_ref(q, kc, vc, tables, seq_lens, 0.125)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_paged_attention_sequence_independent_of_batch_and_threads(isa: str, dtype: torch.dtype,
                                                                   no_attention_fallback: None) -> None:
    """Bit for bit: a sequence alone == the same sequence in any batch, at 1 and at 2 threads (its chunks
    and their combine order depend on its length only)."""
    lens = _paged_lens(8)
    q, kc, vc, tables, seq_lens = _paged_case(23, lens, 9, 3)
    kc, vc = kc.to(dtype), vc.to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [paged_decode_attention(q[i:i + 1], kc, vc, tables[i:i + 1], seq_lens[i:i + 1], 0.125)
                 for i in range(len(lens))]
        torch.set_num_threads(2)
        batch = paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125)
        flip = paged_decode_attention(q.flip(0), kc, vc, tables.flip(0), seq_lens.flip(0), 0.125).flip(0)
        alone2 = [paged_decode_attention(q[i:i + 1], kc, vc, tables[i:i + 1], seq_lens[i:i + 1], 0.125)
                  for i in range(len(lens))]
    finally:
        torch.set_num_threads(before)
    for i in range(len(lens)):
        assert torch.equal(batch[i:i + 1], alone[i]), f"sequence {i} (length {lens[i]}) differs in the batch"
        assert torch.equal(flip[i:i + 1], alone[i])
        assert torch.equal(alone2[i], alone[i]), f"sequence {i} differs at 2 threads"


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4), (8, 1)])
def test_paged_attention_matches_gather_sdpa(isa: str, threads: int, heads: int, kv_heads: int,
                                             no_attention_fallback: None) -> None:
    lens = [1, 16, 17, 100, 0, 333]
    q, kc, vc, tables, seq_lens = _paged_case(8, lens, heads, kv_heads)
    got = paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125)
    ref = paged_decode_attention_ref(q, kc, vc, tables, seq_lens, 0.125)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
    assert torch.equal(got[4], torch.zeros_like(got[4]))  # length 0: attends to nothing


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_half_caches(isa: str, dtype: torch.dtype, no_attention_fallback: None) -> None:
    """float16 / bfloat16 caches are read (and widened) in place; the arithmetic stays float32."""
    q, kc, vc, tables, seq_lens = _paged_case(13, [3, 50, 129], 9, 3)
    kc, vc = kc.to(dtype), vc.to(dtype)
    got = paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125)
    ref = paged_decode_attention_ref(q, kc, vc, tables, seq_lens, 0.125)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)


def test_paged_attention_large_scores(isa: str, no_attention_fallback: None) -> None:
    """Scores far apart (online softmax rescaling, exp underflow to 0) still match."""
    q, kc, vc, tables, seq_lens = _paged_case(9, [70, 40], 6, 2, d=32, block_size=8)
    got = paged_decode_attention(q * 30, kc, vc, tables, seq_lens, 1.0)
    ref = paged_decode_attention_ref(q * 30, kc, vc, tables, seq_lens, 1.0)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)


def test_paged_attention_rejects_bad_block_table(isa: str) -> None:
    q, kc, vc, tables, seq_lens = _paged_case(10, [20], 4, 2)
    tables[0, 1] = kc.shape[0]  # past the cache
    with pytest.raises(RuntimeError, match="outside the cache"):
        paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125)


@pytest.mark.parametrize("m", [1, ROWS + 3])
def test_out_buffers_receive_the_result(isa: str, m: int) -> None:
    w = random_blocks(T.Q4_1, 20, 64, seed=11)
    x = torch.randn(m, 64)
    out = torch.full((m, 20), float("nan"))
    assert qmatmul(x, w, out=out) is not None
    assert torch.equal(out, qmatmul(x, w))
    with pytest.raises(ValueError, match="out must be"):
        qmatmul(x, w, out=torch.empty(m, 21))
    q, kc, vc, tables, seq_lens = _paged_case(12, [5, 40], 4, 2)
    o = torch.empty_like(q)
    paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125, out=o)
    assert torch.equal(o, paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125))


# ---- int8 activations (INT8_FORMATS on the AVX2 / AVX-512 paths, the default) ---------------------

def int8_activation_cases(k: int, m: int = 64, seed: int = 20, huge: float = 1e30) -> torch.Tensor:
    """(m, k) activations with the quantizer's edge blocks in the first rows: an all-zero block,
    a negative-zero block, a block at rounding ties (d = 1: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> -0),
    a block of huge and one of tiny magnitudes (`huge`: K-quant sub-scales multiply the max-scale weight
    row by up to 127 more, so 1e24 keeps their products finite)."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0
    x[1, :32] = -0.0
    ties = torch.tensor([127.0] + [(j % 8) - 3.5 for j in range(31)])  # amax 127 -> d = 1
    x[2, :32] = ties
    x[3, -32:] = x[3, -32:] * huge
    x[4, :32] = x[4, :32] * 1e-30
    return x


def huge(qtype: T) -> float:
    return 1e24 if qtype in SUPER else 1e30


# 32-element formats: 1, 3, 9, 17, 18 blocks (groups of 8 plus tails; 96, 288, 544: K % 256 != 0);
# K-quants: 1, 3, 6 super-blocks.
INT8_CASES = [(q, k) for q in INT8_FORMATS for k in ((256, 768, 1536) if q in SUPER else (32, 96, 288, 544, 576))]


@pytest.mark.parametrize(("qtype", "k"), INT8_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_int8_kernel_matches_fake_quant_reference(qtype: T, k: int, isa: str, threads: int) -> None:
    """The int8 kernel against `qmatmul_int8_ref` (fake-quantize x, float32 matmul) within the float32
    summation bound, for every M = 1..64 (row tiles of 8 and their remainders), N = 45 (not a multiple
    of any tile) with the all-zero, max-scale and negative-zero weight rows; and each row's bits do not
    depend on M."""
    if isa not in INT8_ISAS:
        pytest.skip("the int8-activation kernel exists on the AVX2 and AVX-512 paths")
    assert kernel_path(qtype) == f"{isa}+int8"
    w = random_blocks(qtype, 45, k, seed=21)
    x = int8_activation_cases(k, huge=huge(qtype))
    full = qmatmul(x, w)
    ref, bound = qmatmul_int8_ref(x, w).double(), matmul_bound(fake_quantize_act(x), w)
    err = (full.double() - ref).abs()
    assert (err <= bound).all(), f"max error / bound {(err / bound).max():.3g}"
    assert torch.isfinite(full).all()
    for m in range(1, 65):
        assert torch.equal(qmatmul(x[:m], w), full[:m]), f"M={m}"


@pytest.mark.parametrize("qtype", INT8_FORMATS, ids=lambda t: t.name)
def test_int8_kernel_is_its_contract_bit_for_bit(qtype: T, isa: str) -> None:
    """Every int8 path (AVX2, AVX-512, AVX-512 VNNI) computes the same bits: the order contract that
    `qmatmul_int8_contract` spells out in numpy (exact integer unit sums, then one float32 fma per
    32-element block, mins likewise), here for M = 9 (a tile of 4 rows, its remainder) and M = 3 (weights
    used in place), N = 37 (panels and a tail), a K with a tail past the last 8 blocks, the edge rows.
    Then every M of a multi-row decode step (speculative verification: k + 1 rows; a small batch), 1 to 9,
    16 and 17, from the first row and from row 5 (the edge rows elsewhere in the tile): each of the few-row
    and many-row work orders on its boundaries must be the contract too. K-quants also at K = 2304 (9
    super-blocks): AVX-512's streamed decode (whole rows, two streams a panel, K / 256 group sums a row), and Q4_K's
    few-row path past K = 2048. And M = 32, 33, 48 and 50: avx512-amx's tiles of 32 and 16 rows with the
    rest on the VNNI tiles, N = 37 giving a pair of panels and a lone tail panel."""
    if isa not in INT8_ISAS:
        pytest.skip("the int8-activation kernel exists on the AVX2 and AVX-512 paths")
    for k in (768, 2304) if qtype in SUPER else (544,):
        w = random_blocks(qtype, 37, k, seed=31)
        x = int8_activation_cases(k, m=55, huge=huge(qtype))
        want = qmatmul_int8_contract(x, w).view(torch.int32)
        assert torch.isfinite(want.view(torch.float32)).all()
        assert torch.equal(qmatmul(x[:9], w).view(torch.int32), want[:9]), f"K={k}"
        assert torch.equal(qmatmul(x[:3], w).view(torch.int32), want[:3]), f"K={k}"
        for m in (1, 2, 4, 5, 6, 7, 8, 16, 17, 32, 33, 48, 50):
            for r0 in (0, 5):
                got = qmatmul(x[r0:r0 + m], w).view(torch.int32)
                assert torch.equal(got, want[r0:r0 + m]), f"K={k} M={m} from row {r0}"


@pytest.mark.parametrize("qtype", INT8_FORMATS, ids=lambda t: t.name)
def test_int8_row_alone_equals_row_in_any_batch(qtype: T, isa: str) -> None:
    """A row computed alone (1 thread) has the same bits as inside M = 37 or M = 64 at 2 threads."""
    if isa not in INT8_ISAS:
        pytest.skip("the int8-activation kernel exists on the AVX2 and AVX-512 paths")
    k = 768 if qtype in SUPER else 576
    w = random_blocks(qtype, 300, k, seed=22)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(23))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        b37, b64 = qmatmul(x[:37], w), qmatmul(x, w)
        torch.set_num_threads(1)
        for i in (0, 7, 8, 20, 36):
            alone = qmatmul(x[i:i + 1], w)
            assert torch.equal(alone, b37[i:i + 1]) and torch.equal(alone, b64[i:i + 1]), f"row {i}"
        assert torch.equal(qmatmul(x[20:57], w), b64[20:57])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("qtype", INT8_FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 47])  # one lane, a partial panel, one panel, panels + tails
def test_int8_column_bits_independent_of_its_panel(qtype: T, n: int, isa: str) -> None:
    """The AVX-512 kernel computes 16 output columns per vector (a panel; tail columns are masked lanes,
    threads take whole panels). A column's bits must not depend on which panel or lane it lands in, on N,
    or on M (few rows: weights used in place; more: the transposed panel buffer, tiles of 4 rows and their
    remainders); and every result stays within the float32 bound of the fake-quant reference."""
    if isa not in INT8_ISAS:
        pytest.skip("the int8-activation kernel exists on the AVX2 and AVX-512 paths")
    k = 512 if qtype in SUPER else 288  # 2 super-blocks, 9 blocks
    pool = random_blocks(qtype, n + 16, k, seed=26)
    x = int8_activation_cases(k, m=37, huge=huge(qtype))
    w = QuantTensor(pool.data[16:], qtype, (n, k))
    base = qmatmul(x, w)  # (37, n)
    err = (base.double() - qmatmul_int8_ref(x, w).double()).abs()
    assert (err <= matmul_bound(fake_quantize_act(x), w)).all(), f"max error / bound {err.max():.3g}"
    for shift in (1, 5, 15, 16):  # the same columns at lanes shift.. of the first panel, or in the next one
        shifted = QuantTensor(pool.data[16 - shift:], qtype, (n + shift, k))
        assert torch.equal(qmatmul(x, shifted)[:, shift:], base), f"shift {shift}"
    for m in (1, 2, 3, 4, 5, 8, 9, 36):
        assert torch.equal(qmatmul(x[:m], w), base[:m]), f"M={m}"
    for j in {0, n // 2, n - 1}:  # a column alone
        one = QuantTensor(pool.data[16 + j:17 + j], qtype, (1, k))
        assert torch.equal(qmatmul(x, one), base[:, j:j + 1]), f"column {j}"


def test_fake_quantize_op_matches_reference(isa: str) -> None:
    """The native activation quantizer (all ISA paths with int8 kernels) gives the reference's bits."""
    if isa not in INT8_ISAS:
        pytest.skip("the int8-activation kernel exists on the AVX2 and AVX-512 paths")
    x = int8_activation_cases(576, m=9)
    out = torch.empty_like(x)
    native.ops().fake_quantize_act(x, native.isa_id(isa), out)
    ref = fake_quantize_act(x)
    assert torch.equal(out, ref)
    assert torch.equal(ref[2, :8], torch.tensor([127.0, -4.0, -2.0, -2.0, -0.0, 0.0, 2.0, 2.0]))  # ties to even


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q5_0, T.Q6_K], ids=lambda t: t.name)
def test_int8_blas_route_for_many_rows(qtype: T, isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above INT8_ROW_MAX_ROWS: fake-quantized x, dequantized tile, BLAS: the same numerics."""
    if isa not in INT8_ISAS:
        pytest.skip("the int8-activation kernel exists on the AVX2 and AVX-512 paths")
    monkeypatch.setattr("kvlm.kernels.quant.INT8_ROW_MAX_ROWS", 8)
    k = 512 if qtype in SUPER else 288
    w = random_blocks(qtype, 45, k, seed=24)
    x = int8_activation_cases(k, m=33, huge=huge(qtype))
    err = (qmatmul(x, w).double() - qmatmul_int8_ref(x, w).double()).abs()
    assert (err <= matmul_bound(fake_quantize_act(x), w)).all()


def test_f32_activations_opt_out(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """KVLM_KERNEL_ACT=f32: Q4_1 keeps float32 activations (the row kernel, then tile + BLAS)."""
    monkeypatch.setenv(native.ENV_ACT, "f32")
    native.refresh()
    try:
        assert kernel_path(T.Q4_1) == isa
        w = random_blocks(T.Q4_1, 45, 96, seed=25)
        for m in (1, ROWS + 1):
            x = torch.randn(m, 96)
            err = (qmatmul(x, w).double() - qmatmul_ref(x, w).double()).abs()
            assert (err <= matmul_bound(x, w)).all()
    finally:
        monkeypatch.delenv(native.ENV_ACT)
        native.refresh()


def test_elementwise_kernels_match_their_references() -> None:
    """rms_norm, silu_mul and apply_rope (kernels/elementwise.py: the native functions the fused decode
    step shares with the module path) against their PyTorch references."""
    need_native("the native element-wise kernels are what is compared")
    from kvlm.kernels.elementwise import apply_rope, rms_norm, silu_mul
    from kvlm.kernels.reference import rms_norm_ref, rope_ref, silu_mul_ref

    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 576, generator=g) * 3
    w = torch.randn(576, generator=g)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), atol=1e-5, rtol=1e-5)
    gu = torch.randn(4, 2 * 1537, generator=g) * 6  # a width that is not a multiple of 16: the tail path
    torch.testing.assert_close(silu_mul(gu), silu_mul_ref(gu), atol=1e-5, rtol=1e-5)
    qk = torch.randn(3, 15, 64, generator=g)[:, :12]  # a strided view, as the model passes it
    ang = torch.randn(3, 1, 32, generator=g)
    cos = torch.cat((ang.cos(), ang.cos()), -1)
    sin = torch.cat((-ang.sin(), ang.sin()), -1)
    torch.testing.assert_close(apply_rope(qk, cos, sin), rope_ref(qk, cos, sin), atol=1e-6, rtol=1e-6)
