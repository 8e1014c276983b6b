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
