"""Test prerequisites: skipped on a developer's machine without them, required in CI.

The `test` extra installs transformers (the reference for the HF-exactness tests), and .ci/run installs
g++ for the native kernels, so in CI (`CI=true`, set by .ci/run and by hosted CI services) a missing
module or a missing native build is a failure, not a silent skip: without the build every bit-exact
test would skip and the suite would pass having checked none of them.
"""

from __future__ import annotations

import importlib
import os
import platform
from types import ModuleType

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")


def need(module: str) -> ModuleType:
    """Import `module`; skip the test when it is missing, unless CI=true (then the ImportError fails it)."""
    if in_ci():
        return importlib.import_module(module)
    return pytest.importorskip(module)


def need_native(why: str = "exactness across step shapes needs them") -> None:
    """Skip the test unless the native kernels run here; under CI=true a missing build fails it instead.

    Still a skip everywhere: a CPU that is neither x86-64 nor aarch64 (the kernels target those)
    and `KVLM_KERNEL_ISA=reference` (whoever set it asked for the reference path)."""
    from kvlm.kernels import native

    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        pytest.skip(f"the native kernels target x86-64 and aarch64, this is {platform.machine()}: {why}")
    if not native.available():
        msg = (f"the native kernels are not built here: {why} (the 'kvlm:' warning in the captured log says what is "
               "missing; Debian: apt install g++)")
        if in_ci():
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    if native.active_isa() == "reference":
        pytest.skip(f"{native.ENV_ISA}=reference: {why}")
