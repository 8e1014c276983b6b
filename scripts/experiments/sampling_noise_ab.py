#!/usr/bin/env python3
"""The sampler's noise for the exponential race, side by side: E drawn by `exponential_` (kvlm before
2026-12-02) against E = -log U from `uniform_` (now), per row from the row's own generator, over (B, V)
float32 rows of SmolLM2's vocabulary; alternating, median of each. The measurement behind the sampler's
comment and docs/structured.md:

    python scripts/experiments/sampling_noise_ab.py [--batch 16] [--vocab 49152] [--repeats 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--vocab", type=int, default=49152)
ap.add_argument("--repeats", type=int, default=50)
ap.add_argument("--threads", type=int, default=2)
a = ap.parse_args()
torch.set_num_threads(a.threads)
gens = [torch.Generator().manual_seed(i) for i in range(a.batch)]
noise = torch.empty(a.batch, a.vocab)


def by_exponential() -> None:
    for j, g in enumerate(gens):
        noise[j].exponential_(generator=g)


def by_uniform() -> None:
    for j, g in enumerate(gens):
        noise[j].uniform_(generator=g)
    noise.log_().neg_()


times: dict[str, list[float]] = {"exponential_": [], "uniform_ + log": []}
for _ in range(a.repeats):
    for name, f in (("exponential_", by_exponential), ("uniform_ + log", by_uniform)):
        t0 = time.perf_counter()
        f()
        times[name].append(time.perf_counter() - t0)
med = {k: statistics.median(v) for k, v in times.items()}
for k, v in med.items():
    print(f"{k:15s} {v * 1e3:8.3f} ms for {a.batch} rows of {a.vocab} ({v / a.batch * 1e6:.0f} us a row)")
print(f"ratio {med['exponential_'] / med['uniform_ + log']:.2f}x")
