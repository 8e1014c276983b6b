"""Where kvlm keeps files on disk: everything lives under `$KVLM_HOME` (default `~/.cache/kvlm`).

    models/<alias>/      named models pulled from PyPI (loader/registry.py)
    ext/<key>/           the native kernels built for this torch and CPU (kernels/native.py)
    fingerprints/        sha256 of model files, for KV snapshots (loader/fingerprint.py)

The environment variable is read on every call, so a test or a caller may change it at run time.
"""

from __future__ import annotations

import os
from pathlib import Path


def kvlm_home() -> Path:
    return Path(os.environ.get("KVLM_HOME") or Path.home() / ".cache" / "kvlm")
