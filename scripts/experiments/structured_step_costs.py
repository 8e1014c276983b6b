#!/usr/bin/env python3
"""Where a JSON-schema constraint's cost goes inside the engine's decode step: the median time of the whole
step, the forward pass (`fused`), the logits, the sampler and its grammar mask, without and with the
constraint, alternately. The measurement behind docs/structured.md ("What it costs"):

    python scripts/experiments/structured_step_costs.py --batch 16 [--tokens 64] [--rounds 2]

Each phase is timed by wrapping the engine's own methods (the wrapper adds the same ~1 us to both runs).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import kvlm.engine.model_runner as model_runner
import kvlm.engine.sampler as sampler
import kvlm.structured.mask as mask
from kvlm import LLM, SamplingParams, StructuredOutputsParams
from kvlm.bench.structured import PROMPT, RECORDS
from kvlm.structured.matcher import RequestGrammar

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--tokens", type=int, default=64)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--threads", type=int, default=2)
a = ap.parse_args()
llm = LLM("smollm2-135m", num_threads=a.threads, max_num_seqs=a.batch)
eng = llm.llm_engine
ids = eng.tokenizer.encode(PROMPT)
so = StructuredOutputsParams(json=RECORDS)
eng.grammars.compile(so)
times: dict[str, list[float]] = {}


def timed(owner: Any, name: str, key: str) -> None:
    f = getattr(owner, name)

    def wrapper(*args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        out = f(*args, **kw)
        times.setdefault(key, []).append(time.perf_counter() - t)
        return out

    setattr(owner, name, wrapper)


timed(eng, "step", "step")
if eng.runner.fused is not None:
    timed(type(eng.runner.fused), "__call__", "forward (fused)")  # the class: the runner also asks it `fits`
timed(eng.runner.model, "compute_logits", "logits")
timed(model_runner, "sample", "sample")
timed(sampler, "apply_grammar_masks", "mask")
timed(mask, "grammar_bitmask", "mask fill")
timed(mask, "apply_token_bitmask", "mask apply")
timed(eng, "_update", "update")
timed(eng.runner, "execute", "execute")
timed(eng.scheduler, "schedule", "schedule")
timed(eng.runner, "prepare", "prepare")
timed(RequestGrammar, "accept", "accept (one token)")
for r in range(a.rounds):
    for constrained in (False, True):
        times.clear()
        reqs = [eng.add_request(list(ids), SamplingParams(temperature=0, max_tokens=a.tokens, seed=i,
                                                          ignore_eos=not constrained,
                                                          structured_outputs=so if constrained else None))
                for i in range(a.batch)]
        while any(not q.is_finished for q in reqs):
            eng.step()
        medians = {k: f"{statistics.median(v[2:]) * 1e3:.3f}" for k, v in times.items()}
        print(f"round {r + 1} {'constrained' if constrained else 'free':11s} batch {a.batch}, median ms: {medians}")
