"""`kvlm bench serve` against a real server: bounded, loopback only, ends with one JSON line (vLLM names)."""

from __future__ import annotations

import json
import subprocess
import sys

from server_utils import ROOT


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
