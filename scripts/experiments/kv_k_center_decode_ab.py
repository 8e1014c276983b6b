#!/usr/bin/env python3
"""Decode tokens/s of a quantized KV cache with K centering on and off, side by side in one process
(docs/kv_quant.md records a run).

One engine (`--kv`, default flags otherwise: --dtype auto, paged, the fused decode step); rounds alternate
its cache's `k_center` between the calibrated mean key and None (None: keys stored as computed, what the
tree before centering did), so both see the same machine load; each figure is the best of the rounds.
Per context C: `--gen` greedy tokens timed after a prompt of C - gen random tokens; "short": 128 tokens
after a 32-token prompt. On a loaded machine the generate figures scatter; `step_ms_min` is steadier: the
fastest of `--steps` single decode steps (`Engine.step`, the fused native step) of one request per mode
and context, after the same prompt. The last line is one JSON document.

    python scripts/experiments/kv_k_center_decode_ab.py [--kv int4] [--contexts 2048] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from kvlm import LLM, SamplingParams

p = argparse.ArgumentParser()
p.add_argument("--model", default="smollm2-135m")
p.add_argument("--kv", default="int4", choices=["int8", "int4"])
p.add_argument("--contexts", type=int, nargs="+", default=[2048])
p.add_argument("--rounds", type=int, default=5)
p.add_argument("--gen", type=int, default=16)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--steps", type=int, default=200)
a = p.parse_args()

llm = LLM(a.model, num_threads=a.threads, kv_cache_dtype=a.kv, max_num_seqs=2, max_model_len=max(a.contexts) + 512,
          enable_prefix_caching=False, adaptive_threads=False)
cache = llm.llm_engine.kv_cache
modes = {"centered": cache.k_center, "uncentered": None}
assert modes["centered"] is not None
rng = random.Random(0)
prompts = {c: [rng.randrange(100, 40000) for _ in range(c - a.gen)] for c in a.contexts}
prompts["short"] = [rng.randrange(100, 40000) for _ in range(32)]
gens = {**{c: a.gen for c in a.contexts}, "short": 128}
best: dict[str, dict[str, float]] = {m: {} for m in modes}
for r in range(a.rounds):
    for key, ids in prompts.items():
        params = SamplingParams(temperature=0, max_tokens=gens[key], ignore_eos=True)
        for mode, mu in modes.items():
            cache.k_center = mu
            out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
            tps = out.metrics.as_dict()["decode_tokens_per_s"]
            best[mode][str(key)] = max(best[mode].get(str(key), 0.0), tps)
            print(f"round {r + 1} {key} {mode}: {tps:.1f} tok/s", flush=True)
ratio = {k: best["centered"][k] / best["uncentered"][k] for k in best["centered"]}

# single steps at batch 1: one request per mode, in turn
eng = llm.llm_engine
step_min: dict[str, dict[str, float]] = {m: {} for m in modes}
for c in a.contexts:
    for mode, mu in modes.items():
        cache.k_center = mu
        req = eng.add_request(prompts[c], SamplingParams(temperature=0, max_tokens=a.steps + 1, ignore_eos=True))
        while req.num_computed_tokens < len(prompts[c]):
            eng.step()  # prefill
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
        eng.abort(req.request_id)
        step_min[mode][str(c)] = min(times) * 1e3
        print(f"{c} {mode}: fastest step {min(times) * 1e3:.3f} ms, median {statistics.median(times) * 1e3:.3f} ms",
              flush=True)
print(json.dumps({"model": a.model, "kv": a.kv, "threads": a.threads, "rounds": a.rounds, "gen": a.gen,
                  "decode_tokens_per_s": best, "centered_over_uncentered": ratio, "step_ms_min": step_min}))
