"""Decode A/B in one window of time: two long-lived processes take turns decoding the same greedy request.

    PYTHONPATH=. python scripts/decode_ab.py FILE [--tokens 48] [--rounds 10] [--threads 2]
        [--a-env K=V ...] [--b-env K=V ...] [--a-tree DIR] [--b-tree DIR]

A and B differ by environment variables (`--b-env KVLM_KERNEL_ISA=avx2`) or by source tree (`--b-tree
OLD_TREE`: that tree on PYTHONPATH, its own native build). Each process loads FILE once, then per round
decodes `--tokens` tokens after a 32-token prompt (prefix caching off) when told to; the two run one after
the other, A first in even rounds and B first in odd ones.

Why not two `kvlm bench compare` runs: a shared host's memory bandwidth can switch between modes within minutes
(a 2-core Zen 5 VM read ~50 or ~80 GB/s in turn, docs/measured.md), so runs minutes apart compare two machines.
Here each pair of bursts is seconds apart. The order matters too: a process's OpenMP threads keep spinning for a
while after its burst, and on 2 cores (Zen 5, AVX-512 VNNI path) the burst right after it ran at 0.75x (both
processes the same); so each burst waits `--pause` (1 s) first, the order alternates, and the script separates
the two effects: with B/A = r * f when B runs second and r / f when it runs first, it prints r (B's speed over
A's) and f (the second burst's penalty), each from the medians of their rounds.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import sys, time
from kvlm.llm import LLM
from kvlm.sampling_params import SamplingParams
path, n, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = LLM(path, num_threads=threads, max_num_seqs=1, max_model_len=512, enable_prefix_caching=False)
params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
ids = list(range(100, 132))
llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
print("ready", flush=True)
for _ in sys.stdin:
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    print(n / (time.perf_counter() - t), flush=True)
"""


def _env(pairs: list[str], tree: str | None) -> dict[str, str]:
    env = dict(os.environ)
    for kv in pairs:
        key, sep, value = kv.partition("=")
        if not sep:
            raise SystemExit(f"decode_ab: --a-env / --b-env take KEY=VALUE, not {kv!r}")
        env[key] = value
    if tree:
        env["PYTHONPATH"] = os.path.abspath(tree)
    return env


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--a-env", nargs="*", default=[])
    p.add_argument("--b-env", nargs="*", default=[])
    p.add_argument("--a-tree")
    p.add_argument("--b-tree")
    p.add_argument("--pause", type=float, default=1.0, help="seconds idle before each burst")
    a = p.parse_args()
    args_pause = a.pause
    envs = {"A": _env(a.a_env, a.a_tree), "B": _env(a.b_env, a.b_tree)}
    procs = {k: subprocess.Popen([sys.executable, "-c", CHILD, a.file, str(a.tokens), str(a.threads)], env=e,
                                 cwd=e.get("PYTHONPATH"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for k, e in envs.items()}
    for k, proc in procs.items():
        if proc.stdout is None or proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"decode_ab: process {k} did not start")
    second, first = [], []  # B/A with B second, with B first
    for r in range(a.rounds):
        order = ("A", "B") if r % 2 == 0 else ("B", "A")
        rate = {}
        for k in order:
            time.sleep(args_pause)  # the other process's OpenMP threads spin a while after its burst
            procs[k].stdin.write("go\n")
            procs[k].stdin.flush()
            rate[k] = float(procs[k].stdout.readline())
        (second if order[1] == "B" else first).append(rate["B"] / rate["A"])
        print(f"round {r}: {order[0]} first; A {rate['A']:.2f}, B {rate['B']:.2f} tok/s, "
              f"B/A {rate['B'] / rate['A']:.3f}", flush=True)
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()
    if first and second:
        s, f = statistics.median(second), statistics.median(first)
        print(f"B over A: {math.sqrt(s * f):.3f}x; the second burst of a pair runs at {math.sqrt(s / f):.3f}x "
              f"(medians: B second {s:.3f}, B first {f:.3f}; {a.tokens} tokens a burst, {a.rounds} rounds)")


if __name__ == "__main__":
    main()
