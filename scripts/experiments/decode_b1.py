#!/usr/bin/env python3
"""Decode tokens/s at batch 1 on the default model, best of 4 generations in one process: a quieter
figure than `kvlm bench compare`'s for side-by-side runs of two trees (docs/exactness.md records one).

    PYTHONPATH=TREE python scripts/experiments/decode_b1.py LABEL     # 128 greedy tokens after 32
"""

from __future__ import annotations

import random
import sys

from kvlm import LLM, SamplingParams

llm = LLM("smollm2-135m", num_threads=2)
rng = random.Random(0)
ids = [rng.randrange(100, 40000) for _ in range(32)]
params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
best = 0.0
for _ in range(4):
    llm.llm_engine.reset_prefix_cache()
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    best = max(best, out.metrics.as_dict()["decode_tokens_per_s"])
print(sys.argv[1] if len(sys.argv) > 1 else "decode", round(best, 1))
