"""Scheduler: which requests run in the next step, and how many of their tokens (plain Python, no torch).

Each step gets a token budget (`max_num_batched_tokens`) and a cap on running requests (`max_num_seqs`).
Running requests go first, oldest first: a decoding request asks for 1 token, a request still prefilling
asks for the rest of its prompt and gets what the budget allows (chunked prefill), so prefill chunks and
decodes share one step. Then waiting requests are admitted in FCFS order while budget, seats and blocks
last. When a running request cannot get a block, the most recently admitted running request is
preempted by recompute: its blocks are freed, its computed count reset, and it goes back to the front of
the waiting queue, keeping the tokens it generated (they are prefilled again when it resumes).

Prefix caching: at admission a request takes references on the longest run of cached blocks equal to its
leading tokens (`BlockManager.find_cached_prefix`), starts with those tokens computed and is scheduled
only for the rest (at least its last token, so it has logits to sample from). A request asking for
prompt logprobs takes no cached prefix: it needs logits at every prompt position; nor does an embedding
(engine/pooling.py). A request preempted
and resumed looks up the cache again, so its own released blocks usually come straight back.

Bounded caches (`kv_policy.BoundedKV`): before a running request's step, the blocks its window has left
go back to the pool (`BlockManager.evict`); at the first eviction its sink blocks are swapped for private
copies, and whenever the window moves the runner re-rotates their keys (`ScheduledBatch.block_copies`,
`sink_moves`). A step's rows of such a request never straddle a move of the window (`chunk_limit`).

Layer groups (`kv_cache/layer_groups.py`): a model with sliding-window layers has a block manager per
extra group (`groups`: (manager, window)); every allocation, eviction, release and prefix hit is made in
all of them, and a request's rows per step are capped at the smallest window (`chunk_cap`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from kvlm.kv_cache.block_manager import EVICTED, BlockManager
from kvlm.kv_cache.layer_groups import GroupView, evict_upto
from kvlm.kv_cache.prefix_misses import PrefixHistory
from kvlm.request import Request, RequestStatus

log = logging.getLogger("kvlm")


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """One step's work: requests[i] computes its next num_new_tokens[i] tokens."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Bounded caches: (source, destination) blocks whose K/V the runner copies before the step, and the
    # requests whose sink keys it re-rotates to their `sink_shift` before the step.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    sink_moves: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


