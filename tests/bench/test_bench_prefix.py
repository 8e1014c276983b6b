"""`kvlm bench prefix` on the tiny model: every part runs, checks its tokens, ends with one JSON line;
`--explain` names the divergence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlm.cli.main import main


def test_bench_prefix_all_parts(tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "prefix.png"
    assert main(["-q", "bench", "prefix", str(tiny_gguf), "--num-requests", "6", "--system-len", "64",
                 "--max-tokens", "3", "--turns", "3", "--turn-tokens", "6", "--snapshot-len", "96",
                 "--plot", str(png)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    doc = json.loads(lines[-1])
    assert doc["bench"] == "prefix" and {"date", "cpu", "threads"} <= set(doc)
    shared, chat, snap = doc["shared"], doc["chat"], doc["snapshot"]
    assert shared["same_tokens"] and shared["on"]["prefilled_tokens"] < shared["off"]["prefilled_tokens"]
    assert shared["on"]["cached_tokens"] > 0 and shared["off"]["cached_tokens"] == 0
    assert chat["same_replies"] and len(chat["on"]) == 3
    for off, on in list(zip(chat["off"], chat["on"]))[1:]:
        assert on["prefilled_tokens"] < off["prefilled_tokens"] == off["prompt_tokens"]
    assert snap["same_tokens"] and snap["cached_tokens_after_load"] == snap["snapshot_tokens"] == 96
    assert png.is_file() and png.stat().st_size < 200_000


def test_bench_prefix_explain(tiny_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = "Today is 2024-05-01. Tell me a story about caches."
    assert main(["-q", "bench", "prefix", str(tiny_gguf), "--explain", a, a.replace("01", "02"), "--chat",
                 "--block-size", "4"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    doc = json.loads(out[-1])
    assert "diverged at token" in doc["miss"] and "'2. Tell" in doc["miss"]
    assert doc["cached_tokens"] > 0 and doc["cached_tokens"] % 4 == 0
