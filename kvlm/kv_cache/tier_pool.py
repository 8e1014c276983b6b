"""The pool's side of the KV tier: which blocks go down to disk, and how tier blocks come back up.

* Down: the block manager calls `on_evict(b)` just before it forgets a cached-free block it hands out
  again (its K/V are still intact: nothing writes into it before the next step); with write-through,
  `write_through(req)` offers a finishing request's registered prompt blocks. Either copies the block's
  bytes out of the pool on the engine thread (one `read_blocks`) and hands them to the tier's writer
  thread (`KVTier.offer`), skipping blocks the tier already has.
* Up: `prefetch(req)` (the engine calls it for the waiting requests about to be admitted) looks up, past
  the pool's prefix hit, the prompt's next block hashes in the tier, reads the leading run of valid files,
  writes them into fresh blocks and registers them as cached-free blocks, exactly as `load_prefix` loads
  a snapshot. The scheduler's admission then finds them as an ordinary prefix hit: those tokens are not
  prefilled, and the read's time is part of the request's time to first token.
* Format: the files hold the pool's own bytes, or int8 rows of a float pool's (`--kv-tier-dtype int8`,
  `tier_codec.py`); a block loaded from such a lossy tier is never stored again (`loaded`).

Only full-attention models (no sliding layer groups) and unbounded requests use the tier: a bounded
request's blocks past its first eviction are named by its policy, not by the prefix, and a sliding
group's blocks would need their window's blocks with them (the engine refuses a tier for such models;
a bounded request skips it). `make_pool_tier` checks all that and the byte bound for the engine, which
only wires the result in. Plain Python over the block manager, the paged cache and the tier.
"""

from __future__ import annotations

import json

from kvlm.config import EngineConfig
from kvlm.errors import ParameterError
from kvlm.kv_cache.block_manager import EVICTED, BlockManager
from kvlm.kv_cache.storage import PagedKVCache
from kvlm.kv_cache.tier import KVTier
from kvlm.kv_cache.tier_codec import make_codec
from kvlm.kv_cache.tier_ray import SCHEME, RayTier
from kvlm.request import Request
from kvlm.sampling_params import SamplingParams


