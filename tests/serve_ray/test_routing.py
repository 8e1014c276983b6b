"""`RoutingBook`: the replica choice of `kvlm serve --replicas`, without Ray."""

from __future__ import annotations

import pytest

from kvlm.kv_cache.block_manager import BlockManager, prefix_block_hashes
from kvlm.serve_ray.routing import RoutingBook, short_hashes


def hashes(*blocks: int) -> list[bytes]:
    """Distinct fake chains: block i of prompt p is `b"p.i"`."""
    return [f"{b}".encode().ljust(8, b".") for b in blocks]


def test_prompt_hashes_are_the_pools_own():
    """The router hashes a prompt exactly as the replica's block manager names its blocks."""
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    bm.set_extra_keys("model x")
    ids = list(range(11))
    want = []
    for i in range(2):
        want.append(bm.hash_block(want[-1] if want else bm.root_hash, ids[i * 4:(i + 1) * 4]))
    assert prefix_block_hashes(bm.root_hash, ids, 4) == want == bm.prompt_block_hashes(ids)
    assert len(short_hashes(want)[0]) == 8


def test_longest_cached_prefix_wins():
    book = RoutingBook("prefix", seed=0)
    book.set_replicas(["a", "b"])
    book.routed("a", hashes(1, 2), "no_prefix")
    book.routed("b", hashes(1, 2, 3, 4), "no_prefix")
    book.finished("a")
    book.finished("b")
    r = book.rank(["a", "b"], hashes(1, 2, 3, 4, 5))
    assert (r.order[0], r.decision, r.matched_blocks) == ("b", "prefix", 4)
    assert book.rank(["a", "b"], hashes(1, 2)).decision == "prefix"
    assert book.rank(["a", "b"], hashes(9)).decision == "no_prefix"


def test_a_chain_stops_at_the_first_missing_block():
    book = RoutingBook("prefix", seed=0)
    book.routed("a", hashes(1, 3), "")
    book.routed("b", hashes(1, 2), "")
    r = book.rank(["a", "b"], hashes(1, 2, 3))
    assert r.order[0] == "b" and r.matched_blocks == 2


def test_busy_best_replica_falls_back_to_load():
    book = RoutingBook("prefix", imbalance_threshold=2, seed=0)
    for _ in range(3):
        book.routed("a", hashes(1, 2), "")
    book.routed("b", [], "")
    assert book.rank(["a", "b"], hashes(1, 2)).decision == "prefix"  # 3 - 1 = 2: not more than the threshold
    book.routed("a", hashes(1, 2), "")
    r = book.rank(["a", "b"], hashes(1, 2))
    assert r.decision == "load_fallback" and r.order[0] == "b"  # the less loaded of the two


def test_view_is_bounded_by_the_replicas_pool_and_reports_replace_it():
    book = RoutingBook("prefix", report_period_s=1000.0)
    book.report("a", {"seq": 1, "pid": 7, "num_blocks": 3, "hashes": hashes(1, 2)})
    assert book.rank(["a", "b"], hashes(1, 2)).matched_blocks == 2
    book.routed("a", hashes(5, 6), "")  # the pool holds 3 blocks: the oldest, 1, is evicted
    assert book.rank(["a"], hashes(1)).decision == "no_prefix"
    # A newer report is the truth; what was sent since is added back on top of it.
    book.report("a", {"seq": 2, "pid": 7, "num_blocks": 3, "hashes": hashes(9)})
    assert book.rank(["a"], hashes(9)).matched_blocks == 1
    assert book.rank(["a"], hashes(5, 6)).matched_blocks == 2
    assert book.rank(["a"], hashes(2)).decision == "no_prefix"


def test_in_flight_counts_and_forgotten_replicas():
    book = RoutingBook("prefix")
    book.set_replicas(["a", "b"])
    book.routed("a", hashes(1), "prefix")
    assert book.load("a") == 1
    book.finished("a")
    book.finished("a")  # never negative
    assert book.load("a") == 0
    book.set_replicas(["b", "c"])
    snap = book.snapshot()
    assert set(snap["replicas"]) == {"b", "c"} and snap["decisions"] == {"prefix": 1}


def test_pow2_and_round_robin_ignore_prefixes():
    book = RoutingBook("round-robin")
    firsts = [book.rank(["a", "b", "c"], hashes(1)).order[0] for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    book = RoutingBook("pow2", seed=1)
    book.routed("a", hashes(1), "")
    book.routed("a", hashes(1), "")
    r = book.rank(["a", "b"], hashes(1))
    assert r.decision == "pow2" and r.order == ["b", "a"]  # two replicas: always the less loaded first
    with pytest.raises(ValueError, match="router must be one of"):
        RoutingBook("random")
