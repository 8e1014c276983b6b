"""Running an engine to completion in tests: tokens and per-step logits by prompt, with the block manager's
invariants checked after every step; random prompts of byte ids; the tiny model's KV bytes per token."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from kvlm import SamplingParams
from kvlm.engine.engine import Engine

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def run_alone(engine: Engine, ids: list[int], params: SamplingParams) -> tuple:
    """One request run to completion by itself: (the Request, its logits rows stacked, one per step)."""
    req = engine.add_request(ids, params)
    rows = []
    while not req.is_finished:
        engine.step(keep_logits=True)
        rows += [engine.last_result.logits[j] for j, r in enumerate(engine.last_result.requests) if r is req]
    return req, torch.stack(rows)


def run_engine(engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = GREEDY,
               order: list[int] | None = None,
               requests: list | None = None,
               loras: list[str | None] | None = None) -> tuple[dict[int, list[int]], dict[int, list[torch.Tensor]]]:
    """Run prompts to completion; returns tokens and per-step logits keyed by prompt index. `requests`,
    if given, receives the Request objects (for their metrics); `loras`: each prompt's adapter name."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    order = order if order is not None else list(range(len(prompts)))
    reqs = {i: engine.add_request(prompts[i], plist[i], lora=None if loras is None else loras[i]) for i in order}
    if requests is not None:
        requests.extend(reqs[i] for i in sorted(reqs))
    logits: dict[int, list[torch.Tensor]] = {i: [] for i in reqs}
    index = {r.request_id: i for i, r in reqs.items()}
    engine.mixed_steps = 0  # steps that ran a prefill chunk together with another request's decode
    while engine.has_unfinished:
        engine.step(keep_logits=True)
        qlens = engine.last_batch.num_new_tokens
        engine.mixed_steps += int(1 in qlens and any(q > 1 for q in qlens))
        res = engine.last_result
        for j, r in enumerate(res.requests):
            logits[index[r.request_id]].append(res.logits[j])
        engine.block_manager.check(engine.scheduler.running)
        if engine.config.enable_kv_cache:  # paging waste: allocated minus filled slots < one block
            bs = engine.block_manager.block_size
            for r in engine.scheduler.running:
                assert 0 <= len(r.block_table) * bs - r.num_computed_tokens < bs
                m = r.metrics
                assert 0 <= m.kv_bytes_held - m.kv_bytes_used < bs * engine.kv_bytes_per_token
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return {i: r.output_token_ids for i, r in reqs.items()}, logits


