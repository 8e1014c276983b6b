"""Bounded KV caches without a model: the policy's arithmetic (kvlm.kv_policy) and the block manager and
scheduler keeping their invariants while a sinks + window request evicts (plain Python, no torch)."""

from __future__ import annotations

import random

import pytest

from kvlm.engine.scheduler import Scheduler
from kvlm.errors import ParameterError
from kvlm.kv_cache.block_manager import EVICTED, BlockManager
from kvlm.kv_policy import BoundedKV
from kvlm.request import Request
from kvlm.sampling_params import SamplingParams


@pytest.mark.parametrize("n,s,bs", [(32, 4, 4), (64, 0, 16), (512, 4, 16), (48, 20, 8)])
def test_policy_attends_at_most_max_tokens_sinks_first(n: int, s: int, bs: int) -> None:
    """Row p attends [0, p] before the first eviction, then the sinks and the tokens kept_start(p) .. p:
    at most N tokens, more than N - block_size, kept_start block-aligned, past the sinks and non-decreasing."""
    pol = BoundedKV.make(n, s, bs, max_model_len=4096)
    assert pol.num_sinks % bs == 0 and pol.num_sinks >= s
    last = 0
    for p in range(4 * n):
        f = pol.kept_start(p)
        if p < n:
            assert f == 0 and pol.attended(p) == p + 1 and pol.ctx_shift(p) == 0
            continue
        assert f % bs == 0 and f >= pol.num_sinks + bs and f >= last
        assert n - bs < pol.attended(p) <= n
        assert pol.attended(p) == pol.num_sinks + p + 1 - f
        assert pol.ctx_shift(p) == f - pol.num_sinks
        assert pol.evict_upto(p) == f // bs
        last = f


def test_chunk_limit_never_straddles_a_window_move() -> None:
    """Every chunk chunk_limit allows has one kept_start over its rows, and it is as long as it can be."""
    pol = BoundedKV.make(32, 4, 4, max_model_len=4096)
    for start in range(0, 120):
        for n in (1, 3, 7, 64):
            m = pol.chunk_limit(start, n)
            assert 1 <= m <= n
            assert len({pol.kept_start(p) for p in range(start, start + m)}) == 1
            if m < n:
                assert pol.kept_start(start + m) != pol.kept_start(start)


def test_virtual_table_is_sinks_then_kept_blocks() -> None:
    pol = BoundedKV.make(32, 4, 4, max_model_len=4096)
    table = list(range(100, 120))
    assert pol.virtual_table(table, 10) == table
    f = pol.kept_start(50)
    assert pol.virtual_table(table, 50) == table[:1] + table[f // 4 :]


@pytest.mark.parametrize("n,s,bs,ctx,field", [(30, 4, 4, 4096, "max_kv_tokens"), (8, 4, 4, 4096, "max_kv_tokens"),
                                             (64, 4, 4, 32, "max_kv_tokens"), (32, -1, 4, 4096, "sink_tokens"),
                                             (0, 4, 4, 4096, "max_kv_tokens")])
def test_bad_policies_are_refused_with_the_field(n: int, s: int, bs: int, ctx: int, field: str) -> None:
    with pytest.raises(ParameterError) as e:
        BoundedKV.make(n, s, bs, max_model_len=ctx)
    assert e.value.param == field


def _run(bm: BlockManager, sched: Scheduler, reqs: list[Request], steps: int, rng: random.Random) -> None:
    """Drive the scheduler like the engine (no model): computed tokens advance, decodes append a token."""
    for _ in range(steps):
        batch = sched.schedule()
        for req, n in zip(batch.requests, batch.num_new_tokens):
            if req.kv_policy is not None:
                pol = req.kv_policy
                start = req.num_computed_tokens
                assert len({pol.kept_start(p) for p in range(start, start + n)}) == 1
                held = [b for b in req.block_table if b != EVICTED]
                assert len(held) <= pol.max_tokens // bm.block_size + 1, "memory follows the window"
            req.num_computed_tokens += n
            bm.cache_full_blocks(req)
            if req.num_computed_tokens == req.num_tokens:
                req.token_ids.append(rng.randrange(50))
        bm.check(sched.running)
        if rng.random() < 0.05 and sched.running:  # a client goes away
            sched.finish(rng.choice(sched.running))
            bm.check(sched.running)


def test_block_manager_invariants_hold_while_bounded_requests_evict() -> None:
    """Bounded and unbounded requests sharing a small pool, with preemption and a shared prefix: evicted
    blocks go back to the pool, sink blocks become private copies, ref counts always match the tables."""
    rng = random.Random(3)
    bm = BlockManager(40, 4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=24)
    shared = [rng.randrange(50) for _ in range(12)]
    pol = BoundedKV.make(32, 4, 4, max_model_len=4096)
    reqs = []
    for i in range(6):
        prompt = shared + [rng.randrange(50) for _ in range(rng.randint(1, 40))]
        r = Request(f"r{i}", prompt, len(prompt), SamplingParams(), kv_policy=pol if i % 2 == 0 else None)
        reqs.append(r)
        sched.add(r)
    _run(bm, sched, reqs, 300, rng)
    bounded = [r for r in reqs if r.kv_policy is not None]
    assert any(r.metrics.num_evicted_tokens > 0 for r in bounded)
    for r in list(sched.running) + list(sched.waiting):
        sched.finish(r)
    bm.check([])
    assert bm.num_free_blocks == bm.num_blocks


def test_first_eviction_copies_the_sinks_and_moves_them() -> None:
    """At a request's first eviction the scheduler swaps its sink block for a private copy (the shared
    original stays cached) and asks for the sinks' keys at the new shift."""
    bm = BlockManager(20, 4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    pol = BoundedKV.make(16, 4, 4, max_model_len=4096)
    r = Request("r", list(range(16)), 16, SamplingParams(), kv_policy=pol)
    sched.add(r)
    b = sched.schedule()
    assert b.num_new_tokens == [16] and not b.kv.block_copies
    r.num_computed_tokens = 16
    bm.cache_full_blocks(r)
    original = r.block_table[0]
    r.token_ids.append(99)
    b = sched.schedule()
    assert b.kv.block_copies == [(original, r.block_table[0])] and b.kv.sink_moves == [r]
    assert r.block_table[1] == EVICTED and r.sink_shift == pol.ctx_shift(16)
    assert bm.block_hash[original] is not None and bm.block_hash[r.block_table[0]] is None
    bm.check([r])