def _count_evicted(req: Request) -> None:
    """Usage's evicted tokens of a bounded request: those between its sinks and its kept window (never
    less than counted before: a preempted request's count stays)."""
    policy = req.kv_policy
    assert policy is not None
    kept = policy.kept_start(req.num_computed_tokens)
    req.metrics.num_evicted_tokens = max(req.metrics.num_evicted_tokens, kept - policy.num_sinks)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 recompute_all: bool = False, prefix_history: PrefixHistory | None = None,
                 groups: list[tuple[BlockManager, int]] | None = None) -> None:
        self.bm = block_manager
        self.groups = groups or []  # layer groups 1..: (their block manager, their window)
        self.chunk_cap = min((w for _, w in self.groups), default=None)
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        # recompute_all: no KV cache, every step feeds each request's whole history (no chunking then).
        self.recompute_all = recompute_all
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.prefix_history = prefix_history  # explains prefix-cache misses (None: no diagnostics)
        # vLLM's metric names: prompt tokens looked up in / found in the prefix cache at first admission.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def add(self, req: Request) -> None:
        n = len(self.groups)
        req.group_tables, req.group_cached, req.group_evicted = [[] for _ in range(n)], [0] * n, [0] * n
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _wanted(self, req: Request, budget: int) -> int:
        remaining = req.num_tokens - req.num_computed_tokens
        n = remaining if self.recompute_all else min(remaining, budget)
        if self.chunk_cap is not None:
            n = min(n, self.chunk_cap)
        return n if req.kv_policy is None else req.kv_policy.chunk_limit(req.num_computed_tokens, n)

    # -- layer groups ------------------------------------------------------------------------------
    def _views(self, req: Request) -> list[tuple[BlockManager, GroupView, int]]:
        return [(bm, GroupView(req, g), w) for g, (bm, w) in enumerate(self.groups, 1)]

    def _groups_fit(self, req: Request, num_tokens: int, hits: list[tuple[int, list[int]]] | None = None) -> bool:
        """Whether every extra group can hold `num_tokens` of `req` (after its window eviction; `hits`:
        per group, the EVICTED entries and cached blocks a prefix hit gives it at admission)."""
        for i, (bm, view, _) in enumerate(self._views(req)):
            skip, cached = hits[i] if hits else (0, [])
            if not bm.can_allocate(view, num_tokens, cached, skip=skip):
                return False
        return True

    def _groups_allocate(self, req: Request, num_tokens: int, hits: list[tuple[int, list[int]]] | None = None) -> None:
        for i, (bm, view, _) in enumerate(self._views(req)):
            skip, cached = hits[i] if hits else (0, [])
            bm.allocate(view, num_tokens, cached, skip=skip)

    def _groups_evict(self, req: Request) -> None:
        """Give back the blocks the next rows of `req` (and all later ones) no longer see in each group."""
        for bm, view, w in self._views(req):
            bm.evict(view, evict_upto(req.num_computed_tokens, w, bm.block_size))

    def _window_hit(self, req: Request, hit: list[int]) -> tuple[list[int], list[tuple[int, list[int]]]]:
        """The longest prefix of `hit` (group 0's cached blocks) that every extra group can serve: its
        blocks inside the window of the first token computed after it (layer_groups.py)."""
        for k in range(len(hit), -1, -1):
            if k < len(hit) and EVICTED in hit[:k]:
                return [], [(0, []) for _ in self.groups]  # a bounded hit is whole or nothing
            parts = []
            for bm, view, w in self._views(req):
                first = evict_upto(k * bm.block_size, w, bm.block_size)
                blocks = bm.find_window_blocks(view, k, first) if k else []
                if blocks is None:
                    break
                parts.append((first, blocks))
            else:
                return hit[:k], parts
        return [], [(0, []) for _ in self.groups]

    def _evict(self, req: Request) -> int:
        """Give back the blocks a bounded request's window has left before its next rows; returns the
        blocks it needs besides (private copies of its sinks, at its first eviction)."""
        policy, p = req.kv_policy, req.num_computed_tokens
        assert policy is not None
        upto = policy.evict_upto(p)
        if upto <= req.evicted_upto:
            return 0
        first = req.sink_shift == 0  # its sinks are not private copies yet
        self.bm.evict(req, upto)
        _count_evicted(req)
        return policy.sink_blocks if first else 0

    def _move_sinks(self, req: Request, batch: ScheduledBatch, extra: int) -> None:
        """After allocation: the private sink copies (first eviction) and their new shift."""
        policy = req.kv_policy
        assert policy is not None
        for i in range(extra):
            batch.block_copies.append(self.bm.make_private(req, i))
        shift = policy.ctx_shift(req.num_computed_tokens)
        if policy.sink_blocks and shift != req.sink_shift:
            req.sink_shift = shift
            batch.sink_moves.append(req)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch()
        now = time.perf_counter()
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = self._wanted(req, budget)
            extra = self._evict(req) if req.kv_policy is not None else 0
            if self.groups:
                self._groups_evict(req)
            while not (self.bm.can_allocate(req, req.num_computed_tokens + n, extra=extra)
                       and self._groups_fit(req, req.num_computed_tokens + n)):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            self.bm.allocate(req, req.num_computed_tokens + n)
            self._groups_allocate(req, req.num_computed_tokens + n)
            if req.kv_policy is not None:
                self._move_sinks(req, batch, extra)
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
        # Admit waiting requests only when nobody was preempted this step (otherwise they would just
        # take the blocks the preemption freed for older requests).
        pending = self._pending_blocks(batch) if self.waiting else None  # only admission reads it
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not batch.preempted:
            # FCFS among requests that can run: one whose grammar is still compiling keeps its place.
            req = next((r for r in self.waiting if r.grammar_ready), None)
            if req is None:
                break
            hit = self.bm.find_cached_prefix(req) if req.reads_prefix_cache else []
            plain = hit
            if req.kv_policy is not None and hit:
                hit = self.bm.extend_bounded_hit(req, hit)  # past its first eviction: sinks + window
            ghits = None
            if self.groups:
                hit, ghits = self._window_hit(req, hit)
                if not hit and plain:  # the groups could not serve the extended hit: the plain one, then
                    hit, ghits = self._window_hit(req, plain)
            moved = EVICTED in hit  # a bounded hit past the first eviction: its sinks move now
            extra = req.kv_policy.sink_blocks if moved and req.kv_policy is not None else 0
            if pending and len(hit) < len(req.block_hashes) and req.block_hashes[len(hit)] in pending:
                break  # its next block is being computed this step: wait one step and reuse it instead
            req.num_computed_tokens = len(hit) * self.bm.block_size
            n = self._wanted(req, budget)
            # Without a cache a request cannot be chunked: it may exceed the budget only when alone.
            too_big = self.recompute_all and n > budget and bool(batch.requests)
            if too_big or not (self.bm.can_allocate(req, req.num_computed_tokens + n, hit, extra=extra)
                               and self._groups_fit(req, req.num_computed_tokens + n, ghits)):
                req.num_computed_tokens = 0  # waiting requests hold nothing
                break
            self.waiting.remove(req)
            self.bm.allocate(req, req.num_computed_tokens + n, hit)
            self._groups_allocate(req, req.num_computed_tokens + n, ghits)
            if moved:
                policy = req.kv_policy
                assert policy is not None
                req.evicted_upto = policy.evict_upto(req.num_computed_tokens)
                _count_evicted(req)
                self._move_sinks(req, batch, extra)
            req.status = RequestStatus.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                self._first_admission(req)
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
            if pending is not None:
                pending.update(self._new_full_blocks(req, n))
        if self.bm.readers is not None:  # debug mode: nobody writes into a block another one reads
            for req, n in zip(batch.requests, batch.num_new_tokens):
                self.bm.assert_writable(req, req.num_computed_tokens, req.num_computed_tokens + n)
                for bm, view, _ in self._views(req):
                    if bm.readers is not None:
                        bm.assert_writable(view, req.num_computed_tokens, req.num_computed_tokens + n)
        return batch

    def _pending_blocks(self, batch: ScheduledBatch) -> set[bytes] | None:
        """Hashes of the full blocks this step computes (None without prefix caching). A waiting request
        whose next uncached block is among them is admitted a step later, to take it from the cache
        instead of computing the same K/V twice (N requests sharing a system prompt arriving together)."""
        if not self.bm.enable_prefix_caching or self.recompute_all:
            return None
        pending: set[bytes] = set()
        for req, n in zip(batch.requests, batch.num_new_tokens):
            pending.update(self._new_full_blocks(req, n))
        return pending

    def _new_full_blocks(self, req: Request, n: int) -> list[bytes]:
        bs = self.bm.block_size
        first, end = req.num_computed_tokens // bs, (req.num_computed_tokens + n) // bs
        if req.kv_policy is not None:
            end = min(end, req.kv_policy.max_tokens // bs)  # nothing past it is ever registered
        return self.bm.block_hashes(req, end)[first:end] if req.reads_prefix_cache else []

    def _first_admission(self, req: Request) -> None:
        """Prefix-cache accounting and miss diagnostics, once per request."""
        if not self.bm.enable_prefix_caching or self.recompute_all or req.pooling is not None:
            return  # (an embedding never looks the cache up: it is no query, and no earlier prefix to explain)
        m = req.metrics
        m.num_cached_tokens = min(req.num_computed_tokens, req.num_prompt_tokens)
        self.prefix_cache_queries += req.num_prompt_tokens
        self.prefix_cache_hits += m.num_cached_tokens
        if self.prefix_history is not None:
            miss = self.prefix_history.explain(req, m.num_cached_tokens)
            if miss is not None:
                m.prefix_miss = str(miss)
                log.debug("kvlm: prefix cache: %s %s", req.request_id, miss)
            self.prefix_history.add(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request from the queues and release its blocks (the full ones
        stay in the prefix cache until their room is needed)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._free(req)
        req.status = RequestStatus.FINISHED

    def _free(self, req: Request) -> None:
        self.bm.free(req)
        for bm, view, _ in self._views(req):
            bm.free(view)

    def cache_full_blocks(self, req: Request) -> None:
        """After a step: register `req`'s newly full blocks in every group's prefix cache."""
        self.bm.cache_full_blocks(req)
        for bm, view, _ in self._views(req):
            bm.cache_full_blocks(view)

    def check(self) -> None:
        """The block managers' invariants over every request that may hold blocks."""
        reqs = list(self.running)
        self.bm.check(reqs)
        for g, (bm, _) in enumerate(self.groups, 1):
            bm.check([GroupView(r, g) for r in reqs])
