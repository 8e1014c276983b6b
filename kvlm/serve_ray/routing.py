"""`RoutingBook`: which prefix blocks each replica holds and how busy it is, and the routing choice itself.

Plain Python, no Ray: the Ray request router (`serve_ray.router`) asks the book for a ranking and tells it
where each request went; the client (`serve_ray.client`) tells it when a request ended; replicas' reports
(`EngineReplica.record_routing_stats`, polled by Serve) replace a replica's view with the truth.

A replica's view is an LRU of the 8-byte prefixes of kvlm's own block hashes (`kv_cache.block_manager`:
sha256 chained over the parent hash and the block's token ids, from the pool's root hash). Between two
reports the book adds what it sent there itself, bounded by the replica's pool size (what it cannot hold
it has evicted, oldest first, as the pool does), so the view decays the way the replica's cache does.

Replicas with a KV tier (`--kv-tier-dir`) also report the tier's files and which directory it is
(`tier_id`); replicas sharing one directory share one tier view here. With write-through (which sharing
turns on: `cli/serve.py`), what the book sends to any of them also enters their tier's view.

Policies (`--router`):
  prefix       the replica whose cache holds the most of the prompt's leading blocks, a block in its pool
               counting 1 and one it would load from its tier `TIER_WEIGHT` (a load is cheaper than a
               prefill, dearer than a pool hit: "tier" when the best replica's pool holds none), unless its in-flight
               count exceeds the least-loaded replica's by more than `imbalance_threshold`: then the
               power of two choices (a "load fallback"); no replica holds any block: power of two choices
  pow2         two replicas at random, the less loaded first
  round-robin  each replica in turn
Every ranking lists all replicas, best first, so Ray's router can go on to the next when one is full.
"""

from __future__ import annotations

import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

POLICIES = ("prefix", "pow2", "round-robin")
BOOKS: dict[str, RoutingBook] = {}  # book key -> the book of the `kvlm serve` process (see serve_ray.router)
HASH_BYTES = 8  # what a view keeps of each 32-byte block hash: enough to tell prefixes apart for routing
TIER_WEIGHT = 0.5  # a block the replica would load from its KV tier, against 1 for one in its pool


