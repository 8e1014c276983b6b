"""Optional test dependencies: skipped on a developer's machine without them, required in CI.

The `test` extra installs transformers (the reference for the HF-exactness tests), so in CI
(`CI=true`, set by .ci/run and by hosted CI services) a missing one is a failure, not a silent skip.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def need(module: str) -> ModuleType:
    """Import `module`; skip the test when it is missing, unless CI=true (then the ImportError fails it)."""
    if os.environ.get("CI", "").lower() in ("true", "1"):
        return importlib.import_module(module)
    return pytest.importorskip(module)
