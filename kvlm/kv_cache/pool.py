"""The KV pool in bytes: how many blocks the cache gets, the cache object that holds them, and what its
K/V take (per token, and per request: `KVBytes`).

The engine asks `make_kv_cache` once at start: it sizes the pool into the cache's `KVCacheConfig`
(`kv_cache_config`: the format, and per layer group its spec, layers and blocks, `kv_cache/spec.py`), the
one place where the model config and the engine args become specs, and builds the storage and the block
managers from it. The budget comes from `EngineConfig.kv_cache_memory`
(bytes, or a fraction of the memory free now) or, when unset, from the workload (`max_num_seqs`
sequences at full context) capped at a quarter of free memory and, on CPU, 1 GiB. A budget above
90% of available memory is refused. The pool is sized by the format's formula (`formula_bytes_per_token`);
once it exists, its bytes are counted from its tensors. This module knows nothing about admission; it
turns bytes into blocks and a request's blocks back into bytes.
"""

from __future__ import annotations

import torch

from kvlm.config import EngineConfig, ModelConfig
from kvlm.errors import ParameterError
from kvlm.kv_cache.block_manager import BlockManager, held_blocks
from kvlm.kv_cache.layer_groups import GroupView, LayerGroups
from kvlm.kv_cache.recompute import NoKVCache
from kvlm.kv_cache.spec import FullAttention, GroupSpec, KVCacheConfig, KVCacheGroup, KVFormat
from kvlm.kv_cache.storage import ContiguousKVCache, KVCache, KVElement, PagedKVCache, kv_format
from kvlm.request import Request

