"""Tests for kvlm.engine.scheduler: FCFS admission, token budget and chunked prefill, seat limit, preemption by
recompute, abort, and recompute_all mode. No model: the test plays the engine loop itself."""

from __future__ import annotations

import random

import pytest

from kvlm.engine.scheduler import ScheduledBatch, Scheduler
from kvlm.kv_cache.block_manager import BlockManager
from kvlm.request import Request, RequestStatus
from kvlm.sampling_params import SamplingParams

FAKE_TOKEN = 7


class Sim:
    """Scheduler + BlockManager driven like the engine: run, count computed tokens, append fake tokens."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, budget: int,
                 recompute_all: bool = False) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        self.sched = Scheduler(self.bm, max_num_seqs, budget, recompute_all=recompute_all)
        self.reqs: list[Request] = []
        self.want: dict[str, int] = {}  # outputs after which a request finishes
        self.admitted: list[str] = []  # request ids in order of first scheduling
        self.finished: list[str] = []

    def add(self, rid: str, prompt_len: int, outputs: int) -> Request:
        req = Request(rid, [1 + i % 50 for i in range(prompt_len)], prompt_len, SamplingParams())
        self.reqs.append(req)
        self.want[rid] = outputs
        self.sched.add(req)
        return req

    def step(self) -> ScheduledBatch:
        s = self.sched
        before = set(s.running)
        batch = s.schedule()
        if batch.preempted:  # a preempting step admits nobody (it would only take the freed blocks)
            assert all(r in before for r in batch.requests)
        assert len(batch.requests) == len(set(batch.requests)), "a request scheduled twice in one step"
        assert len(s.running) <= s.max_num_seqs and len(batch.requests) <= s.max_num_seqs
        if not s.recompute_all:
            assert batch.num_tokens <= s.max_num_batched_tokens
        for req, n in zip(batch.requests, batch.num_new_tokens):
            assert req.status is RequestStatus.RUNNING and req in s.running
            assert 1 <= n <= req.num_tokens - req.num_computed_tokens
            assert len(req.block_table) >= self.bm.blocks_for(req.num_computed_tokens + n), "no slots for the chunk"
            if req.request_id not in self.admitted:
                self.admitted.append(req.request_id)
        for req in batch.preempted:
            assert req not in batch.requests and req.status is RequestStatus.WAITING
        assert batch.requests or not s.has_unfinished, "no progress"
        # Play the engine: the chunk's K/V are now cached; a chunk reaching the end yields a token.
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
            done = req.num_computed_tokens == req.num_tokens
            if s.recompute_all:
                req.num_computed_tokens = 0
            if done:
                req.token_ids.append(FAKE_TOKEN)
                if req.num_output_tokens >= self.want[req.request_id]:
                    s.finish(req)
                    self.finished.append(req.request_id)
        self.check()
        return batch

    def check(self) -> None:
        self.bm.check(self.reqs)
        for r in self.reqs:
            if r.status is not RequestStatus.RUNNING:
                assert r.block_table == [], f"{r.request_id} ({r.status}) still holds blocks"
            if r.status is RequestStatus.WAITING:
                assert r.num_computed_tokens == 0 and r in self.sched.waiting
        assert self.bm.num_free_blocks + self.bm.num_used_blocks == self.bm.num_blocks

    def run(self, max_steps: int = 1000) -> int:
        for i in range(max_steps):
            if not self.sched.has_unfinished:
                return i
            self.step()
        raise AssertionError("did not finish")


def test_fcfs_admission_order() -> None:
    """Requests are admitted in arrival order when seats free up one at a time."""
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=2, budget=64)
    for i in range(6):
        sim.add(f"r{i}", prompt_len=3 + (5 - i), outputs=2 + i % 3)
    sim.run()
    assert sim.admitted == [f"r{i}" for i in range(6)]
    assert sorted(sim.finished) == sorted(sim.admitted)
    assert all(r.num_output_tokens == sim.want[r.request_id] and r.is_finished for r in sim.reqs)


def test_fcfs_head_that_does_not_fit_blocks_later_requests() -> None:
    """A waiting request that lacks blocks is not overtaken by a smaller one behind it."""
    sim = Sim(num_blocks=4, block_size=4, max_num_seqs=4, budget=64)
    sim.add("a", prompt_len=8, outputs=3)  # 2 blocks
    sim.add("big", prompt_len=12, outputs=1)  # 3 blocks: does not fit next to "a"
    sim.add("small", prompt_len=2, outputs=1)  # would fit, but must wait its turn
    batch = sim.step()
    assert [r.request_id for r in batch.requests] == ["a"]
    assert [r.request_id for r in sim.sched.waiting] == ["big", "small"]
    sim.run()
    assert sim.admitted == ["a", "big", "small"]


def test_chunked_prefill_respects_budget() -> None:
    """A prompt longer than the token budget is prefilled in budget-sized chunks; it samples only at the end."""
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=4, budget=16)
    r = sim.add("long", prompt_len=50, outputs=2)
    chunks = []
    while r.num_output_tokens == 0:
        batch = sim.step()
        chunks.append(batch.num_new_tokens[0])
    assert chunks == [16, 16, 16, 2]
    assert sim.step().num_new_tokens == [1]  # then it decodes one token per step


def test_mixed_step_decode_and_prefill_chunk() -> None:
    """A running decode keeps getting its 1 token while a new long prompt takes the rest of the budget."""
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=4, budget=16)
    a = sim.add("a", prompt_len=3, outputs=20)
    sim.step()  # a prefilled, has its first token
    b = sim.add("b", prompt_len=40, outputs=3)
    plan = []
    while b.num_output_tokens == 0:
        batch = sim.step()
        assert batch.requests[0] is a and batch.num_new_tokens[0] == 1, "the decode was starved"
        assert batch.requests[1] is b
        plan.append(batch.num_new_tokens[1])
    assert plan == [15, 15, 10]
    batch = sim.step()
    assert batch.requests == [a, b] and batch.num_new_tokens == [1, 1]


def test_max_num_seqs_respected() -> None:
    """No more than max_num_seqs requests run at once, however many wait and however much budget is left."""
    sim = Sim(num_blocks=256, block_size=4, max_num_seqs=3, budget=512)
    for i in range(10):
        sim.add(f"r{i}", prompt_len=5, outputs=4)
    batch = sim.step()
    assert len(batch.requests) == 3 and len(sim.sched.waiting) == 7
    peak = 0
    while sim.sched.has_unfinished:
        sim.step()
        peak = max(peak, len(sim.sched.running))
    assert peak == 3


def test_preemption_of_most_recent_request_and_resume() -> None:
    """Out of blocks: the newest running request is preempted (freed, reset, counted, put at the front of
    the waiting queue, tokens kept), then resumes once blocks free up and finishes."""
    sim = Sim(num_blocks=4, block_size=4, max_num_seqs=2, budget=64)
    a = sim.add("a", prompt_len=4, outputs=10)
    b = sim.add("b", prompt_len=4, outputs=10)
    c = sim.add("c", prompt_len=2, outputs=1)  # no seat: waits behind a and b
    preempt_batch = None
    while preempt_batch is None:
        batch = sim.step()
        if batch.preempted:
            preempt_batch = batch
    assert preempt_batch.preempted == [b] and preempt_batch.requests == [a]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert b.metrics.num_preemptions == 1 and a.metrics.num_preemptions == 0
    assert list(sim.sched.waiting) == [b, c], "preempted request must go to the front"
    assert b.num_tokens == 9 and b.num_output_tokens == 5, "generated tokens are kept for recompute"
    assert a.status is RequestStatus.RUNNING and b not in sim.sched.running
    while b.status is not RequestStatus.RUNNING:
        sim.step()
    # The step that re-admitted b recomputed its whole history (prompt + 5 outputs) from position 0.
    assert b.num_computed_tokens == 9 and len(b.block_table) == 3 and a.is_finished
    sim.run()
    assert a.is_finished and b.is_finished and c.is_finished
    assert b.num_output_tokens == 10 and b.output_token_ids == [FAKE_TOKEN] * 10
    assert sim.finished.index("a") < sim.finished.index("b")
    assert sim.bm.num_free_blocks == 4


def test_preempting_step_admits_nobody() -> None:
    """The victim is not re-admitted in the step that preempted it, even if its first chunk would fit."""
    sim = Sim(num_blocks=4, block_size=2, max_num_seqs=2, budget=3)
    a, b = sim.add("a", prompt_len=3, outputs=4), sim.add("b", prompt_len=3, outputs=4)
    while not (batch := sim.step()).preempted:
        pass
    assert batch.preempted == [b] and batch.requests == [a] and list(sim.sched.waiting) == [b]
    sim.run()
    assert a.is_finished and b.is_finished and b.metrics.num_preemptions >= 1


def test_abort_waiting_and_running_requests() -> None:
    """finish() on a waiting request removes it from the queue; on a running one it frees its blocks."""
    sim = Sim(num_blocks=16, block_size=4, max_num_seqs=1, budget=8)
    a = sim.add("a", prompt_len=20, outputs=5)
    b = sim.add("b", prompt_len=3, outputs=5)
    sim.step()  # a is mid-prefill, b waits for a seat
    assert a.status is RequestStatus.RUNNING and a.block_table and b in sim.sched.waiting
    sim.sched.finish(b)
    assert b not in sim.sched.waiting and b.status is RequestStatus.FINISHED and b.block_table == []
    sim.sched.finish(a)
    assert a not in sim.sched.running and a.block_table == [] and a.is_finished
    assert not sim.sched.has_unfinished and sim.bm.num_free_blocks == 16
    sim.bm.check(sim.reqs)
    assert sim.sched.schedule().is_empty


def test_recompute_all_schedules_whole_sequences() -> None:
    """recompute_all: every step feeds each request its whole history, never a chunk."""
    sim = Sim(num_blocks=4, block_size=64, max_num_seqs=4, budget=128, recompute_all=True)
    a = sim.add("a", prompt_len=5, outputs=4)
    b = sim.add("b", prompt_len=9, outputs=3)
    seen = []
    while sim.sched.has_unfinished:
        lens = {r.request_id: r.num_tokens for r in sim.reqs}
        batch = sim.step()
        for r, n in zip(batch.requests, batch.num_new_tokens):
            assert n == lens[r.request_id], "recompute_all must feed the whole sequence"
        seen.append([(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens)])
    assert seen[0] == [("a", 5), ("b", 9)] and seen[1] == [("a", 6), ("b", 10)]
    assert a.num_output_tokens == 4 and b.num_output_tokens == 3


def test_recompute_all_makes_progress_with_prompt_over_budget() -> None:
    """An idle recompute_all scheduler still schedules a waiting prompt longer than the token budget
    (it cannot be chunked; the engine raises 'scheduler made no progress' otherwise)."""
    sim = Sim(num_blocks=2, block_size=64, max_num_seqs=2, budget=8, recompute_all=True)
    sim.add("long", prompt_len=12, outputs=1)
    assert not sim.sched.schedule().is_empty


def test_recompute_all_does_not_admit_beyond_budget() -> None:
    """recompute_all cannot chunk, so a waiting sequence longer than the budget left waits."""
    sim = Sim(num_blocks=4, block_size=64, max_num_seqs=4, budget=12, recompute_all=True)
    sim.add("a", prompt_len=8, outputs=2)
    b = sim.add("b", prompt_len=6, outputs=2)
    batch = sim.step()
    assert [r.request_id for r in batch.requests] == ["a"] and b.status is RequestStatus.WAITING


@pytest.mark.parametrize("seed", range(12))
def test_random_workload_invariants(seed: int) -> None:
    """Random arrivals under tight blocks/budget/seats: every step keeps all invariants (checked in Sim.step),
    running requests are never skipped, and everything eventually finishes with the right output count."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8])
    max_len = 40
    num_blocks = rng.randint(-(-max_len // bs), 3 * -(-max_len // bs))  # every request fits alone
    seats = rng.randint(1, 5)
    sim = Sim(num_blocks, bs, seats, budget=rng.randint(seats, 48))
    pending = [(f"r{i}", rng.randint(1, 25), rng.randint(1, 15)) for i in range(15)]
    for _ in range(3000):
        if pending and rng.random() < 0.3:
            sim.add(*pending.pop(0))
        if not sim.sched.has_unfinished:
            if not pending:
                break
            continue
        batch = sim.step()
        assert all(r in batch.requests for r in sim.sched.running), "a running request was skipped"
    assert not pending and not sim.sched.has_unfinished
    assert all(r.is_finished and r.num_output_tokens == sim.want[r.request_id] for r in sim.reqs)
    assert sim.bm.num_free_blocks == num_blocks
    assert sim.admitted == [r.request_id for r in sim.reqs], "FCFS"
