#!/usr/bin/env python3
"""Greedy decode with the sampler's native argmax against torch.argmax, side by side: two engines step in
turn, one with `kvlm.kernels.argmax.argmax_rows` in the sampler, one with `x.argmax(-1)`; the throughput
ratio is torch's decode time / native's, per round. The measurement behind docs/structured.md:

    python scripts/experiments/argmax_decode_ab.py [--batch 16] [--rounds 3] [--tokens 96]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kvlm.engine.sampler as sampler
from kvlm import LLM, SamplingParams
from kvlm.bench.structured import PROMPT
from kvlm.kernels.argmax import argmax_rows

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--tokens", type=int, default=96)
a = ap.parse_args()
torch.set_num_threads(2)
llms = [LLM("smollm2-135m", num_threads=2, max_num_seqs=a.batch) for _ in range(2)]
ids = llms[0].llm_engine.tokenizer.encode(PROMPT)
argmaxes = (argmax_rows, lambda x: x.argmax(-1))


def run(tokens: int) -> list[list[float]]:
    runs = []
    for llm in llms:
        eng = llm.llm_engine
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        runs.append((eng, [eng.add_request(list(ids), params) for _ in range(a.batch)], []))
    while any(not r.is_finished for _, reqs, _ in runs for r in reqs):
        for k, (eng, reqs, steps) in enumerate(runs):
            if all(r.is_finished for r in reqs):
                continue
            sampler.argmax_rows = argmaxes[k]
            decoding = all(r.num_output_tokens > 0 for r in reqs)
            t0 = time.perf_counter()
            eng.step()
            if decoding:
                steps.append(time.perf_counter() - t0)
    sampler.argmax_rows = argmax_rows
    return [steps for _, _, steps in runs]


run(8)
ratios = []
for _ in range(a.rounds):
    native, torch_steps = run(a.tokens)
    ratios.append(sum(torch_steps) / sum(native))
print(f"batch {a.batch}: native argmax decodes {statistics.median(ratios):.3f}x torch.argmax's speed (rounds: "
      + " ".join(f"{x:.3f}" for x in ratios) + ")")
