"""Tests for the prefix cache inside kvlm.kv_cache.block_manager (no torch): hash-chained full blocks, sharing with
ref counts, the cached-free LRU and eviction, collisions (forged hashes), debug mode and every invariant.

A fake pool records, for every slot a request writes, the whole token prefix up to that slot (what its
K/V depend on), so a test can prove that a cache hit hands out exactly the K/V the request would have
computed itself."""

from __future__ import annotations

import random

import pytest

from kvlm.kv_cache.block_manager import BlockManager
from kvlm.request import Request
from kvlm.sampling_params import SamplingParams


class FakePool:
    """A block manager with prefix caching, plus slot contents: slot -> token prefix it was computed for."""

    def __init__(self, num_blocks: int, block_size: int, debug: bool = True) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
        if debug:
            self.bm.enable_debug()
        self.slots: dict[int, tuple[int, ...]] = {}
        self.live: list[Request] = []

    def admit(self, rid: str, tokens: list[int]) -> Request:
        """Admission like the scheduler: take the cached prefix, allocate the rest, verify the hit."""
        req = Request(rid, list(tokens), len(tokens), SamplingParams())
        hit = self.bm.find_cached_prefix(req)
        assert self.bm.can_allocate(req, len(tokens), hit)
        self.bm.allocate(req, len(tokens), hit)
        req.num_computed_tokens = len(hit) * self.bm.block_size
        self.assert_kv_correct(req)
        self.live.append(req)
        return req

    def compute(self, req: Request, upto: int | None = None) -> None:
        """Play the runner: write the prefix of each computed position into its slot, then register."""
        bs, end = self.bm.block_size, req.num_tokens if upto is None else upto
        self.bm.assert_writable(req, req.num_computed_tokens, end)
        for p in range(req.num_computed_tokens, end):
            self.slots[req.block_table[p // bs] * bs + p % bs] = tuple(req.token_ids[: p + 1])
        req.num_computed_tokens = end
        self.bm.cache_full_blocks(req)
        self.assert_kv_correct(req)

    def free(self, req: Request) -> None:
        self.bm.free(req)
        self.live.remove(req)

    def assert_kv_correct(self, req: Request) -> None:
        bs = self.bm.block_size
        for p in range(req.num_computed_tokens):
            assert self.slots[req.block_table[p // bs] * bs + p % bs] == tuple(req.token_ids[: p + 1]), \
                f"{req.request_id} reads another prefix's K/V at position {p}"

    def check(self) -> None:
        self.bm.check(self.live)


def test_full_blocks_are_shared_and_refcounted() -> None:
    """A second request with the same beginning takes the first one's full blocks (ref 2), never its
    partial last block; releases bring every count back to zero and the blocks stay cached."""
    f = FakePool(16, 4)
    a = f.admit("a", list(range(1, 15)))  # 3 full blocks + 2 tokens
    f.compute(a)
    b = f.admit("b", list(range(1, 13)) + [99, 98, 97])
    assert b.num_computed_tokens == 12 and b.block_table[:3] == a.block_table[:3]
    assert [f.bm.ref_counts[x] for x in b.block_table[:3]] == [2, 2, 2]
    assert b.block_table[3] != a.block_table[3]  # a's partial block is never shared
    f.check()
    f.compute(b)
    f.free(a)
    assert all(f.bm.ref_counts[x] == 1 for x in b.block_table[:3])
    f.free(b)
    f.check()
    assert f.bm.ref_counts == [0] * 16 and f.bm.num_free_blocks == 16
    assert len(f.bm.cached_free) == 3  # the shared blocks (b's 4th block is partial: plain free)


def test_last_token_always_runs() -> None:
    """A prompt of exactly k cached blocks reuses k - 1 of them: its last token must produce logits."""
    f = FakePool(8, 4)
    a = f.admit("a", list(range(8)))
    f.compute(a)
    f.free(a)
    b = f.admit("b", list(range(8)))
    assert b.num_computed_tokens == 4
    c = f.admit("c", list(range(9)))
    assert c.num_computed_tokens == 8
    f.check()


def test_lru_evicts_least_recently_freed_tail_first_and_prefers_plain_free_blocks() -> None:
    """A freed block keeps its hash until the pool needs it; plain free blocks go first, then the least
    recently freed cached blocks, a prefix's tail before its head (freed in reverse)."""
    f = FakePool(6, 2)
    a = f.admit("a", [1, 2, 3, 4, 5, 6])  # 3 blocks
    f.compute(a)
    f.free(a)
    assert len(f.bm.cached_free) == 3 and len(f.bm.free_blocks) == 3
    b = f.admit("b", [9, 9, 9, 9, 9, 9])  # takes the 3 plain free blocks: nothing evicted
    assert f.bm.num_evictions == 0 and f.bm.num_cached_blocks == 3
    f.compute(b)
    f.free(b)
    c = f.admit("c", [7, 7])  # must evict: a's tail block [5, 6] was freed least recently
    assert f.bm.num_evictions == 1
    d = f.admit("d", [1, 2, 3, 4, 5, 6, 0])
    assert d.num_computed_tokens == 4, "a's first two blocks survive, its evicted tail does not"
    f.check()
    for r in (c, d):
        f.free(r)
    f.check()


def test_revived_cached_blocks_count_against_free_space() -> None:
    """Taking a cached-free block removes it from the free count: can_allocate sees that."""
    f = FakePool(4, 2)
    a = f.admit("a", [1, 2, 3, 4, 5])
    f.compute(a)
    f.free(a)  # 2 cached-free + 2 plain free
    probe = Request("p", [1, 2, 3, 4, 5, 6, 7, 8, 9], 9, SamplingParams())
    hit = f.bm.find_cached_prefix(probe)
    assert len(hit) == 2
    assert f.bm.can_allocate(probe, 8, hit) and not f.bm.can_allocate(probe, 9, hit)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        f.bm.allocate(probe, 9, hit)
    f.check()


def test_forged_hash_collision_never_returns_another_prefix() -> None:
    """With every hash forged equal, lookups compare stored token ids: a different block is refused,
    the colliding block in use is not replaced, and the manager's invariants hold."""
    f = FakePool(16, 2)
    f.bm.hash_block = lambda parent, tokens: b"forged"  # type: ignore[method-assign]
    a = f.admit("a", [1, 2, 3, 4, 5])
    f.compute(a)
    b = f.admit("b", [7, 8, 3, 4, 5])
    assert b.num_computed_tokens == 0, "a forged hash matched another prefix"
    f.compute(b)  # registration collides with a's block in use: b's stay uncached
    assert f.bm.num_cached_blocks == 1
    f.check()
    f.free(a)
    f.free(b)
    c = f.admit("c", [7, 8, 9])
    assert c.num_computed_tokens == 0
    f.check()


def test_forged_hash_ignoring_the_parent_is_caught_by_parent_identity() -> None:
    """A hash that forgets the parent (same last tokens after different prefixes) would hand out K/V
    computed after another prefix; the stored parent (block id + generation) refuses it."""
    f = FakePool(16, 2)
    f.bm.hash_block = lambda parent, tokens: bytes(tokens)  # type: ignore[method-assign]
    p = f.admit("p", [1, 1, 5, 5, 0])
    f.compute(p)
    f.free(p)
    q = f.admit("q", [2, 2, 5, 5, 0])  # block [5, 5] hashes like p's but follows [2, 2]
    assert q.num_computed_tokens == 0
    f.compute(q)  # p's stale [5, 5] block (ref 0) is evicted for q's own
    f.free(q)
    r = f.admit("r", [1, 1, 5, 5, 0])
    assert r.num_computed_tokens == 2, "only p's first block may be reused; [5, 5] now holds q's K/V"
    f.compute(r)
    f.check()


def test_duplicate_blocks_computed_in_the_same_step_are_merged() -> None:
    """Two requests admitted together compute the same prefix; registration swaps the second's copy for
    the cached block, so one hash names one block and the copy is freed."""
    f = FakePool(16, 4)
    a = f.admit("a", list(range(10)))
    b = f.admit("b", list(range(10)) + [42])
    f.compute(a)
    f.compute(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert f.bm.num_used_blocks == 3 + 1  # a's 3 blocks + b's own third
    f.check()


def test_refcount_never_negative_and_debug_catches_foreign_release() -> None:
    f = FakePool(4, 2)
    a = f.admit("a", [1, 2, 3])
    b = Request("b", [1], 1, SamplingParams())
    b.block_table = [a.block_table[0]]  # b claims a block it never took
    with pytest.raises(AssertionError, match="does not read it|freed while read"):
        f.bm.free(b)
    f2 = FakePool(4, 2, debug=False)
    c = f2.admit("c", [1, 2, 3])
    stale = list(c.block_table)
    f2.free(c)
    c.block_table = stale
    with pytest.raises(AssertionError, match="released twice"):
        f2.bm.free(c)


def test_debug_mode_refuses_writes_into_shared_blocks() -> None:
    f = FakePool(8, 2)
    a = f.admit("a", [1, 2, 3, 4, 5])
    f.compute(a)
    b = f.admit("b", [1, 2, 3, 4, 6])
    with pytest.raises(AssertionError, match="shared or cached block"):
        f.bm.assert_writable(b, 0, 5)  # recomputing position 0 would overwrite a block a reads
    f.bm.assert_writable(b, 4, 5)


def test_check_detects_each_broken_invariant() -> None:
    """check() fails on a stale hash entry, a cached-free block without a hash, a free block with a hash,
    a hash naming two blocks and a wrong ref count (so the invariant tests can fail)."""
    def fresh() -> FakePool:
        f = FakePool(8, 2, debug=False)
        a = f.admit("a", [1, 2, 3, 4, 5])
        f.compute(a)
        f.free(a)
        return f

    f = fresh()
    f.check()
    b0 = next(iter(f.bm.cached_free))
    f.bm.block_hash[b0] = None
    with pytest.raises(AssertionError):
        f.check()
    f = fresh()
    f.bm.hash_to_block[b"other"] = next(iter(f.bm.cached_free))  # one block under two hashes
    with pytest.raises(AssertionError):
        f.check()
    f = fresh()
    f.bm.block_hash[f.bm.free_blocks[0]] = b"x"
    with pytest.raises(AssertionError):
        f.check()
    f = fresh()
    f.bm.ref_counts[next(iter(f.bm.cached_free))] = 1
    with pytest.raises(AssertionError):
        f.check()


@pytest.mark.parametrize("seed", range(6))
def test_random_sharing_keeps_invariants_and_exact_kv(seed: int) -> None:
    """Seeded random admissions (from a few shared prefixes), partial computes and frees in a small pool:
    every invariant after every operation, every hit exactly the K/V the request would compute, and all
    ref counts back to zero at the end."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    f = FakePool(rng.randint(12, 40), bs)
    bases = [[rng.randrange(5) for _ in range(rng.randint(0, 12))] for _ in range(3)]
    n = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.4:
            tokens = rng.choice(bases) + [rng.randrange(5) for _ in range(rng.randint(1, 6))]
            probe = Request("probe", tokens, len(tokens), SamplingParams())
            hit = f.bm.find_cached_prefix(probe)
            if f.bm.can_allocate(probe, len(tokens), hit):
                f.admit(f"r{n}", tokens)
                n += 1
        elif op < 0.75 and f.live:
            r = rng.choice(f.live)
            if r.num_computed_tokens < r.num_tokens:
                f.compute(r, rng.randint(r.num_computed_tokens + 1, r.num_tokens))
        elif f.live:
            f.free(rng.choice(f.live))
        f.check()
    for r in list(f.live):
        f.free(r)
    f.check()
    assert f.bm.ref_counts == [0] * f.bm.num_blocks and f.bm.num_free_blocks == f.bm.num_blocks
