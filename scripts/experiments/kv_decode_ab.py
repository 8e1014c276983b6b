#!/usr/bin/env python3
"""Decode tokens/s by KV cache format, side by side in one process (docs/kv_quant.md records a run).

One engine per --kv-cache-dtype (default flags otherwise: --dtype auto, paged, the fused decode step);
rounds alternate the formats, so all see the same machine load, and each figure is the best of the
rounds. Per context C: `--gen` greedy tokens timed after a prompt of C - gen random tokens (the last
token attends to C); "short": 128 tokens after a 32-token prompt (batch 1, short context). The last
line is one JSON document.

    python scripts/experiments/kv_decode_ab.py [--contexts 512 2048 8192] [--rounds 3] [--gen 16]
"""

from __future__ import annotations

import argparse
import json
import random

from kvlm import LLM, SamplingParams

p = argparse.ArgumentParser()
p.add_argument("--model", default="smollm2-135m")
p.add_argument("--kv", nargs="+", default=["float32", "float16", "int8", "int4"])
p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--gen", type=int, default=16)
p.add_argument("--threads", type=int, default=2)
a = p.parse_args()

max_len = max(a.contexts)
llms = {kv: LLM(a.model, num_threads=a.threads, kv_cache_dtype=kv, max_num_seqs=1, max_model_len=max_len,
                enable_prefix_caching=False, adaptive_threads=False) for kv in a.kv}
rng = random.Random(0)
prompts = {c: [rng.randrange(100, 40000) for _ in range(c - a.gen)] for c in a.contexts}
prompts["short"] = [rng.randrange(100, 40000) for _ in range(32)]
gens = {**{c: a.gen for c in a.contexts}, "short": 128}
best: dict[str, dict[str, float]] = {kv: {} for kv in a.kv}
for r in range(a.rounds):
    for key, ids in prompts.items():
        params = SamplingParams(temperature=0, max_tokens=gens[key], ignore_eos=True)
        for kv, llm in llms.items():
            out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
            tps = out.metrics.as_dict()["decode_tokens_per_s"]
            best[kv][str(key)] = max(best[kv].get(str(key), 0.0), tps)
            print(f"round {r + 1} {key} {kv}: {tps:.1f} tok/s", flush=True)
print(json.dumps({"model": a.model, "threads": a.threads, "rounds": a.rounds, "gen": a.gen,
                  "bytes_per_token": {kv: llm.llm_engine.kv_bytes_per_token for kv, llm in llms.items()},
                  "decode_tokens_per_s": best}))
