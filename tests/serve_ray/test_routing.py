"""`RoutingBook`: the replica choice of `kvlm serve --replicas`, without Ray."""

from __future__ import annotations

import pytest

from kvlm.kv_cache.block_manager import BlockManager, prefix_block_hashes
from kvlm.serve_ray.routing import TIER_WEIGHT, RoutingBook, short_hashes


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


def tier_report(seq: int, tier_id: str | None, pool: list[bytes], tier: list[bytes],
                write_through: bool = True) -> dict:
    r = {"seq": seq, "pid": 7, "num_blocks": 100, "hashes": pool}
    if tier_id is not None:
        r |= {"tier_id": tier_id, "tier_write_through": write_through, "tier_hashes": tier}
    return r


def test_tier_hits_count_between_a_pool_hit_and_a_miss():
    """A block a replica would load from its KV tier scores `TIER_WEIGHT` (0 < w < 1): a pool hit beats a
    tier hit of as many blocks, a tier hit beats a miss, and the tier continues a pool hit's chain."""
    assert 0 < TIER_WEIGHT < 1
    book = RoutingBook("prefix", report_period_s=1000.0, seed=0)
    book.report("a", tier_report(1, "host:1:2", hashes(1, 2), hashes(1, 2, 3, 4)))
    book.report("b", tier_report(1, "host:1:3", [], hashes(1, 2, 3, 4, 5, 6, 7, 8)))
    book.report("c", tier_report(1, None, [], []))
    # a: 2 pool + 2 tier = 3.0; b: 8 tier = 4.0 -> b, whose pool holds none of it: a "tier" decision
    r = book.rank(["a", "b", "c"], hashes(1, 2, 3, 4, 5, 6, 7, 8))
    assert (r.order[0], r.decision, r.matched_blocks) == ("b", "tier", 8)
    # 4 blocks: a has 2 in its pool and 2 in its tier (3.0), b 4 in its tier (2.0): the pool hit wins
    r = book.rank(["a", "b", "c"], hashes(1, 2, 3, 4))
    assert (r.order[:2], r.decision, r.matched_blocks) == (["a", "b"], "prefix", 4)
    assert r.order[2] == "c"  # no pool, no tier: last
    # a tier chain starts only where the pool's ends, and stops at its first missing block
    r = book.rank(["b", "c"], hashes(1, 9, 3))
    assert (r.order[0], r.decision, r.matched_blocks) == ("b", "tier", 1)


def test_replicas_sharing_a_tier_share_what_is_sent_to_either():
    """Two replicas report one `tier_id`: a prompt sent to one (write-through) enters the shared tier view,
    so a replica that never saw it scores a tier hit, and a later listing replaces the view but keeps what
    was sent since."""
    book = RoutingBook("prefix", report_period_s=1000.0, seed=0)
    for rid in ("a", "b"):
        book.report(rid, tier_report(1, "host:1:2", [], []))
    book.routed("a", hashes(1, 2, 3), "no_prefix")
    book.routed("a", hashes(5), "no_prefix")
    book.routed("a", hashes(6), "no_prefix")  # a is busier now
    r = book.rank(["a", "b"], hashes(1, 2, 3))
    assert r.order[0] == "a" and r.decision == "prefix"  # a's pool (3.0) beats b's tier (1.5)
    r = book.rank(["b"], hashes(1, 2, 3))  # b never saw it: its tier did
    assert (r.decision, r.matched_blocks) == ("tier", 3)
    book.report("b", tier_report(2, "host:1:2", [], hashes(7)))  # a listing from before a's prompt was stored
    assert book.tiers["host:1:2"].blocks == set(hashes(1, 2, 3, 5, 6, 7))  # the listing, plus what was sent since
    # without write-through, a routed prompt reaches the tier only when the pool evicts it (a report says so)
    book = RoutingBook("prefix", report_period_s=1000.0, seed=0)
    book.report("a", tier_report(1, "host:1:2", [], [], write_through=False))
    book.routed("a", hashes(1), "no_prefix")
    assert book.tiers["host:1:2"].blocks == set()
