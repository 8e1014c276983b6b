"""Teacher-forced scoring: a token sequence run as one prompt through the engine and its cache, each
position's logits streamed out as its chunk is computed (`kvlm bench quality`, `kvlm bench long`).

The engine steps as for any request: chunked prefill, the prefix cache, a bounded cache's eviction all apply,
so the logits are the ones generation would see. The runner shows each step's final hidden states to a
`hidden_observer` (`ModelRunner.hidden_observer`); the observer keeps the scored request's rows, and only
those rows go through the LM head, one chunk alive at a time. Nothing here knows tokens or sampling.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from kvlm.engine.model_runner import ModelRunner
from kvlm.outputs import StreamDelta
from kvlm.request import Request
from kvlm.sampling_params import SamplingParams


class _Model(Protocol):
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class Stepping(Protocol):
    """What scoring needs of the engine (`Engine` is one)."""

    runner: ModelRunner
    model: _Model

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Request: ...

    def step(self, keep_logits: bool = False) -> list[StreamDelta]: ...

    def abort(self, request_id: str) -> bool: ...


def prompt_logits(engine: Stepping, token_ids: list[int], first: int, max_kv_tokens: int | None = None,
                  sink_tokens: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """Teacher forcing through the cache: run `token_ids` as a prompt and yield, step by step as the
    chunks are computed, (p0, logits (n, vocab) float32) for positions p0 .. p0 + n - 1 >= `first`,
    the logits at position p predicting token p + 1 (the last position predicts nothing and is left
    out). Positions come in order, each once; only one chunk's logits are alive at a time. Run it
    alone (other requests would share its steps, which changes nothing but the time it takes).
    max_kv_tokens / sink_tokens: score it through a bounded cache (sinks + window, kv_policy.py)."""
    ready: list[tuple[int, torch.Tensor]] = []
    todo = [first]  # the next position to score
    last = len(token_ids) - 1
    req = engine.add_request(list(token_ids), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                                             max_kv_tokens=max_kv_tokens, sink_tokens=sink_tokens))

    def observe(r: Request, start: int, hidden: torch.Tensor) -> None:
        lo, hi = max(start, todo[0]), min(start + hidden.shape[0], last)
        if r is req and lo < hi:  # a recomputed chunk (after preemption) adds nothing
            ready.append((lo, engine.model.compute_logits(hidden[lo - start : hi - start])))
            todo[0] = hi

    engine.runner.hidden_observer = observe
    try:
        while not req.is_finished:
            engine.step()
            while ready:
                yield ready.pop(0)
    finally:
        engine.runner.hidden_observer = None
        engine.abort(req.request_id)  # abandoned early: free its blocks (a no-op once finished)
