"""`kvlm bench tier` on the tiny model: both engines give the same tokens, the tier engine prefills less,
the restarted engine loads every document from the tier, one JSON line ends the output, --plot draws."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlm.cli.main import main


def test_bench_tier(tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "tier.png"
    assert main(["-q", "bench", "tier", str(tiny_gguf), "--docs", "5", "--doc-tokens", "64", "--pool-docs", "2",
                 "--questions", "12", "--plot", str(png)]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["bench"] == "tier" and {"date", "cpu", "threads"} <= set(doc)
    assert doc["same_tokens"]
    assert doc["tier"]["prefilled_tokens"] < doc["pool"]["prefilled_tokens"]
    assert doc["tier"]["tier"]["n"] > 0 and doc["pool"]["tier"]["n"] == 0
    assert doc["restart"]["miss"]["n"] == 0 and doc["restart"]["tier_tokens"] > 0
    assert doc["tier_stats"]["tier_corrupt_files"] == 0 and doc["tier_load_tokens_per_s"] > 0
    assert png.is_file()


def test_no_tier_hits_prints_not_measured(tiny_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A pool that holds every document and no write-through: no tier hit anywhere, so the load rate and the
    hit-vs-miss ratio are "not measured" (null in the JSON), never 0 or 0.0x."""
    assert main(["-q", "bench", "tier", str(tiny_gguf), "--docs", "2", "--doc-tokens", "32", "--pool-docs", "4",
                 "--questions", "3", "--no-write-through"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    doc = json.loads(out[-1])
    assert doc["tier"]["tier_tokens"] == doc["restart"]["tier_tokens"] == 0
    assert doc["tier_load_tokens_per_s"] is None and doc["ttft_p50_speedup_tier_hit_vs_miss"] is None
    line = next(x for x in out if x.startswith("tier load"))
    assert "tier load not measured (no tier hits)" in line and "hit vs miss: not measured" in line
    assert "0.0x" not in line and " 0 tok/s" not in line
