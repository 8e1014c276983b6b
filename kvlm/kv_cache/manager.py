"""KVCacheManager: a request's blocks in every layer group, and the bounded-cache policy acted on them.

The scheduler decides who runs and how many tokens; this module answers whether that fits and makes it so
(plain Python, no torch). It owns group 0's `BlockManager` and one per extra layer group (`groups`), each
acting its group's spec (`kv_cache/spec.py`: full attention, a sliding window, refined per request by its
bounded cache), so every allocation, eviction, release and prefix hit is made in all of them at once: the
blocks a spec no longer needs go back to the pool before a step (`spec.evict_upto`), a prefix hit is the
longest prefix every group's spec can serve, and, for a bounded request (`kv_policy.BoundedKV`), at the
first eviction the sink blocks are swapped for private copies whose keys the cache re-rotates whenever
the window moves (`StepKV`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlm.kv_cache.block_manager import EVICTED, BlockManager
from kvlm.kv_cache.layer_groups import GroupView
from kvlm.request import Request

GroupHits = list[tuple[int, list[int]]]  # per extra group: (EVICTED entries, cached blocks) of a prefix hit


@dataclass(slots=True)
class PrefixHit:
    """What a waiting request can take from the prefix cache at admission."""

    blocks: list[int] = field(default_factory=list)  # group 0's blocks (EVICTED where a bounded hit evicted)
    groups: GroupHits | None = None  # the extra groups' share of it (None: no extra groups)
    extra: int = 0  # blocks needed besides: private sink copies, when the hit is past the first eviction

    @property
    def moved(self) -> bool:
        """A bounded hit past the first eviction: the request's sinks move at admission."""
        return EVICTED in self.blocks


@dataclass(slots=True)
class StepKV:
    """What the runner does to the cache before a step: block copies (source, destination) and the
    requests whose sink keys it re-rotates to their `sink_shift`."""

    block_copies: list[tuple[int, int]] = field(default_factory=list)
    sink_moves: list[Request] = field(default_factory=list)


def count_evicted(req: Request) -> None:
    """Record in req.metrics how many tokens its bounded cache has dropped so far (never less than counted
    before: a preempted request's count stays)."""
    policy = req.kv_policy
    assert policy is not None
    kept = policy.kept_start(req.num_computed_tokens)
    req.metrics.num_evicted_tokens = max(req.metrics.num_evicted_tokens, kept - policy.num_sinks)