class PoolTier:
    """Moves blocks between one engine's pool (`bm`, `cache`) and a `KVTier`."""

    def __init__(self, bm: BlockManager, cache: PagedKVCache, tier: KVTier, write_through: bool = False) -> None:
        self.bm, self.cache, self.tier, self.write_through_on = bm, cache, tier, write_through
        bm.on_evict = self.on_evict
        # A lossy tier (int8 files of a float pool): the blocks loaded from it, by block id -> chain hash,
        # are never stored again, so a file always holds one round trip of computed K/V (tier_codec.py),
        # not a round trip of a round trip. A block reused since (its hash changed) is stored as usual.
        self.lossy = tier.codec is not None and not tier.codec.lossless
        self.loaded: dict[int, bytes | None] = {}  # (bounded by the pool's blocks)

    # -- down -------------------------------------------------------------------------------------------
    def _offer(self, b: int) -> None:
        name, tokens = self.bm.block_hash[b], self.bm.block_tokens[b]
        if self.lossy and name is not None and self.loaded.get(b) == name:
            return  # came from the tier (and is still that block)
        if name is None or tokens is None or not self.tier.writable or self.tier.has(name):
            return
        k, v = self.cache.read_blocks([b])  # (layers, 1, block_size, kv_heads, row): a copy
        self.tier.offer(name, tokens, k, v)

    def on_evict(self, b: int) -> None:
        """`b`, a cached block, is about to be reused for other K/V: keep its bytes on disk."""
        self._offer(b)
        self.loaded.pop(b, None)

    def write_through(self, req: Request) -> None:
        """`req` is finishing: offer its registered prompt blocks (write-through; no-op when it is off)."""
        if not self.write_through_on or req.kv_policy is not None:
            return
        for i in range(min(req.num_cached_blocks, req.num_prompt_tokens // self.bm.block_size)):
            b = req.block_table[i]
            if b != EVICTED:
                self._offer(b)

    # -- up ---------------------------------------------------------------------------------------------
    def prefetch(self, req: Request) -> int:
        """Load the blocks of `req`'s prompt that follow its pool hit from the tier into the prefix cache;
        returns the tokens loaded (0: nothing more in the tier, no room, or a file failed to load)."""
        bm, bs = self.bm, self.bm.block_size
        if req.kv_policy is not None or not req.reads_prefix_cache:
            return 0
        limit = (req.num_tokens - 1) // bs  # the last token always runs (as `find_cached_prefix`)
        k = len(bm.find_cached_prefix(req))
        if k >= limit:
            return 0
        names = bm.block_hashes(req, limit)[k:limit]
        n = self.tier.lookup(names)
        holder = Request(f"kv-tier-{req.request_id}", list(req.token_ids[: (k + n) * bs]), (k + n) * bs,
                         SamplingParams())
        hit = bm.find_cached_prefix(holder, max_blocks=k)
        room = bm.num_free_blocks - sum(1 for b in hit if bm.ref_counts[b] == 0)
        n = min(n, room)
        if n <= 0:
            return 0
        toks = [tuple(req.token_ids[i * bs : (i + 1) * bs]) for i in range(k, k + n)]
        kk, vv = self.tier.load_run(names[:n], toks)
        m = kk.shape[1] if kk.ndim > 1 else 0
        if m == 0:
            return 0
        holder.token_ids = holder.token_ids[: (k + m) * bs]
        holder.num_prompt_tokens = (k + m) * bs
        bm.allocate(holder, (k + m) * bs, hit)  # may evict older cached blocks (down to the tier, then)
        self.cache.write_blocks(holder.block_table[k:], kk, vv, first_position=k * bs)
        holder.num_computed_tokens = (k + m) * bs
        bm.cache_full_blocks(holder)
        if self.lossy:
            self.loaded.update((b, bm.block_hash[b]) for b in holder.block_table[k:])
        bm.free(holder)  # cached-free, most recently used: the admission right after takes them
        return m * bs


def tier_refusal(cfg: EngineConfig, sliding_groups: bool) -> str | None:
    """Why `cfg` cannot use a KV tier (what --kv-tier-dir needs), or None: its blocks must each name one
    prefix's K/V alone, so a paged cache with prefix caching, no sliding-window layer groups, and no
    engine-wide bound (a bounded request's blocks are named by its policy)."""
    if not (cfg.enable_kv_cache and cfg.kv_cache_layout == "paged" and cfg.enable_prefix_caching):
        return "the paged KV cache with prefix caching"
    if sliding_groups:
        return "a model without sliding-window layers"
    if cfg.max_kv_tokens is not None:
        return "unbounded requests (no engine-wide --max-kv-tokens)"
    return None


def make_pool_tier(cfg: EngineConfig, bm: BlockManager, cache: object, sliding_groups: bool,
                   kv_bytes_per_token: int, header: dict[str, str], vocab_size: int) -> PoolTier:
    """The KV tier for `cfg.kv_tier_dir` over this pool: ParameterError where its blocks would not name one
    prefix's K/V alone (`tier_refusal`), where one block does not fit its bound, or where the directory
    cannot be made."""
    why = tier_refusal(cfg, sliding_groups)
    if why is not None:
        raise ParameterError("kv_tier_dir", f"--kv-tier-dir needs {why}")
    assert cfg.kv_tier_dir is not None and isinstance(cache, PagedKVCache)
    try:
        codec = make_codec(header["kv_dtype"], cfg.kv_tier_dtype, json.loads(header["kv_layout"])["head_dim"])
    except ValueError as e:
        raise ParameterError("kv_tier_dtype", str(e)) from None
    block = kv_bytes_per_token * cfg.block_size
    if cfg.kv_tier_bytes < 2 * block:
        raise ParameterError("kv_tier_bytes", f"--kv-tier-bytes {cfg.kv_tier_bytes} holds less than two KV blocks "
                                              f"({block} bytes each) of this model")
    try:
        if cfg.kv_tier_dir.startswith(SCHEME):  # a Ray actor shared by a cluster's replicas (tier_ray.py)
            tier: KVTier = RayTier(cfg.kv_tier_dir, cfg.kv_tier_bytes, header, vocab_size, block, codec)
        else:
            tier = KVTier(cfg.kv_tier_dir, cfg.kv_tier_bytes, header, vocab_size, block, codec)
    except OSError as e:
        raise ParameterError("kv_tier_dir", f"--kv-tier-dir {cfg.kv_tier_dir}: {e.strerror or e}") from None
    return PoolTier(bm, cache, tier, cfg.kv_tier_write_through)