MAX_KV_SHARE = 0.9  # the largest share of available memory a KV pool may take


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on the device (CUDA) or available RAM (CPU, from /proc/meminfo)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def kv_pool_budget(cfg: EngineConfig, max_model_len: int, kv_bytes_per_token: int, device: torch.device) -> int:
    """Bytes the paged pool may take (see the module docstring)."""
    mem = cfg.kv_cache_memory
    if mem is None:
        # Enough for max_num_seqs sequences at full context, but at most a quarter of free memory
        # and, on CPU, 1 GiB. The pool is allocated untouched (kv_cache._LayerStorage): memory becomes
        # resident as tokens are written, and this budget is the limit.
        blocks_per_seq = -(-max_model_len // cfg.block_size)  # a full-length sequence's last block is whole too
        budget = min(cfg.max_num_seqs * blocks_per_seq * cfg.block_size * kv_bytes_per_token,
                     available_memory_bytes(device) // 4)
        if device.type == "cpu":
            budget = min(budget, 1 << 30)
        return budget
    avail = available_memory_bytes(device)
    budget = int(mem * avail) if isinstance(mem, float) else mem
    # A pool is resident memory the moment it is made: one that takes nearly all of what is available
    # would push the machine into swap or the OOM killer, so refuse it with the numbers.
    if budget > MAX_KV_SHARE * avail:
        raise ParameterError("kv_cache_memory",
                             f"kv_cache_memory: {budget / 2**30:.2f} GiB is more than {MAX_KV_SHARE:.0%} of the "
                             f"{avail / 2**30:.2f} GiB available on {device.type}; ask for less (e.g. 30%)")
    return budget


def formula_bytes_per_token(mc: ModelConfig, fmt: KVFormat | KVElement) -> int:
    """K/V bytes per token by the format's formula, 2 x layers x kv_heads x head_dim x bytes per value
    (a quantized format's codes and scales): what a pool is sized by before its tensors exist."""
    per_value = (fmt if isinstance(fmt, KVFormat) else kv_format(fmt)).bytes_per_value
    return int(mc.kv_bytes_per_token(per_value))


def kv_cache_config(cfg: EngineConfig, mc: ModelConfig, max_model_len: int, fmt: KVFormat,
                    device: torch.device) -> KVCacheConfig:
    """The paged cache's config: each layer group's spec (`LayerGroups.specs`: full, or sliding(W) for the
    layers the model declares so) and blocks. Each sliding group gets room for `max_num_seqs` requests'
    windows (plus a chunk: `blocks_per_seq`), and the full layers the rest of the budget; the default
    budget sizes the full layers as it sizes a pool."""
    layers, kv_bytes_per_token = mc.num_hidden_layers, formula_bytes_per_token(mc, fmt)
    bs, groups = cfg.block_size, LayerGroups.of(mc.layer_windows, layers)
    specs = groups.specs(bs)
    per_layer = kv_bytes_per_token / layers
    group_blocks = [0] + [cfg.max_num_seqs * _held(spec, groups.chunk_cap) for spec in specs[1:]]
    sliding = sum(n * bs * per_layer * len(groups.layers(g)) for g, n in enumerate(group_blocks))
    full_bpt = per_layer * len(groups.layers(0))
    per_block = full_bpt * bs
    if not per_block:  # every layer slides: group 0 keeps the bookkeeping (tables, prefix hashes), no tensors
        num_blocks, budget = cfg.max_num_seqs * -(-max_model_len // bs), 0
    else:
        budget = kv_pool_budget(cfg, max_model_len, int(full_bpt) if groups.sliding else kv_bytes_per_token, device)
        if cfg.kv_cache_memory is not None:
            budget -= int(sliding)
        num_blocks = int(budget // per_block)
    if num_blocks < 1:
        raise ParameterError("kv_cache_memory",
                             f"kv_cache_memory: {budget} B is smaller than one KV block ({per_block:.0f} B)"
                             + (f" after the sliding layers' {sliding:.0f} B" if sliding else ""))
    group_blocks[0] = num_blocks
    return KVCacheConfig(fmt, bs, mc.num_key_value_heads, mc.head_dim,
                         tuple(KVCacheGroup(spec, tuple(groups.layers(g)), n)
                               for g, (spec, n) in enumerate(zip(specs, group_blocks))))


def _held(spec: GroupSpec, chunk_cap: int | None) -> int:
    """Blocks one running request may hold at once in an extra group (a sliding one: bounded)."""
    n = spec.blocks_per_seq(chunk_cap)
    assert n is not None, "only group 0 grows with its requests"
    return n


def make_kv_cache(cfg: EngineConfig, mc: ModelConfig, max_model_len: int, fmt: KVFormat, device: torch.device,
                  compute_dtype: torch.dtype | None = None) -> tuple[KVCache, BlockManager, list[BlockManager]]:
    """The KV cache for `cfg.kv_cache_layout`, the block manager that hands out its slots, and, for a model
    with sliding-window layers on the paged layout, each extra layer group's block manager (with its spec,
    `layer_groups.py`). `fmt` is how K/V are stored (`KVFormat`: a float type or a quantized format, keys
    centered or not: `storage.py`, `kv_cache/k_center.py`), `compute_dtype` the model's (what attention
    reads back; default the format's float type). The pool is sized by the format's formula
    (`kv_cache_config`); its tensors then take that many bytes per slot (`cache.bytes_per_token`)."""
    if not cfg.enable_kv_cache:
        return NoKVCache(fmt.element, fmt.center), BlockManager(cfg.max_num_seqs, max_model_len), []
    if cfg.kv_cache_layout == "contiguous":
        # one block a sequence: its whole row
        cc = KVCacheConfig.full(fmt, mc.num_hidden_layers, cfg.max_num_seqs, max_model_len, mc.num_key_value_heads,
                                mc.head_dim)
        return ContiguousKVCache(cc, device, compute_dtype), BlockManager(cfg.max_num_seqs, max_model_len), []
    config = kv_cache_config(cfg, mc, max_model_len, fmt, device)
    cache = PagedKVCache(config, device, compute_dtype)
    # Only the paged layout can share blocks between requests: prefix caching lives here.
    pc, bs = cfg.enable_prefix_caching, config.block_size
    bms = [BlockManager(g.num_blocks, bs, enable_prefix_caching=pc, spec=g.spec) for g in config.groups]
    return cache, bms[0], bms[1:]


def describe_kv_pool(cfg: EngineConfig, cache: KVCache, bm: BlockManager, max_model_len: int,
                     kv_bytes_per_token: int) -> str:
    """One log line: blocks, tokens, the bytes reserved and resident now, and the concurrency the pool allows
    at full context. Reserved, not resident: the tensors are allocated untouched (`storage._LayerStorage`),
    so on CPU memory becomes resident as tokens are written; saying "1024 MiB" alone reads as RAM taken."""
    if not cfg.enable_kv_cache:
        return "kvlm: KV cache disabled: every step recomputes the whole sequence"
    tokens = bm.num_blocks * bm.block_size
    conc = tokens // max_model_len
    resident = getattr(cache, "resident_bytes", None)
    now = "unknown" if resident is None else f"{resident / 2**20:.1f} MiB"
    grows = "" if resident is not None and resident >= cache.nbytes else " (it grows as tokens are written)"
    return (f"kvlm: KV cache ({cfg.kv_cache_layout}): {bm.num_blocks} blocks x {bm.block_size} "
            f"tokens = {tokens} tokens ({kv_bytes_per_token} B/token), {cache.nbytes / 2**20:.1f} MiB reserved, "
            f"{now} resident now{grows}; max concurrency at full context ({max_model_len} tokens): {conc}")


class KVBytes:
    """What a KV cache's K/V take in bytes: per token slot and per layer group's slot, counted once from
    the pool's tensors (codes and scales), and what each request holds (`of_request`). Recompute mode
    (`NoKVCache`) stores nothing: its per-token figure is the format's formula, a request holds 0."""

    def __init__(self, cache: KVCache, mc: ModelConfig, fmt: KVFormat, block_size: int) -> None:
        self.stores = not isinstance(cache, NoKVCache)
        self.per_token = round(cache.bytes_per_token) if self.stores else formula_bytes_per_token(mc, fmt)
        self.block_size = block_size  # the block manager's (a contiguous cache's: its row)
        self.group_slot = [float(self.per_token)]  # one token slot of each layer group, all of its layers
        self.full: FullAttention = FullAttention(block_size)  # group 0's spec (its layers attend every token)
        if isinstance(cache, PagedKVCache):
            self.group_slot = [sum((cache.slot_bytes(layer) for layer in g.layers), 0.0) for g in cache.config.groups]
            assert isinstance(cache.config.groups[0].spec, FullAttention)
            self.full = cache.config.groups[0].spec

    def of_request(self, req: Request) -> tuple[int, int]:
        """(bytes of the blocks `req` holds, bytes of them filled), over every layer group: group 0 holds
        its kept tokens (what its spec for `req` attends: all computed ones, or what its bounded cache
        keeps), a sliding group all its blocks full but the last."""
        if not self.stores:
            return 0, 0
        computed = req.num_computed_tokens
        kept = min(computed, self.full.for_request(req.kv_policy).attended(computed - 1))
        bs, slot = self.block_size, self.group_slot
        held = len(held_blocks(req)) * bs * slot[0]
        used = kept * slot[0]
        for g, table in enumerate(req.group_tables, 1):
            blocks = len(held_blocks(GroupView(req, g)))
            held += blocks * bs * slot[g]
            used += (blocks * bs - (len(table) * bs - computed)) * slot[g]  # all full but the last
        return round(held), round(used)
