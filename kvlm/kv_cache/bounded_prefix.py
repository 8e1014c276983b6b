"""Prefix hits past a bounded request's first eviction (plain Python, no torch): the next turn of an endless
chat, or a preempted bounded request coming back, reuses the blocks its window kept.

Row p of a request under `BoundedKV` attends the sinks and tokens kept_start(p) .. p, a function of p and
the tokens alone, so two requests with the same policy and the same first k blocks of tokens computed the
same K/V for them. Blocks past the first eviction point are registered under their prefix hash keyed by
the policy (`BoundedKV.block_hash`); a hit of k such blocks needs only what row k * block_size attends:
the sink blocks (registered under their plain hash, computed before any eviction) and the blocks from
kept_start(k * block_size) on. The blocks in between were given back and are not needed.
"""

from __future__ import annotations

from kvlm.kv_cache.block_manager import EVICTED, BlockManager
from kvlm.request import Request


def extend_bounded_hit(bm: BlockManager, req: Request, hit: list[int]) -> list[int]:
    """`hit` (from `find_cached_prefix`, at most the blocks before the first eviction) extended as far as
    the cache holds `req`'s sinks and kept window: sink blocks, EVICTED entries, then the window's blocks.
    Unchanged when `req` is unbounded or nothing past the first eviction is cached."""
    pol, bs = req.kv_policy, bm.block_size
    if pol is None or not bm.enable_prefix_caching or len(hit) < pol.sink_blocks:
        return hit
    for k in range((req.num_tokens - 1) // bs, pol.max_tokens // bs, -1):  # the last token always runs
        first = pol.evict_upto(k * bs)
        found = bm.find_window_blocks(req, k, first)
        if found is not None:
            return hit[: pol.sink_blocks] + [EVICTED] * (first - pol.sink_blocks) + found
    return hit
