#!/usr/bin/env python3
"""Decode tok/s on the default model under one thread setting, quiet or beside CPU-bound processes: the
measurement behind docs/threads.md. One setting per process (OpenMP reads its environment at start):

    [GOMP_SPINCOUNT=N | OMP_WAIT_POLICY=PASSIVE] python scripts/experiments/threads_ab.py \\
        --threads 2 [--fixed] [--hogs 1] [--tokens 128]

Prints the median of 3 generations of --tokens greedy tokens after a 32-token prompt.
"""

from __future__ import annotations

import argparse
import random

from kvlm import LLM, SamplingParams
from kvlm.bench.common import background_load

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--fixed", action="store_true", help="adaptive_threads=False")
ap.add_argument("--hogs", type=int, default=0, help="CPU-bound processes beside the run")
ap.add_argument("--tokens", type=int, default=128)
a = ap.parse_args()
llm = LLM("smollm2-135m", num_threads=a.threads, adaptive_threads=not a.fixed)
rng = random.Random(0)
ids = [rng.randrange(100, 40000) for _ in range(32)]
params = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
rates = []
with background_load(a.hogs):
    for _ in range(3):
        llm.llm_engine.reset_prefix_cache()
        out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        rates.append(out.metrics.as_dict()["decode_tokens_per_s"])
print(f"threads {a.threads} {'fixed' if a.fixed else 'adaptive'} hogs {a.hogs}: median {sorted(rates)[1]:.1f} tok/s")
