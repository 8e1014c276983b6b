"""Scheduler: which requests run in the next step, and how many of their tokens (plain Python, no torch).

Each step gets a token budget (`max_num_batched_tokens`) and a cap on running requests (`max_num_seqs`).
Running requests go first, oldest first: a decoding request asks for 1 token, a request still prefilling
asks for the rest of its prompt and gets what the budget allows (chunked prefill), so prefill chunks and
decodes share one step. Then waiting requests are admitted in FCFS order while budget, seats and blocks
last. When a running request cannot get a block, the most recently admitted running request is
preempted by recompute: its blocks are freed, its computed count reset, and it goes back to the front of
the waiting queue, keeping the tokens it generated (they are prefilled again when it resumes).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvlm.block_manager import BlockManager
from kvlm.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """One step's work: requests[i] computes its next num_new_tokens[i] tokens."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 recompute_all: bool = False) -> None:
        self.bm = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        # recompute_all: no KV cache, every step feeds each request's whole history (no chunking then).
        self.recompute_all = recompute_all
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _wanted(self, req: Request, budget: int) -> int:
        remaining = req.num_tokens - req.num_computed_tokens
        return remaining if self.recompute_all else min(remaining, budget)

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
            while not self.bm.can_allocate(req, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            self.bm.allocate(req, req.num_computed_tokens + n)
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
        # Admit waiting requests only when nobody was preempted this step (otherwise they would just
        # take the blocks the preemption freed for older requests).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not batch.preempted:
            req = self.waiting[0]
            n = self._wanted(req, budget)
            # Without a cache a request cannot be chunked: it may exceed the budget only when alone.
            too_big = self.recompute_all and n > budget and bool(batch.requests)
            if too_big or not self.bm.can_allocate(req, req.num_computed_tokens + n):
                break
            self.waiting.popleft()
            self.bm.allocate(req, req.num_computed_tokens + n)
            req.status = RequestStatus.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.bm.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, free_blocks: bool = True) -> None:
        """Remove a finished or aborted request from the queues; free its blocks unless the caller
        keeps them for a follow-up request (a chat turn) to adopt."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if free_blocks:
            self.bm.free(req)
        req.status = RequestStatus.FINISHED
