"""The KV pool in bytes: how many blocks the cache gets, the cache object that holds them, and what its
K/V take (per token, and per request: `KVBytes`).

The engine asks `make_kv_cache` once at start. The budget comes from `EngineConfig.kv_cache_memory`
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
from kvlm.kernels.kv_quant import KeyCenter, KVQuantFormat
from kvlm.kv_cache.block_manager import BlockManager, held_blocks
from kvlm.kv_cache.layer_groups import GroupView, LayerGroups
from kvlm.kv_cache.recompute import NoKVCache
from kvlm.kv_cache.storage import ContiguousKVCache, KVCache, KVElement, PagedKVCache
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


def formula_bytes_per_token(mc: ModelConfig, elem: KVElement) -> int:
    """K/V bytes per token by the format's formula, 2 x layers x kv_heads x head_dim x bytes per value
    (a quantized format's codes and scales): what a pool is sized by before its tensors exist."""
    per_value = elem.bytes_per_value if isinstance(elem, KVQuantFormat) else torch.finfo(elem).bits / 8
    return int(mc.kv_bytes_per_token(per_value))


def make_kv_cache(cfg: EngineConfig, mc: ModelConfig, max_model_len: int, dtype: KVElement, device: torch.device,
                  compute_dtype: torch.dtype | None = None, k_center: KeyCenter | None = None
                  ) -> tuple[KVCache, BlockManager, list[tuple[BlockManager, int]]]:
    """The KV cache for `cfg.kv_cache_layout`, the block manager that hands out its slots, and, for a model
    with sliding-window layers on the paged layout, each extra layer group's (block manager, window)
    (`layer_groups.py`). `dtype` is the K/V element type (a float type or a quantized format),
    `compute_dtype` the model's (what attention reads back; default `dtype`). The pool is sized by the
    format's formula; its tensors then take that many bytes per slot (`cache.bytes_per_token`).
    `k_center` (a `KeyCenter`): keys are stored centered (`storage.py`, `kv_cache/k_center.py`).

    Layer groups: each sliding group gets room for `max_num_seqs` requests' windows (plus a chunk), and
    the full layers the rest of the budget; the default budget sizes the full layers as it sizes a pool."""
    layers, kv_bytes_per_token = mc.num_hidden_layers, formula_bytes_per_token(mc, dtype)
    if not cfg.enable_kv_cache:
        return NoKVCache(dtype, k_center), BlockManager(cfg.max_num_seqs, max_model_len), []
    if cfg.kv_cache_layout == "contiguous":
        cache = ContiguousKVCache(layers, cfg.max_num_seqs, max_model_len, mc.num_key_value_heads, mc.head_dim,
                                  dtype, device, compute_dtype, k_center=k_center)
        return cache, BlockManager(cfg.max_num_seqs, max_model_len), []
    bs, groups = cfg.block_size, LayerGroups.of(mc.layer_windows, layers)
    per_layer = kv_bytes_per_token / layers
    group_blocks = [0] + [cfg.max_num_seqs * groups.blocks_per_seq(g, bs) for g in range(1, groups.num_groups)]
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
    cache = PagedKVCache(layers, num_blocks, bs, mc.num_key_value_heads, mc.head_dim, dtype, device,
                         compute_dtype, layer_group=list(groups.group_of), group_blocks=group_blocks,
                         k_center=k_center)
    # Only the paged layout can share blocks between requests: prefix caching lives here.
    pc = cfg.enable_prefix_caching
    extra = [(BlockManager(n, bs, enable_prefix_caching=pc), groups.windows[g])
             for g, n in enumerate(group_blocks) if g]
    return cache, BlockManager(num_blocks, bs, enable_prefix_caching=pc), extra  # type: ignore[misc]


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

    def __init__(self, cache: KVCache, mc: ModelConfig, elem: KVElement, block_size: int) -> None:
        self.stores = not isinstance(cache, NoKVCache)
        self.per_token = round(cache.bytes_per_token) if self.stores else formula_bytes_per_token(mc, elem)
        self.block_size = block_size  # the block manager's (a contiguous cache's: its row)
        self.group_slot = [float(self.per_token)]  # one token slot of each layer group, all of its layers
        if isinstance(cache, PagedKVCache):
            self.group_slot = [0.0] * len(cache.group_blocks)
            for layer, g in enumerate(cache.layer_group):
                self.group_slot[g] += cache.slot_bytes(layer)

    def of_request(self, req: Request) -> tuple[int, int]:
        """(bytes of the blocks `req` holds, bytes of them filled), over every layer group: group 0 holds
        its kept tokens (all computed ones, or what its bounded cache attends), a sliding group all its
        blocks full but the last."""
        if not self.stores:
            return 0, 0
        computed, pol = req.num_computed_tokens, req.kv_policy
        kept = computed if pol is None else min(computed, pol.attended(computed - 1))
        bs, slot = self.block_size, self.group_slot
        held = len(held_blocks(req)) * bs * slot[0]
        used = kept * slot[0]
        for g, table in enumerate(req.group_tables, 1):
            blocks = len(held_blocks(GroupView(req, g)))
            held += blocks * bs * slot[g]
            used += (blocks * bs - (len(table) * bs - computed)) * slot[g]  # all full but the last
        return round(held), round(used)
