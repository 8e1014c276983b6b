#!/usr/bin/env python3
"""What filling a JSON-schema grammar's mask costs in the engine, by the kind of state the grammar is in, on
the engine's own step loop (caches the forward pass has just emptied). The measurement behind
docs/structured.md ("Where a constrained step's extra time goes"):

    python scripts/experiments/structured_fill_kinds.py [--batch 1] [--tokens 128]

Kinds, from llguidance's `compute_mask` (parser/src/tokenparser.rs): "free" (no bytes forced: the mask walks
the token trie), "forced" (forced bytes that tokenize to a whole token: the mask is that token alone, after
a tokenization of the forced bytes) and "forced, no token" (forced bytes that make no whole token: the
tokenization, then a trie walk under that prefix). Each fill is timed first; the state is classified after
it (those calls then find warm caches and do not change the fill's time). Medians per row, microseconds.
Then, outside the engine, the forced states' tokenization alone (`compute_ff_tokens`) along a fixed JSON
text: warm (the best of 20 calls in a row) and cold (the median of 5, each right after a 2048 x 2048
matmul has swept the caches).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvlm import LLM, SamplingParams, StructuredOutputsParams
from kvlm.bench.structured import PROMPT, RECORDS
from kvlm.structured.matcher import RequestGrammar

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--tokens", type=int, default=128)
ap.add_argument("--threads", type=int, default=2)
a = ap.parse_args()
llm = LLM("smollm2-135m", num_threads=a.threads, max_num_seqs=a.batch)
so = StructuredOutputsParams(json=RECORDS)
llm.llm_engine.grammars.compile(so)
fills: dict[str, list[float]] = {}
fill = RequestGrammar.mask


def timed_fill(self: RequestGrammar) -> torch.Tensor:
    t0 = time.perf_counter()
    out = fill(self)
    dt = time.perf_counter() - t0
    m = self.matcher
    kind = "stopped" if m.is_stopped() else "free" if not m.compute_ff_bytes() else \
        "forced" if m.compute_ff_tokens() else "forced, no token"
    fills.setdefault(kind, []).append(dt)
    return out


RequestGrammar.mask = timed_fill  # type: ignore[method-assign]
sp = SamplingParams(max_tokens=a.tokens, temperature=0, structured_outputs=so)
llm.generate([PROMPT] * a.batch, sp)  # warm-up
fills.clear()
llm.generate([PROMPT] * a.batch, sp)
total = sum(len(v) for v in fills.values())
print(f"batch {a.batch}, {a.tokens} tokens a request: {total} mask fills")
for k, v in sorted(fills.items()):
    print(f"  {k:17s} {len(v):5d} fills, median {statistics.median(v) * 1e6:7.1f} us")

m = llm.llm_engine.grammars.compile(so).deep_copy()
text = '[{"name":"John","age":25,"city":"New York","tags":[]},{"name":"Jane","age":30,"city":"Paris","tags":["a"]}'
sweep = torch.randn(2048, 2048)
warm, cold = [], []
for t in llm.llm_engine.tokenizer.encode(text, add_special_tokens=False):
    if m.compute_ff_bytes():
        ts = []
        for _ in range(20):
            t0 = time.perf_counter()
            m.compute_ff_tokens()
            ts.append(time.perf_counter() - t0)
        warm.append(min(ts))
        ts = []
        for _ in range(5):
            sweep @ sweep
            t0 = time.perf_counter()
            m.compute_ff_tokens()
            ts.append(time.perf_counter() - t0)
        cold.append(statistics.median(ts))
    m.consume_token(t)
print(f"forced-byte tokenization over {len(warm)} forced states: warm {min(warm) * 1e6:.1f}-{max(warm) * 1e6:.1f} us, "
      f"cold {min(cold) * 1e6:.1f}-{max(cold) * 1e6:.1f} us")
