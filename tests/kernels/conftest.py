"""Fixtures the kernel tests share."""

from __future__ import annotations

import pytest

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


@pytest.fixture(params=list(native.ISAS))
def isa(request: pytest.FixtureRequest, force_isa) -> str:
    """Each ISA path in turn, forced; those this CPU lacks (or all, without a native build) are skipped."""
    isas = list(native.ISAS)
    if not native.available():
        pytest.skip("native kernels not built here (test_kernels.py::test_extension_builds says why)")
    if isas.index(request.param) > isas.index(native.best_isa()):
        pytest.skip(f"this CPU lacks {request.param} (best: {native.best_isa()})")
    force_isa(request.param)
    return request.param
