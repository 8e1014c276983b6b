#!/usr/bin/env python3
"""The sampler's native argmax against torch.argmax, side by side. First the kernel alone: one call on
warm (B, 49152) float32 rows, alternately, medians. Then greedy decode: two engines step in turn, one
with `kvlm.kernels.argmax.argmax_rows` in the sampler, one with `x.argmax(-1)`; the throughput ratio is
torch's decode time / native's, per round. The measurements behind docs/structured.md and docs/kernels.md:

    python scripts/experiments/argmax_decode_ab.py [--batch 16] [--rounds 3] [--tokens 96]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kvlm.engine.sampler as sampler
from kvlm import LLM, SamplingParams
from kvlm.bench.common import step_in_turn
from kvlm.bench.structured import PROMPT
from kvlm.kernels.argmax import argmax_rows

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--tokens", type=int, default=96)
a = ap.parse_args()
torch.set_num_threads(2)
argmaxes = (argmax_rows, lambda x: x.argmax(-1))

x = torch.randn(a.batch, 49152)
calls: tuple[list[float], list[float]] = ([], [])
for _ in range(300):
    for k, f in enumerate(argmaxes):
        t0 = time.perf_counter()
        f(x)
        calls[k].append(time.perf_counter() - t0)
print(f"kernel, ({a.batch}, 49152) warm: native {statistics.median(calls[0]) * 1e6:.1f} us, "
      f"torch {statistics.median(calls[1]) * 1e6:.1f} us")

llms = [LLM("smollm2-135m", num_threads=2, max_num_seqs=a.batch) for _ in range(2)]
ids = llms[0].llm_engine.tokenizer.encode(PROMPT)


def run(tokens: int) -> list[list[float]]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    runs = [(llm.llm_engine, [llm.llm_engine.add_request(list(ids), params) for _ in range(a.batch)])
            for llm in llms]

    def use(k: int) -> None:
        sampler.argmax_rows = argmaxes[k]

    try:
        return step_in_turn(runs, use)
    finally:
        sampler.argmax_rows = argmax_rows


run(8)
ratios = []
for _ in range(a.rounds):
    native, torch_steps = run(a.tokens)
    ratios.append(sum(torch_steps) / sum(native))
print(f"batch {a.batch}: native argmax decodes {statistics.median(ratios):.3f}x torch.argmax's speed (rounds: "
      + " ".join(f"{x:.3f}" for x in ratios) + ")")
