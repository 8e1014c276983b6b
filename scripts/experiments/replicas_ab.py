#!/usr/bin/env python3
"""Routers and replica counts of `kvlm serve --replicas` side by side, with start-up costs: the measurement
behind docs/replicas.md. For each setting it starts `kvlm serve` (default model), times it to its first
healthy /health, sums the resident memory of its whole process tree (Ray's processes and the replicas
included), runs the multi-turn workload of `kvlm bench serve --conversations C --turns T`, then SIGTERMs it
and checks that no process of the tree is left.

    python scripts/experiments/replicas_ab.py                      # prefix vs pow2 on 2 replicas, and 1 replica
    python scripts/experiments/replicas_ab.py --only single --repeat 5   # one-process start-up, no workload

Prints one JSON document (each run's bench document, its start-up seconds and tree RSS, and the ratios).
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

SERVE = ["--threads", "1", "--max-model-len", "2048", "--kv-cache-memory", "200MiB", "--log-level", "warning"]
SETTINGS = {
    "prefix": ["--replicas", "2", "--router", "prefix"],
    "pow2": ["--replicas", "2", "--router", "pow2"],
    "one_replica": ["--replicas", "1"],
    "single": [],  # one process, no Ray: the start-up baseline
}


def tree(pid: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                kids.setdefault(int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    out, todo = {pid}, [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def rss_mib(pids: set[int]) -> float:
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_setting(name: str, a: argparse.Namespace) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "kvlm", "serve", "--port", str(port), *SERVE, *SETTINGS[name]],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.perf_counter() - t0 > 300:
            raise SystemExit(f"{name}: kvlm serve did not start")
        time.sleep(0.05)
    doc: dict = {"startup_s": time.perf_counter() - t0}
    time.sleep(1.0)  # the replicas' loop threads and Ray's agents settle
    pids = tree(proc.pid)
    doc["processes"], doc["rss_mib_idle"] = len(pids), rss_mib(pids)
    if name != "single" or a.workload_on_single:
        from kvlm.bench.conversations import run_conversations  # not in trees before it (the baseline runs)

        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        ns = SimpleNamespace(conversations=a.conversations, turns=a.turns, output_len=[a.output_len],
                             max_concurrency=a.max_concurrency, system_words=a.system_words, seed=a.seed,
                             max_duration=600.0)
        doc["bench"] = run_conversations(url, model, ns)
        doc["rss_mib_after"] = rss_mib(tree(proc.pid))
    proc.send_signal(signal.SIGTERM)
    doc["exit_code"] = proc.wait(120)
    time.sleep(1.0)
    doc["left_running"] = sorted(p for p in pids if p != proc.pid and Path(f"/proc/{p}").exists())
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=list(SETTINGS), default=["prefix", "pow2", "one_replica"])
    ap.add_argument("--repeat", type=int, default=1, help="runs per setting (start-up medians)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-concurrency", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workload-on-single", action="store_true")
    a = ap.parse_args()
    runs = {name: [run_setting(name, a) for _ in range(a.repeat)] for name in a.only}
    from kvlm.bench.common import cpu_name

    out: dict = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "serve_args": SERVE,
                 "workload": vars(a), "runs": runs,
                 "startup_s_median": {k: statistics.median(r["startup_s"] for r in v) for k, v in runs.items()},
                 "rss_mib_idle_median": {k: statistics.median(r["rss_mib_idle"] for r in v) for k, v in runs.items()}}
    b = {k: v[0]["bench"] for k, v in runs.items() if "bench" in v[0]}
    if "prefix" in b and "pow2" in b:
        out["prefix_vs_pow2"] = {"prefix_hit_tokens": b["prefix"]["prefix_hit_tokens"] / b["pow2"]["prefix_hit_tokens"],
                                 "median_ttft": b["prefix"]["median_ttft_ms"] / b["pow2"]["median_ttft_ms"],
                                 "output_throughput": b["prefix"]["output_throughput"] / b["pow2"]["output_throughput"]}
    if "prefix" in b and "one_replica" in b:
        out["two_vs_one_replica"] = {
            "output_throughput": b["prefix"]["output_throughput"] / b["one_replica"]["output_throughput"],
            "median_ttft": b["prefix"]["median_ttft_ms"] / b["one_replica"]["median_ttft_ms"]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
