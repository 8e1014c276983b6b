"""Fixtures the kernel tests share."""

from __future__ import annotations

import importlib

import pytest
from deps import need_native

from kvlm.kernels import native


@pytest.fixture
def force_isa(monkeypatch: pytest.MonkeyPatch):
    """force_isa(path): set KVLM_KERNEL_ISA for this test (read once per process, so refreshed)."""
    def force(path: str) -> None:
        monkeypatch.setenv(native.ENV_ISA, path)
        native.refresh()

    yield force
    monkeypatch.undo()
    native.refresh()


# The paged attention tests' fixtures (test_paged_attention*.py, test_kv_quant.py).
@pytest.fixture(params=list(native.ISAS))
def isa(request: pytest.FixtureRequest, force_isa) -> str:
    """Each ISA path in turn, forced; those this CPU lacks (or all, without a native build) are skipped."""
    need_native("each ISA path is forced in turn")
    if not native.isa_available(request.param):
        pytest.skip(f"this CPU lacks {request.param} (best: {native.best_isa()})")
    force_isa(request.param)
    return request.param


@pytest.fixture
def no_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make sure the native kernel, not the reference, is what a test measures."""
    def refuse(*args, **kwargs):
        raise AssertionError("paged attention fell back to the reference")

    module = importlib.import_module("kvlm.kernels.paged_attention")  # the attribute of kvlm.kernels is the function
    monkeypatch.setattr(module, "paged_attention_ref", refuse)
    monkeypatch.setattr(module, "paged_decode_attention_ref", refuse)
