"""The one backend decision (kvlm/kernels/backend.py): what it picks for each device, dtype and head_dim, that
it says why, and that nothing else in kvlm re-derives whether the native kernels are active."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from deps import need_native

from kvlm.kernels import native
from kvlm.kernels.backend import kernel_path, native_isa, select_backend
from kvlm.kernels.ggml_types import GGMLQuantizationType as T

CPU = torch.device("cpu")
KVLM = Path(__file__).resolve().parents[2] / "kvlm"


@pytest.fixture
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Set KVLM_KERNEL_ISA for one test (the process re-reads it), restored after."""
    def force(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(native.ENV_ISA, raising=False)
        else:
            monkeypatch.setenv(native.ENV_ISA, value)
        native.refresh()
    yield force
    monkeypatch.undo()
    native.refresh()


def test_native_cpu_float32_reads_the_cache_in_place(isa) -> None:
    need_native()
    isa(None)
    b = select_backend(CPU, torch.float32, 64)
    assert (b.isa, b.attention, b.elementwise, b.sampler) == (native.best_isa(), "paged-native", "native", "native")
    assert b.in_place and b.native_rows and not b.degraded
    assert any("paged-native" in r for r in b.reasons) and b.isa in b.describe()
    assert native_isa(torch.zeros(2)) == b.isa and native_isa(torch.zeros(2, dtype=torch.float16)) is None


def test_a_head_dim_the_kernel_cannot_read_is_said_at_load(isa) -> None:
    need_native()
    isa(None)
    b = select_backend(CPU, torch.float32, 72)
    assert b.attention == "paged-sdpa" and b.degraded
    assert any("head_dim 72" in r for r in b.reasons)


def test_half_precision_and_cuda_and_reference(isa) -> None:
    need_native()
    isa(None)
    half = select_backend(CPU, torch.bfloat16, 64)
    assert (half.attention, half.elementwise, half.native_rows, half.degraded) == ("paged-sdpa", "torch", False, False)
    cuda = select_backend(torch.device("cuda"), torch.float16, 64)
    assert (cuda.isa, cuda.attention, cuda.elementwise) == ("reference", "gathered-sdpa", "torch")
    isa("reference")
    ref = select_backend(CPU, torch.float32, 64)
    assert (ref.isa, ref.attention, ref.in_place) == ("reference", "gathered-sdpa", False)
    assert "KVLM_KERNEL_ISA=reference" in ref.reasons[0]
    assert kernel_path(T.Q4_K) == "reference"


def test_with_decode_records_the_fused_choice(isa) -> None:
    isa(None)
    b = select_backend(CPU, torch.float32, 64).with_decode("modules", "disabled by KVLM_FUSED_DECODE=0")
    assert b.decode == "modules" and b.reasons[-1] == "decode modules: disabled by KVLM_FUSED_DECODE=0"
    assert b.as_dict()["decode"] == "modules" and "decode modules" in b.summary()


def test_only_the_backend_module_asks_whether_the_native_kernels_are_active() -> None:
    """`native.active_isa()` is read in two modules: native.py, which defines it, and backend.py."""
    readers = sorted(p.relative_to(KVLM).as_posix() for p in KVLM.rglob("*.py")
                     if re.search(r"\bactive_isa\(", p.read_text()))
    assert readers == ["kernels/backend.py", "kernels/native.py"], readers
