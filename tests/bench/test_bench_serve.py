"""`kvlm bench serve` against a real server: bounded, loopback only, ends with one JSON line (vLLM names)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from server_utils import ROOT, ServerProcess


def test_bench_serve_reports_vllm_metrics_and_plot(tiny_server, tmp_path):
    png = tmp_path / "rates.png"
    out = subprocess.run([sys.executable, "-m", "kvlm", "bench", "serve", "--url", tiny_server.url, "--num-prompts",
                          "6", "--input-len", "5", "20", "--output-len", "4", "8", "--request-rate", "50", "inf",
                          "--max-concurrency", "4", "--plot", str(png)], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["request_rate"] for r in doc["runs"]] == [50, float("inf")]
    for r in doc["runs"]:
        assert r["completed"] == 6 and r["failed"] == 0
        assert r["total_output_tokens"] == doc["runs"][0]["total_output_tokens"]
        for k in ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                  "p90_itl_ms", "median_e2el_ms"):
            assert k in r
    assert png.stat().st_size > 1000


def test_bench_serve_refuses_a_remote_url():
    out = subprocess.run([sys.executable, "-m", "kvlm", "bench", "serve", "--url", "http://example.com:8000"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "loopback" not in out.stdout
    assert out.stderr.strip().splitlines()[-1].startswith("kvlm: error: --url:")


@pytest.mark.slow
def test_bench_serve_conversations_resend_histories_and_hit_the_cache(smollm2_gguf):
    """The multi-turn workload: C x T turns, each resending its history; from turn 2 on the history's blocks
    are cached (one process here: its counter is the "-" replica). The default model: the tiny one's
    byte-level tokenizer and 256-token context hold no second turn."""
    with ServerProcess(smollm2_gguf, "--max-model-len", "1024") as server:
        out = subprocess.run([sys.executable, "-m", "kvlm", "bench", "serve", "--url", server.url, "--conversations",
                              "3", "--turns", "3", "--output-len", "4", "4", "--system-words", "8",
                              "--max-concurrency", "2"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["completed"] == 9, doc.get("errors")
    assert doc["failed"] == 0 and doc["total_output_tokens"] == 36
    assert 0 < doc["prefix_hit_tokens"] < doc["total_input_tokens"]
    assert doc["prefix_hit_tokens_by_replica"] == {"-": doc["prefix_hit_tokens"]}
    for k in ("median_ttft_ms", "p99_ttft_ms", "output_throughput", "request_throughput"):
        assert doc[k] > 0
