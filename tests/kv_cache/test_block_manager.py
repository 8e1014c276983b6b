"""Tests for kvlm.kv_cache.block_manager: block accounting invariants with plain Request objects (no torch)."""

from __future__ import annotations

import math
import random

import pytest

from kvlm.kv_cache.block_manager import BlockManager
from kvlm.request import Request
from kvlm.sampling_params import SamplingParams


def make_req(rid: str = "r0", n: int = 3) -> Request:
    return Request(rid, list(range(1, n + 1)), n, SamplingParams())


def assert_accounting(bm: BlockManager, reqs: list[Request]) -> None:
    """free + used == total, the block tables agree with ref counts, no block is held twice."""
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    held = [b for r in reqs for b in r.block_table]
    assert len(held) == len(set(held)), "a block is in two block tables"
    assert bm.num_used_blocks == len(held)
    assert not set(held) & set(bm.free_blocks)
    assert all(c >= 0 for c in bm.ref_counts)
    bm.check(reqs)


def test_fresh_manager_is_all_free() -> None:
    """A new pool has every block free, none used, and passes check()."""
    bm = BlockManager(8, 4)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0
    assert sorted(bm.free_blocks) == list(range(8))
    assert_accounting(bm, [])


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_blocks_for_is_ceil(block_size: int) -> None:
    """blocks_for(n) == ceil(n / block_size), including 0 tokens -> 0 blocks."""
    bm = BlockManager(4, block_size)
    for n in range(0, 50):
        assert bm.blocks_for(n) == math.ceil(n / block_size)


def test_allocate_grows_block_table_by_ceil() -> None:
    """Allocating for n tokens leaves exactly ceil(n / block_size) blocks; growing only adds the difference."""
    bm = BlockManager(10, 4)
    r = make_req()
    for n in [1, 3, 4, 5, 8, 9, 17, 17, 20]:
        before = list(r.block_table)
        assert bm.can_allocate(r, n)
        bm.allocate(r, n)
        assert len(r.block_table) == math.ceil(n / 4)
        assert r.block_table[: len(before)] == before, "existing blocks must stay in place"
        assert_accounting(bm, [r])
    # Allocating for fewer tokens than already covered is a no-op (it never shrinks).
    bm.allocate(r, 2)
    assert len(r.block_table) == 5
    assert bm.num_free_blocks == 5


def test_can_allocate_counts_blocks_already_held() -> None:
    """can_allocate only needs the *extra* blocks to be free."""
    bm = BlockManager(3, 4)
    a, b = make_req("a"), make_req("b")
    bm.allocate(a, 8)  # 2 blocks, 1 free left
    assert bm.can_allocate(a, 12)  # needs 1 more
    assert not bm.can_allocate(a, 13)  # needs 2 more
    assert bm.can_allocate(b, 4) and not bm.can_allocate(b, 5)
    assert bm.can_allocate(b, 0)


def test_allocate_beyond_capacity_raises_and_changes_nothing() -> None:
    """Asking for more blocks than are free raises RuntimeError and leaves the state untouched."""
    bm = BlockManager(4, 2)
    a, b = make_req("a"), make_req("b")
    bm.allocate(a, 5)  # 3 blocks
    table, free = list(a.block_table), list(bm.free_blocks)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(b, 3)  # needs 2, 1 free
    with pytest.raises(RuntimeError):
        bm.allocate(a, 9)  # needs 2 more
    assert a.block_table == table and b.block_table == [] and list(bm.free_blocks) == free
    assert_accounting(bm, [a, b])


def test_free_returns_every_block_and_is_idempotent() -> None:
    """free() empties the block table and returns all its blocks; a second free changes nothing."""
    bm = BlockManager(6, 2)
    a, b = make_req("a"), make_req("b")
    bm.allocate(a, 5)
    bm.allocate(b, 4)
    bm.free(a)  # a held 3 blocks, b holds 2
    assert a.block_table == [] and bm.num_free_blocks == 4
    assert_accounting(bm, [a, b])
    bm.free(a)  # double free of the same request: its table is empty, so nothing is released twice
    assert bm.num_free_blocks == 4 and all(c >= 0 for c in bm.ref_counts)
    assert_accounting(bm, [a, b])
    bm.free(b)
    assert bm.num_free_blocks == 6 and bm.ref_counts == [0] * 6
    assert_accounting(bm, [a, b])


def test_releasing_a_free_block_is_refused() -> None:
    """Releasing a block whose ref count is already 0 fails loudly instead of going negative silently."""
    bm = BlockManager(2, 2)
    r = make_req()
    bm.allocate(r, 2)
    stale = list(r.block_table)
    bm.free(r)
    r.block_table = stale  # a stale copy of a freed table must not be able to free again
    with pytest.raises(AssertionError, match="released twice"):
        bm.free(r)


def test_check_detects_corruption() -> None:
    """check() fails when a block table and the ref counts disagree (so the invariant tests can fail)."""
    bm = BlockManager(4, 2)
    a, b = make_req("a"), make_req("b")
    bm.allocate(a, 4)
    b.block_table.append(a.block_table[0])  # b claims a's block without the manager knowing
    with pytest.raises(AssertionError):
        bm.check([a, b])
    with pytest.raises(AssertionError):
        bm.check([])  # blocks are used but nobody is listed as holding them


def test_blocks_are_reused_after_free() -> None:
    """Freed blocks can be allocated again: the pool never leaks over many cycles."""
    bm = BlockManager(5, 3)
    for i in range(100):
        r = make_req(f"r{i}")
        bm.allocate(r, 15)
        assert sorted(r.block_table) == list(range(5))
        bm.free(r)
    assert bm.num_free_blocks == 5


@pytest.mark.parametrize("seed", range(8))
def test_random_walk_keeps_invariants(seed: int) -> None:
    """Seeded random allocate/free sequences keep every invariant after every operation."""
    rng = random.Random(seed)
    bm = BlockManager(rng.randint(4, 24), rng.choice([1, 2, 4, 16]))
    reqs = [make_req(f"r{i}") for i in range(6)]
    tokens = {r.request_id: 0 for r in reqs}  # tokens each request's table must cover
    for _ in range(400):
        r = rng.choice(reqs)
        op = rng.random()
        if op < 0.5:
            n = tokens[r.request_id] + rng.randint(0, 3 * bm.block_size)
            extra = bm.blocks_for(n) - len(r.block_table)
            if bm.can_allocate(r, n):
                assert extra <= bm.num_free_blocks
                bm.allocate(r, n)
                tokens[r.request_id] = n
            else:
                assert extra > bm.num_free_blocks
                with pytest.raises(RuntimeError):
                    bm.allocate(r, n)
        else:
            bm.free(r)
            tokens[r.request_id] = 0
        assert len(r.block_table) == bm.blocks_for(tokens[r.request_id])
        assert_accounting(bm, reqs)
    for r in reqs:
        bm.free(r)
    assert bm.num_free_blocks == bm.num_blocks and bm.ref_counts == [0] * bm.num_blocks
    assert_accounting(bm, reqs)
