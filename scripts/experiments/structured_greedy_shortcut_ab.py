#!/usr/bin/env python3
"""A/B of a greedy shortcut past the grammar mask, tried and reverted (docs/structured.md, "Tried and not
adopted"). It ran on commit f47e505, where `sampler._greedy_picks` let a greedy constrained row skip its
mask when `RequestGrammar.greedy_pick` knew the masked argmax (the unmasked argmax allowed, or a forced
token the mask's only one). Three engines step in turn: free, constrained with the shortcut, constrained
with the mask always; the throughput ratios are free decode time / constrained decode time per round.
Check out f47e505 and run:

    python scripts/experiments/structured_greedy_shortcut_ab.py --batch 1 --rounds 5 --tokens 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kvlm.engine.sampler as sampler
from kvlm import LLM, SamplingParams, StructuredOutputsParams
from kvlm.bench.structured import PROMPT, RECORDS

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--tokens", type=int, default=128)
a = ap.parse_args()
torch.set_num_threads(2)
llms = [LLM("smollm2-135m", num_threads=2, max_num_seqs=a.batch) for _ in range(3)]
so = StructuredOutputsParams(json=RECORDS)
for llm in llms[1:]:
    llm.llm_engine.grammars.compile(so)
ids = llms[0].llm_engine.tokenizer.encode(PROMPT)
shortcut = sampler._greedy_picks  # type: ignore[attr-defined]


def run(tokens: int) -> list[list[float]]:
    """Each engine's decode step times, the three stepping in turn."""
    runs = []
    for k, llm in enumerate(llms):
        params = [SamplingParams(temperature=0, seed=i, max_tokens=tokens, ignore_eos=k == 0,
                                 structured_outputs=so if k else None) for i in range(a.batch)]
        eng = llm.llm_engine
        runs.append((k, eng, [eng.add_request(list(ids), p) for p in params], []))
    while any(not r.is_finished for _, _, reqs, _ in runs for r in reqs):
        for k, eng, reqs, steps in runs:
            if all(r.is_finished for r in reqs):
                continue
            sampler._greedy_picks = (lambda *args: None) if k == 2 else shortcut  # type: ignore[attr-defined]
            decoding = all(r.num_output_tokens > 0 for r in reqs)
            t0 = time.perf_counter()
            eng.step()
            if decoding:
                steps.append(time.perf_counter() - t0)
    return [steps for _, _, _, steps in runs]


run(8)
ratios: dict[str, list[float]] = {"shortcut": [], "mask always": []}
for _ in range(a.rounds):
    free, fast, masked = run(a.tokens)
    ratios["shortcut"].append(sum(free) / sum(fast))
    ratios["mask always"].append(sum(free) / sum(masked))
for name, rs in ratios.items():
    print(f"batch {a.batch} {name:11s} throughput ratio {statistics.median(rs):.3f} (rounds: "
          + " ".join(f"{x:.3f}" for x in rs) + ")")
