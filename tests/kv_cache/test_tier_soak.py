"""The KV tier soak (scripts/tier_soak.py), short: 3 processes share one tier directory for ~15 s with a
bound of 24 blocks, so LRU eviction, concurrent writes of one block, and loads of files another process
is removing all happen; every loaded block equals its recomputation. The full run (4 processes, 600 s) is
the script's default; docs/kv_tier.md has its numbers. A tampering run shows the check catches bad K/V."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tier_soak.py"


def soak(tmp_path: Path, *extra: str) -> tuple[int, dict, str]:
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}
    r = subprocess.run([sys.executable, str(SCRIPT), "--procs", "3", "--dir", str(tmp_path), *extra],
                       capture_output=True, text=True, timeout=300, env=env)
    total = next((json.loads(line[6:]) for line in r.stdout.splitlines() if line.startswith("total ")), {})
    return r.returncode, total, r.stdout + r.stderr


def test_short_soak_has_no_corrupt_load(tmp_path: Path) -> None:
    rc, total, out = soak(tmp_path, "--duration", "15")
    assert rc == 0, out
    assert total["corrupt"] == 0 and total["rejected"] == 0, out
    assert total["loads"] > 0 and total["stores"] > 0 and total["evictions"] > 0, out
    assert not list(tmp_path.glob(".tmp-*")), "no writer left a temp file behind"


def test_soak_catches_a_block_with_other_kv(tmp_path: Path) -> None:
    rc, total, out = soak(tmp_path, "--duration", "4", "--tamper")
    assert rc == 1 and total["corrupt"] > 0 and "FAIL: corrupt loads" in out, out
