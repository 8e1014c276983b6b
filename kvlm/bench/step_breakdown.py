"""Where the time of one decode step goes, for `kvlm bench latency`.

A step of one greedy request at a given context is split into:
* weights: every linear layer's forward (QuantLinear / nn.Linear, lm_head included), timed by forward
  hooks around each module;
* attention: each layer's `Attention` module (model/llama.py: fetching the context and attending, by
  the paged kernel in place or gather + the reference SDPA), timed by hooks, minus its KV writes;
* kv_write: storing the new token's K/V in every layer (timed by a proxy around the cache);
* other_ops: the rest of the model's forward: embedding, norms, RoPE, SiLU x up, residual adds and the
  Python that drives 30 layers;
With the fused native decode step (fused_decode.py) the layers run in one C++ call that times its own
matrix products, KV writes and attention (decode.cpp's profile); other_ops is then the call's remaining
time (embedding, norms, RoPE, SiLU, the call itself).
* sampling: `sampler.sample` on the step's logits, timed alone on the same request;
* host: everything outside the forward and the sampler: scheduling, building the step's metadata,
  appending the token and detokenizing (engine.step's wall time minus the above).

The instrumented steps (hooks, a timing proxy for the cache) are only used for the split; the step
time reported is the median of un-instrumented steps, and `host` absorbs the hooks' own cost, so it is
an upper bound. Timing is wall clock on the host (`perf_counter`): CPU kernels are synchronous.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

from kvlm.attention.metadata import AttentionMetadata
from kvlm.attention.paged import PagedKV
from kvlm.model.fused_decode import PROFILE_PARTS

PARTS = ("weights", "attention", "kv_write", "other_ops", "sampling", "host")


class _Clock:
    def __init__(self) -> None:
        self.total: dict[str, float] = {}

    def add(self, part: str, seconds: float) -> None:
        self.total[part] = self.total.get(part, 0.0) + seconds


class TimedKVCache:
    """The KVCache protocol around another cache, adding each call's time to a clock."""

    def __init__(self, inner: Any, clock: _Clock) -> None:
        self.inner, self.clock = inner, clock
        self.block_size, self.num_blocks = inner.block_size, inner.num_blocks

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        t = time.perf_counter()
        self.inner.write(layer, k, v, meta)
        self.clock.add("kv_write", time.perf_counter() - t)

    def fetch(self, layer: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.fetch(layer, meta)  # inside the Attention module's time

    def update_and_fetch(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                         meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        self.write(layer, k, v, meta)
        return self.fetch(layer, meta)

    def blocks(self, layer: int, meta: AttentionMetadata) -> PagedKV:
        return self.inner.blocks(layer, meta)

    def begin_step(self, meta: AttentionMetadata) -> None:
        self.inner.begin_step(meta)


def _time_module(module: nn.Module, clock: _Clock, parts: tuple[str, ...], starts: list[float]) -> list[Any]:
    """Forward hooks adding the module's forward time to each of `parts` on the clock."""
    def pre(_m: nn.Module, _a: Any) -> None:
        starts.append(time.perf_counter())

    def post(_m: nn.Module, _a: Any, _o: Any) -> None:
        dt = time.perf_counter() - starts.pop()
        for part in parts:
            clock.add(part, dt)

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


class _TimedFused:
    """A FusedDecoder stand-in adding each call's wall time to the clock's forward total."""

    def __init__(self, inner: Any, clock: _Clock) -> None:
        self.inner, self.clock = inner, clock

    def fits(self, positions: torch.Tensor) -> bool:
        return self.inner.fits(positions)

    def __call__(self, *args: Any) -> torch.Tensor:
        t = time.perf_counter()
        out = self.inner(*args)
        self.clock.add("_forward", time.perf_counter() - t)
        return out


def decode_breakdown(llm: Any, ids: list[int], steps: int) -> dict[str, Any]:
    """Median step time and the per-part split (seconds per step) of `steps` decode steps after `ids`."""
    from kvlm.engine.sampler import sample
    from kvlm.model.llama import Attention
    from kvlm.model.quant_layers import QuantLinear
    from kvlm.sampling_params import SamplingParams

    eng = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)

    plain = []  # un-instrumented step times
    req = eng.add_request(ids, params)
    eng.step()  # prefill
    while not req.is_finished:
        t = time.perf_counter()
        eng.step()
        plain.append(time.perf_counter() - t)

    clock, starts = _Clock(), []
    runner, model = eng.runner, eng.model
    fused = runner.fused  # the fused native decode step (fused_decode.py), or None: the module path
    handles = []
    for m in model.modules():
        if isinstance(m, (QuantLinear, nn.Linear)):  # lm_head runs after the forward: counted apart too
            handles += _time_module(m, clock, ("weights", "_lm_head") if m is model.lm_head else ("weights",), starts)
        elif isinstance(m, Attention):  # write + fetch + attend; the KV writes are taken out below
            handles += _time_module(m, clock, ("attention",), starts)
    handles += _time_module(model, clock, ("_forward",), starts)
    inner = runner.kv_cache
    if fused is None:
        runner.kv_cache = TimedKVCache(inner, clock)
    else:  # the native step times its own parts (decode.cpp); time the whole call here
        fused.profile = torch.zeros(len(PROFILE_PARTS), dtype=torch.float64)
        runner.fused = _TimedFused(fused, clock)
    try:
        req = eng.add_request(ids, params)
        eng.step()
        clock.total = {}  # count decode steps only
        if fused is not None:
            fused.profile.zero_()
        wall = 0.0
        n = 0
        while not req.is_finished:
            t = time.perf_counter()
            eng.step(keep_logits=True)
            wall += time.perf_counter() - t
            n += 1
            logits = eng.last_result.logits
            t = time.perf_counter()
            sample(logits, [req], eng.tokenizer.eos_token_ids)  # greedy: reads the request, changes nothing
            clock.add("sampling", time.perf_counter() - t)
    finally:
        runner.kv_cache = inner
        if fused is not None:
            native_parts = dict(zip(PROFILE_PARTS, fused.profile.tolist()))
            fused.profile = None
            runner.fused = fused
        for h in handles:
            h.remove()
    if fused is None:  # the Attention modules' time includes the writes the proxy timed
        clock.total["attention"] = max(0.0, clock.total.get("attention", 0.0) - clock.total.get("kv_write", 0.0))
    else:
        clock.add("weights", native_parts["matmul"])
        clock.add("attention", native_parts["attention"])
        clock.add("kv_write", native_parts["kv_write"])
    per = {k: clock.total.get(k, 0.0) / n for k in (*PARTS, "_forward", "_lm_head")}
    # other_ops: the forward minus what the hooks, the cache proxy or the native profile saw inside it.
    inside = per["weights"] - per["_lm_head"] + per["attention"] + per["kv_write"]
    per["other_ops"] = max(0.0, per["_forward"] - inside)
    step = statistics.median(plain)
    per["host"] = max(0.0, step - sum(per[p] for p in PARTS if p != "host"))
    return {"step_s": step, "instrumented_step_s": wall / n, "parts_s": {p: per[p] for p in PARTS}}
