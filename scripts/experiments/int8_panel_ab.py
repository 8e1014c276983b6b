#!/usr/bin/env python3
"""An experiment, kept because docs/int8_activations.md records its result: old vs new int8 matmul, side by
side: two source trees (e.g. main's, in a second worktree, and this one), each measured in its own
processes, alternated `--reps` times; prints medians and new/old ratios, then one JSON line.

    git worktree add OLD_TREE <commit>          # any folder outside this checkout
    PYTHONPATH=. python scripts/experiments/int8_panel_ab.py OLD_TREE . --threads 2 --reps 3

Kernel rows: `kvlm.bench.kernels.bench_one` (cold weights) for Q4_1 1536x576, 576x1536 and Q8_0
49152x576 at each M of --rows. Engine rows (unless --no-engine): prefill of 512 tokens, decode at batch 1
and batch 32 (output tok/s, best of a few) on the default model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

KERNEL = """
import json, sys, torch
from gguf import GGMLQuantizationType as T
try:
    from kvlm.bench.kernels import bench_one
except ImportError:  # a tree from before the package layout (kvlm/kernels/bench.py)
    from kvlm.kernels.bench import bench_one
torch.set_num_threads({threads})
out = {{}}
with torch.inference_mode():
    for q, n, k in ((T.Q4_1, 1536, 576), (T.Q4_1, 576, 1536), (T.Q8_0, 49152, 576)):
        for m in {rows}:
            out[f"{{q.name}} {{n}}x{{k}} M={{m}} ms"] = bench_one(q, n, k, m, {min_s})["ms"]
print(json.dumps(out))
"""

ENGINE = """
import json, random, time, torch
from kvlm import LLM, SamplingParams
torch.set_num_threads({threads})
ids = [random.Random(0).randrange(100, 20000) for _ in range(512)]
llm = LLM("smollm2-135m", num_threads={threads}, max_num_seqs=32, enable_prefix_caching=False, quiet=True)
def prefill():
    t = time.perf_counter()
    llm.generate([{{"prompt_token_ids": ids}}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return 512 / (time.perf_counter() - t)
def decode(b):
    eng = llm.llm_engine
    p = SamplingParams(temperature=0, max_tokens=65, ignore_eos=True)
    reqs = [eng.add_request(list(range(1000 + i, 1032 + i)), p) for i in range(b)]
    eng.step()  # the prefills
    t, n = time.perf_counter(), 0
    while not all(r.is_finished for r in reqs):
        eng.step()
        n += 1
    return b * n / (time.perf_counter() - t)
print(json.dumps({{"prefill 512 tok/s": max(prefill() for _ in range(3)),
                  "decode b1 tok/s": max(decode(1) for _ in range(3)),
                  "decode b32 tok/s": max(decode(32) for _ in range(2))}}))
"""


def measure(tree: str, code: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,32,512")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--min-seconds", type=float, default=0.3)
    ap.add_argument("--no-engine", action="store_true")
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    codes = [KERNEL.format(threads=a.threads, rows=rows, min_s=a.min_seconds)]
    if not a.no_engine:
        codes.append(ENGINE.format(threads=a.threads))
    runs: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    for _ in range(a.reps):
        for code in codes:
            for name, tree in (("old", a.old), ("new", a.new)):
                for key, v in measure(tree, code).items():
                    runs[name].setdefault(key, []).append(v)
    summary = {}
    print(f"{'measure':32} {'old (median)':>13} {'new (median)':>13} {'speedup':>8}")
    for key in runs["old"]:
        old, new = statistics.median(runs["old"][key]), statistics.median(runs["new"][key])
        speedup = old / new if key.endswith(" ms") else new / old
        summary[key] = {"old": runs["old"][key], "new": runs["new"][key], "speedup": round(speedup, 3)}
        print(f"{key:32} {old:>13.4g} {new:>13.4g} {speedup:>7.2f}x")
    print(json.dumps({"bench": "int8_panel_ab", "threads": a.threads, "reps": a.reps, "results": summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
