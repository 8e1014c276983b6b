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

Blocks are the KV cache manager's business (`kv_cache/manager.py`): the scheduler asks it whether a
request's next rows fit (`can_fit`), lets it evict what a bounded window or a sliding layer group has left
before them (`evict`) and allocate them (`allocate`), which also yields the block copies and sink moves the
runner makes before the step (`ScheduledBatch.kv`). A step's rows of a bounded request never straddle a
move of its window (`chunk_limit`), nor exceed the smallest sliding window (`KVCacheManager.chunk_cap`).

Speculative decoding (`engine/speculator.py`): a decoding request with drafts asks for 1 + k rows (its last
token, then the drafts), within the budget and only if their blocks fit without preempting anyone
(`_fit_drafts`); after the step it keeps the blocks of its accepted tokens only (`keep_computed`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from kvlm.kv_cache.block_manager import BlockManager
from kvlm.kv_cache.manager import KVCacheManager, StepKV
from kvlm.kv_cache.prefix_misses import PrefixHistory
from kvlm.request import Request, RequestStatus

log = logging.getLogger("kvlm")


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """One step's work: requests[i] computes its next num_new_tokens[i] tokens."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    kv: StepKV = field(default_factory=StepKV)  # block copies and sink moves before the step (bounded caches)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 recompute_all: bool = False, prefix_history: PrefixHistory | None = None,
                 groups: list[BlockManager] | None = None) -> None:
        self.kv = KVCacheManager(block_manager, groups)
        self.bm = block_manager  # group 0's (the prefix cache's hashes and lookups)
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        # recompute_all: no KV cache, every step feeds each request's whole history (no chunking then).
        self.recompute_all = recompute_all
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.prefix_history = prefix_history  # explains prefix-cache misses (None: no diagnostics)
        # vLLM's metric names: prompt tokens looked up in / found in the prefix cache at first admission.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def groups(self) -> list[BlockManager]:
        return self.kv.groups

    def add(self, req: Request) -> None:
        self.kv.add(req)
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _wanted(self, req: Request, budget: int) -> int:
        remaining = req.num_tokens - req.num_computed_tokens
        n = remaining if self.recompute_all else min(remaining, budget)
        if self.kv.chunk_cap is not None:
            n = min(n, self.kv.chunk_cap)
        return n if req.kv_policy is None else req.kv_policy.chunk_limit(req.num_computed_tokens, n)

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
            extra = self.kv.evict(req)
            if req.draft_token_ids:  # speculative decoding: its drafts ride along as n more rows, if they fit
                req.draft_token_ids = self._fit_drafts(req, n, budget, extra)
                n += len(req.draft_token_ids)
            while not self.kv.can_fit(req, req.num_computed_tokens + n, extra):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            self.kv.allocate(req, req.num_computed_tokens + n, batch.kv, extra)
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
            hit = self.kv.find_hit(req)
            k = len(hit.blocks)
            if pending and k < len(req.block_hashes) and req.block_hashes[k] in pending:
                break  # its next block is being computed this step: wait one step and reuse it instead
            req.num_computed_tokens = k * self.bm.block_size
            n = self._wanted(req, budget)
            # Without a cache a request cannot be chunked: it may exceed the budget only when alone.
            too_big = self.recompute_all and n > budget and bool(batch.requests)
            if too_big or not self.kv.can_fit(req, req.num_computed_tokens + n, hit.extra, hit):
                req.num_computed_tokens = 0  # waiting requests hold nothing
                break
            self.waiting.remove(req)
            self.kv.allocate(req, req.num_computed_tokens + n, batch.kv, hit.extra, hit)
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
                self.kv.assert_writable(req, req.num_computed_tokens, req.num_computed_tokens + n)
        return batch

    def _fit_drafts(self, req: Request, n: int, budget: int, extra: int) -> list[int]:
        """The drafts `req` can verify in this step beside its `n` rows (its last token): within the token
        budget and the chunk cap, and only if their blocks fit without preempting anyone (else none)."""
        k = len(req.draft_token_ids)
        if n != req.num_tokens - req.num_computed_tokens:
            return []  # not decoding (a drafted request always is; kept safe)
        k = min(k, budget - n, (self.kv.chunk_cap or 1 << 30) - n)
        if req.kv_policy is not None:  # a bounded cache: the rows stay within one position of its window
            k = min(k, req.kv_policy.chunk_limit(req.num_computed_tokens, n + k) - n)
        if k > 0 and not self.kv.can_fit(req, req.num_computed_tokens + n + k, extra):
            k = 0
        return req.draft_token_ids[: max(k, 0)]

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
        n -= len(req.draft_token_ids)  # drafts' blocks are registered only once accepted
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
        m.num_tier_tokens = min(m.num_tier_tokens, m.num_cached_tokens)  # (loaded, and still there at admission)
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
        req.draft_token_ids = []
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
        self.kv.free(req)

    def keep_computed(self, req: Request) -> None:
        """After a verification: `req` keeps K/V for its first num_computed_tokens only; the blocks past
        them (held for rejected drafts) go back to the pool, then its newly full blocks are registered."""
        self.kv.trim(req, req.num_computed_tokens)
        self.kv.cache_full_blocks(req)

    def cache_full_blocks(self, req: Request) -> None:
        """After a step: register `req`'s newly full blocks in every group's prefix cache."""
        self.kv.cache_full_blocks(req)

    def check(self) -> None:
        """The block managers' invariants over every request that may hold blocks."""
        self.kv.check(list(self.running))