def random_prompts(n: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def small_bytes(path: Path) -> int:
    """KV bytes per token of the tiny model in float32."""
    from kvlm.loader import load_config

    return int(load_config(path).kv_bytes_per_token(4))


def assert_identical(a: tuple[dict, dict], b: tuple[dict, dict], what: str) -> None:
    """Two `run_engine` results: the same tokens, and every step's logits with the same bits."""
    (ta, la), (tb, lb) = a, b
    assert ta == tb, f"{what}: tokens differ"
    for i in ta:
        for k, (x, y) in enumerate(zip(la[i], lb[i])):
            assert torch.equal(x, y), f"{what}: prompt {i}, step {k}: max |diff| {float((x - y).abs().max()):.3g}"


def assert_engine_equivalences(path: Path, name: str, params: SamplingParams,
                               **extra: object) -> tuple[Engine, tuple[dict, dict], list[list[int]]]:
    """The bit-exact engine equivalences on one model (block size 4, four prompts sharing a 20-token prefix):
    cache vs none, chunked vs whole, alone vs batch, prefix hit vs miss, preempted vs not, 1 vs 2 threads.
    `extra`: EngineConfig fields every engine gets (an int8 cache, a bounded one). Returns the reference
    engine, its result and the prompts (for a family's own further checks)."""
    from typing import Any

    from kvlm import EngineConfig

    def engine(**cfg: Any) -> Engine:
        return Engine(path, EngineConfig(block_size=4, **{**extra, **cfg}), quiet=True)

    shared = random_prompts(1, 31, lo=20, hi=20)[0]
    prompts = [shared + tail for tail in random_prompts(4, 32, lo=2, hi=14)]
    main = engine(enable_prefix_caching=False)
    ref = run_engine(main, prompts, params)
    assert_identical(ref, run_engine(engine(enable_kv_cache=False), prompts, params), f"{name}: cache vs none")
    assert_identical(ref, run_engine(engine(max_num_batched_tokens=7, enable_prefix_caching=False), prompts, params),
                     f"{name}: chunked prefill (7 tokens a step)")
    for i in (0, 3):
        t, lg = run_engine(engine(enable_prefix_caching=False), [prompts[i]], params)
        assert_identical(({i: ref[0][i]}, {i: ref[1][i]}), ({i: t[0]}, {i: lg[0]}), f"{name}: alone vs batch ({i})")

    cached = engine()
    run_engine(cached, [shared + [1, 2]], params)  # fills the prefix cache with the shared blocks
    reqs: list = []
    hit = run_engine(cached, prompts, params, requests=reqs)
    assert all(r.metrics.num_cached_tokens >= 20 for r in reqs)
    assert_identical(ref, hit, f"{name}: prefix-cache hit vs miss")

    # 96 tokens of full-attention layers for four requests of up to 44: preemptions (Gemma 3's sliding
    # layers keep their fixed blocks per request besides, as the pool reserves them)
    windows = main.model_config.layer_windows or (None,) * main.model_config.num_hidden_layers
    sliding = sum(main.kv_cache.k[i].nbytes + main.kv_cache.v[i].nbytes for i, w in enumerate(windows) if w)
    budget = sliding + 96 * main.kv_bytes_per_token * windows.count(None) // len(windows)
    small = engine(kv_cache_memory=budget, enable_prefix_caching=False)
    reqs = []
    assert_identical(ref, run_engine(small, prompts, params, requests=reqs), f"{name}: preempted vs not")
    assert sum(r.metrics.num_preemptions for r in reqs) > 0

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if before > 1 else 2)
        assert_identical(ref, run_engine(engine(enable_prefix_caching=False), prompts, params),
                         f"{name}: {torch.get_num_threads()} vs {before} threads")
    finally:
        torch.set_num_threads(before)

    return main, ref, prompts


def assert_same_logits(a: list[torch.Tensor] | torch.Tensor, b: list[torch.Tensor] | torch.Tensor) -> None:
    """Equal bits on the native path (every row's computation is fixed: the engine's promise); within
    float32 rounding on the reference path (no native build), whose SDPA and BLAS calls change their
    summation order with the step's shape."""
    from kvlm.kernels import native

    a = torch.stack(a) if isinstance(a, list) else a
    b = torch.stack(b) if isinstance(b, list) else b
    if native.active_isa() == "reference":
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    else:
        assert torch.equal(a, b), f"logits differ (max |diff| {float((a - b).abs().max()):.3g})"


def chat_turns(path: Path, prefix: bool, **cfg) -> tuple[list[tuple[dict, dict]], list[int]]:
    """Eight turns of a chat (each turn's prompt: the history, then a new message), as `kvlm chat` sends
    them, on an engine with `cfg` (a bounded cache: an endless chat); returns each turn's (tokens, logits)
    and how many of its prompt tokens the cache served."""
    from kvlm import EngineConfig

    eng = Engine(path, EngineConfig(**cfg, enable_prefix_caching=prefix), quiet=True)
    history, turns, cached = [5, 6, 7], [], []
    for turn in range(8):
        history = history + [(31 * turn + j) % 200 + 20 for j in range(5)]
        reqs: list = []
        turns.append(run_engine(eng, [history], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                                requests=reqs))
        cached.append(reqs[0].metrics.num_cached_tokens)
        history = history + turns[-1][0][0]
        eng.scheduler.check()
    return turns, cached
