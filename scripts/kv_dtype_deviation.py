"""What a float16 / bfloat16 KV cache costs in accuracy on the default model, against the float32 cache.

    PYTHONPATH=. python scripts/kv_dtype_deviation.py [N_TOKENS]

For a few short prompts: greedy decoding with each KV dtype (default path: Q4_1 weights, int8
activations) against the float32 cache: the largest logit difference up to the first step where the
greedy tokens part (after it the contexts differ), that step, and the float32 logits' top-2 margin
there; for scale, the same numbers for float32 recomputed (no KV cache) decoding.
"""

from __future__ import annotations

import argparse

import torch

from kvlm import EngineConfig, SamplingParams
from kvlm.engine.engine import Engine

PROMPTS = ["The capital of France is", "What is a KV cache?", "Write a haiku about caches",
           "def fibonacci(n):", "Once upon a time"]


def logits_of(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits of each step (n, vocab)."""
    req = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    rows = []
    while engine.has_unfinished:
        engine.step(keep_logits=True)
        res = engine.last_result
        rows += [res.logits[j] for j, r in enumerate(res.requests) if r is req]
    return list(req.output_token_ids), torch.stack(rows)


def main(n: int) -> None:
    engines = {kv: Engine("smollm2-135m", EngineConfig(kv_cache_dtype=kv, enable_prefix_caching=False), quiet=True)
               for kv in ("float32", "float16", "bfloat16")}
    nocache = Engine("smollm2-135m", EngineConfig(enable_kv_cache=False), quiet=True)
    tok = engines["float32"].tokenizer
    print(f"{'prompt':28s} {'KV':9s} {'max |dlogit|':>12s} {'first parting':>14s} {'margin there':>12s}")
    for text in PROMPTS:
        prompt = tok.encode(text)
        ref_tokens, ref = logits_of(engines["float32"], prompt, n)
        rows = {kv: logits_of(engines[kv], prompt, n) for kv in ("float16", "bfloat16")}
        rows["recomputed"] = logits_of(nocache, prompt, n)
        for kv, (tokens, logits) in rows.items():
            steps = min(len(tokens), len(ref_tokens))
            part = next((i for i in range(steps) if tokens[i] != ref_tokens[i]), None)
            upto = part + 1 if part is not None else steps  # after a parting the contexts differ
            d = (logits[:upto] - ref[:upto]).abs().max().item()
            margin = "-"
            if part is not None:
                top2 = ref[part].topk(2).values
                margin = f"{(top2[0] - top2[1]).item():.3f}"
            print(f"{text[:28]:28s} {kv:9s} {d:12.3f} {str(part) if part is not None else 'none':>14s} {margin:>12s}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("n_tokens", nargs="?", type=int, default=32, help="greedy tokens per prompt (default 32)")
    main(p.parse_args().n_tokens)