@dataclass(slots=True)
class ReplicaView:
    """What the book knows of one replica."""

    capacity: int = 1 << 30  # blocks its pool holds (from its report; unbounded until then)
    blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # LRU: most recently used last
    sent: deque[tuple[float, list[bytes]]] = field(default_factory=deque)  # sent since about the last report
    in_flight: int = 0
    reported_at: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)  # the replica's last report (load, counters)
    tier_id: str | None = None  # its KV tier's directory (replicas sharing one share a `TierView`)

    def touch(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def matched(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of the prompt the replica holds (a chain: the first miss ends it)."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n


@dataclass(slots=True)
class TierView:
    """What the book knows of one KV tier directory, shared by the replicas that report its `tier_id`."""

    blocks: set[bytes] = field(default_factory=set)
    write_through: bool = False  # prompts sent to its replicas enter it (when they finish)
    sent: deque[tuple[float, list[bytes]]] = field(default_factory=deque)
    listed_by: tuple[str, int] = ("", -1)  # (replica, seq) of the listing in `blocks`

    def continues(self, hashes: Sequence[bytes], start: int) -> int:
        """How many blocks after the first `start` of the prompt the tier holds (a chain)."""
        n = start
        while n < len(hashes) and hashes[n] in self.blocks:
            n += 1
        return n - start


@dataclass(slots=True)
class RouteHint:
    """What the router needs of a request (its prompt's block hashes); travels to the replica too, a few
    hundred bytes. The router writes the chosen replica's id into it."""

    hashes: list[bytes]
    replica_id: str | None = None
    decision: str = ""
    order: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Ranking:
    """Replica ids best first, each in its own rank; `decision` is what the book counts."""

    order: list[str]
    decision: str  # "prefix" | "tier" | "load_fallback" | "no_prefix" | "pow2" | "round_robin"
    matched_blocks: int = 0  # the best replica's pool and tier blocks of the prompt


class RoutingBook:
    """Thread-safe: Ray's router runs on its own event loop thread, the HTTP handlers on uvicorn's."""

    def __init__(self, policy: str = "prefix", imbalance_threshold: int = 4, report_period_s: float = 1.0,
                 seed: int | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"router must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy, self.imbalance_threshold, self.report_period_s = policy, imbalance_threshold, report_period_s
        self.views: dict[str, ReplicaView] = {}
        self.tiers: dict[str, TierView] = {}
        self.decisions: dict[str, int] = {}
        self.retries = 0
        self._rr = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    # -- what the router calls ----------------------------------------------------------------------
    def set_replicas(self, replica_ids: Iterable[str]) -> None:
        """The replicas Serve runs now: new ones get an empty view, gone ones are forgotten."""
        ids = set(replica_ids)
        with self._lock:
            for rid in ids - self.views.keys():
                self.views[rid] = ReplicaView()
            for rid in self.views.keys() - ids:
                del self.views[rid]

    def forget(self, replica_id: str) -> None:
        with self._lock:
            self.views.pop(replica_id, None)

    def rank(self, candidates: Sequence[str], hashes: Sequence[bytes]) -> Ranking:
        with self._lock:
            views = {c: self.views.setdefault(c, ReplicaView()) for c in candidates}
            return self._rank(list(candidates), views, hashes)

    def routed(self, replica_id: str, hashes: Sequence[bytes], decision: str = "") -> None:
        """A request with these prompt blocks went to `replica_id` (ranked by `decision`): it will hold
        them, and it is busier. Counted here, not in `rank`, which Ray may call again for one request."""
        with self._lock:
            if decision:
                self.decisions[decision] = self.decisions.get(decision, 0) + 1
            v = self.views.setdefault(replica_id, ReplicaView())
            v.in_flight += 1
            v.touch(hashes)
            now = time.monotonic()
            v.sent.append((now, list(hashes)))
            t = self.tiers.get(v.tier_id) if v.tier_id is not None else None
            if t is not None and t.write_through:
                t.blocks.update(hashes)
                t.sent.append((now, list(hashes)))

    def finished(self, replica_id: str) -> None:
        with self._lock:
            v = self.views.get(replica_id)
            if v is not None and v.in_flight > 0:
                v.in_flight -= 1

    def report(self, replica_id: str, stats: dict[str, Any]) -> None:
        """A replica's own report (`EngineReplica.record_routing_stats`): its cached block hashes (the truth
        at the time it was made) replace the view, plus what was sent there since about then."""
        if not stats or "seq" not in stats:
            return
        with self._lock:
            v = self.views.setdefault(replica_id, ReplicaView())
            if stats["seq"] == v.stats.get("seq") and stats.get("pid") == v.stats.get("pid"):
                return  # already merged
            now = time.monotonic()
            v.stats, v.reported_at = stats, now
            v.capacity = max(1, int(stats.get("num_blocks", v.capacity)))
            v.blocks = OrderedDict.fromkeys(stats.get("hashes", ()))
            cutoff = now - 2 * self.report_period_s  # reports travel through Serve's controller: allow slack
            while v.sent and v.sent[0][0] < cutoff:
                v.sent.popleft()
            for _, hs in v.sent:
                v.touch(hs)
            if stats.get("tier_id") is not None:
                self._report_tier(replica_id, v, stats, cutoff)

    def _report_tier(self, replica_id: str, v: ReplicaView, stats: dict[str, Any], cutoff: float) -> None:
        v.tier_id = tid = str(stats["tier_id"])
        t = self.tiers.setdefault(tid, TierView())
        t.write_through = bool(stats.get("tier_write_through"))
        t.listed_by = (replica_id, int(stats["seq"]))
        t.blocks = set(stats.get("tier_hashes", ()))
        while t.sent and t.sent[0][0] < cutoff:
            t.sent.popleft()
        for _, hs in t.sent:
            t.blocks.update(hs)

    def load(self, replica_id: str) -> int:
        with self._lock:
            v = self.views.get(replica_id)
            return 0 if v is None else v.in_flight

    def count_retry(self) -> None:
        with self._lock:
            self.retries += 1

    def snapshot(self) -> dict[str, Any]:
        """Counters and per-replica stats, for /metrics and /health."""
        with self._lock:
            return {"decisions": dict(self.decisions), "retries": self.retries,
                    "replicas": {rid: {"in_flight": v.in_flight, "cached_blocks": len(v.blocks), **v.stats}
                                 for rid, v in self.views.items()}}

    # -- the choice ---------------------------------------------------------------------------------
    def _pow2(self, ids: list[str], views: dict[str, ReplicaView]) -> list[str]:
        pair = self._rng.sample(ids, min(2, len(ids)))
        pair.sort(key=lambda c: views[c].in_flight)
        return pair + [c for c in ids if c not in pair]

    def _rank(self, ids: list[str], views: dict[str, ReplicaView], hashes: Sequence[bytes]) -> Ranking:
        if not ids:
            return Ranking([], "none")
        if self.policy == "round-robin":
            k = self._rr % len(ids)
            self._rr += 1
            return Ranking(ids[k:] + ids[:k], "round_robin")
        if self.policy == "pow2":
            return Ranking(self._pow2(ids, views), "pow2")
        pool = {c: views[c].matched(hashes) for c in ids}
        tier = {c: self._tier_blocks(views[c], hashes, pool[c]) for c in ids}
        score = {c: pool[c] + TIER_WEIGHT * tier[c] for c in ids}
        least = min(views[c].in_flight for c in ids)
        # Best score first; among equal scores the least loaded, then a random order (no replica is
        # favoured by its place in Serve's list).
        self._rng.shuffle(ids)
        order = sorted(ids, key=lambda c: (-score[c], views[c].in_flight))
        best = order[0]
        matched = pool[best] + tier[best]
        if matched == 0:
            return Ranking(self._pow2(ids, views), "no_prefix")
        if views[best].in_flight - least > self.imbalance_threshold:
            return Ranking(self._pow2(ids, views), "load_fallback", matched)
        return Ranking(order, "prefix" if pool[best] else "tier", matched)

    def _tier_blocks(self, v: ReplicaView, hashes: Sequence[bytes], start: int) -> int:
        t = self.tiers.get(v.tier_id) if v.tier_id is not None else None
        return 0 if t is None else t.continues(hashes, start)


def short_hashes(hashes: Iterable[bytes]) -> list[bytes]:
    """Block hashes as the book keeps them."""
    return [h[:HASH_BYTES] for h in hashes]