class KVCacheManager:
    def __init__(self, block_manager: BlockManager, groups: list[BlockManager] | None = None) -> None:
        self.bm = block_manager
        self.groups = groups or []  # layer groups 1..: their block managers, each with its spec
        # A step's rows of one request never span more than the smallest window (layer_groups.py).
        self.chunk_cap = min((bm.spec.window for bm in self.groups if bm.spec.window is not None), default=None)

    def add(self, req: Request) -> None:
        n = len(self.groups)
        req.group_tables, req.group_cached, req.group_evicted = [[] for _ in range(n)], [0] * n, [0] * n

    def _views(self, req: Request) -> list[tuple[BlockManager, GroupView]]:
        return [(bm, GroupView(req, g)) for g, bm in enumerate(self.groups, 1)]

    # -- a running request's next step ------------------------------------------------------------------
    def evict(self, req: Request) -> int:
        """Before `req`'s next rows: give back the blocks they (and all later ones) no longer see, by every
        group's spec (a bounded window in group 0, the sliding groups' windows). Returns the blocks it needs
        besides (private copies of its sinks, at its first eviction)."""
        extra, p = 0, req.num_computed_tokens
        first, before = req.sink_shift == 0, req.evicted_upto  # first: its sinks are not private copies yet
        self.bm.evict(req, p)
        if req.evicted_upto > before:  # (only a bounded cache evicts in group 0)
            count_evicted(req)
            extra = self.bm.spec_for(req).sink_blocks if first else 0
        for bm, view in self._views(req):
            bm.evict(view, p)
        return extra

    def can_fit(self, req: Request, num_tokens: int, extra: int = 0, hit: PrefixHit | None = None) -> bool:
        """Can every group hold `num_tokens` of `req` (with `extra` blocks besides; `hit`: the cached blocks
        it takes at admission)?"""
        if not self.bm.can_allocate(req, num_tokens, hit.blocks if hit else (), extra=extra):
            return False
        for i, (bm, view) in enumerate(self._views(req)):
            skip, cached = hit.groups[i] if hit and hit.groups else (0, [])
            if not bm.can_allocate(view, num_tokens, cached, skip=skip):
                return False
        return True

    def allocate(self, req: Request, num_tokens: int, step: StepKV, extra: int = 0,
                 hit: PrefixHit | None = None) -> None:
        """Give `req` blocks for its first `num_tokens` in every group (taking `hit`'s cached ones), then
        its private sink copies (`extra` of them) and its sinks' new shift into `step`."""
        self.bm.allocate(req, num_tokens, hit.blocks if hit else ())
        for i, (bm, view) in enumerate(self._views(req)):
            skip, cached = hit.groups[i] if hit and hit.groups else (0, [])
            bm.allocate(view, num_tokens, cached, skip=skip)
        policy = req.kv_policy
        if policy is None:
            return
        if hit is not None:
            if not hit.moved:
                return
            req.evicted_upto = policy.evict_upto(req.num_computed_tokens)
            count_evicted(req)
        for i in range(extra):
            step.block_copies.append(self.bm.make_private(req, i))
        shift = policy.ctx_shift(req.num_computed_tokens)
        if policy.sink_blocks and shift != req.sink_shift:
            req.sink_shift = shift
            step.sink_moves.append(req)

    # -- admission ------------------------------------------------------------------------------------
    def find_hit(self, req: Request) -> PrefixHit:
        """The longest cached prefix every group can serve (a bounded request past its first eviction:
        sinks + window, else the plain prefix)."""
        hit = self.bm.find_cached_prefix(req) if req.reads_prefix_cache else []
        plain = hit
        if hit:
            hit = self.bm.extend_hit(req, hit)  # a bounded request past its first eviction: sinks + window
        groups = None
        if self.groups:
            hit, groups = self._window_hit(req, hit)
            if not hit and plain:  # the groups could not serve the extended hit: the plain one, then
                hit, groups = self._window_hit(req, plain)
        out = PrefixHit(hit, groups)
        if out.moved:
            out.extra = self.bm.spec_for(req).sink_blocks
        return out

    def _window_hit(self, req: Request, hit: list[int]) -> tuple[list[int], GroupHits]:
        """The longest prefix of `hit` (group 0's cached blocks) that every extra group can serve: its
        blocks from its spec's `hit_start` on (what the first token computed after it reads)."""
        for k in range(len(hit), -1, -1):
            if k < len(hit) and EVICTED in hit[:k]:
                return [], [(0, []) for _ in self.groups]  # a bounded hit is whole or nothing
            parts = []
            for bm, view in self._views(req):
                first = bm.spec_for(view).hit_start(k)
                blocks = bm.find_window_blocks(view, k, first) if k else []
                if blocks is None:
                    break
                parts.append((first, blocks))
            else:
                return hit[:k], parts
        return [], [(0, []) for _ in self.groups]

    # -- after a step, at the end ---------------------------------------------------------------------
    def cache_full_blocks(self, req: Request) -> None:
        """Register `req`'s newly full blocks in every group's prefix cache."""
        self.bm.cache_full_blocks(req)
        for bm, view in self._views(req):
            bm.cache_full_blocks(view)

    def trim(self, req: Request, num_tokens: int) -> None:
        """Give back, in every group, `req`'s blocks past its first `num_tokens` tokens (speculative decoding:
        those held for drafts the target rejected; never registered, so never shared)."""
        self.bm.free_tail(req, self.bm.blocks_for(num_tokens))
        for bm, view in self._views(req):
            bm.free_tail(view, bm.blocks_for(num_tokens))

    def free(self, req: Request) -> None:
        self.bm.free(req)
        for bm, view in self._views(req):
            bm.free(view)

    # -- debugging ------------------------------------------------------------------------------------
    def assert_writable(self, req: Request, start: int, end: int) -> None:
        """Debug mode: nobody writes into a block another request reads."""
        if self.bm.readers is not None:
            self.bm.assert_writable(req, start, end)
        for bm, view in self._views(req):
            if bm.readers is not None:
                bm.assert_writable(view, start, end)

    def check(self, reqs: list[Request]) -> None:
        """The block managers' invariants over every request that may hold blocks."""
        self.bm.check(reqs)
        for g, bm in enumerate(self.groups, 1):
            bm.check([GroupView(r, g) for r in reqs])
