"""The KV cache: where each layer's keys and values of past tokens live between steps.

`KVCache` is the protocol the model talks to: `update_and_fetch(layer, k, v, meta)` stores the new
tokens' K/V at the slots the runner chose and returns every sequence's whole context as (B, kv_heads, L, D).
Three implementations:

* `PagedKVCache`: one pool per layer of fixed-size blocks (num_blocks, block_size, kv_heads, D); a
  sequence's K/V are read through its block table. Memory is allocated in blocks as sequences grow.
* `ContiguousKVCache`: one row of max_model_len slots per sequence, (max_seqs, kv_heads, max_len, D),
  so a lone sequence's context is a view with no gather. It is the paged cache's bookkeeping with
  block_size = max_model_len (one block per sequence), only the storage layout differs.
* `NoKVCache` (`recompute.py`): keeps nothing; valid only when every step recomputes each sequence from
  position 0 (the engine's `enable_kv_cache=False` mode, which shows what the cache saves).

The cache's element type may be narrower than the model's (float16 K/V under float32 activations), or
a quantized format (`kernels/kv_quant.py`: int8 / int4 codes with a float16 scale per 32 values, the
pools then uint8 (..., kv_heads, row_bytes)): `write` rounds or quantizes to it, `fetch` returns the
compute dtype (dequantized), `blocks` hands out the stored bytes for the kernel to read in place, and
NoKVCache rounds the same way, so every attention path (prefill, decode, recompute) sees the same K/V.
A quantized cache may hold its keys centered (`k_center`, a `KeyCenter`, `kv_cache/k_center.py`): every write
stores the codes of k - mu (k - k0 for a key at position 0), so `fetch` gives K - mu (adding k0 - mu to
the position-0 key of each sequence whose context starts there, which the cache records per block,
`PagedKVCache.k0_seqs`) and `blocks`
the codes, with the correction the kernel adds to that key's score (`PagedKV.correction`); centering changes no
attention output (q . mu is the same for every key of a query row) but is what the codes carry.
`read_keys` adds the centers back and `write_keys` subtracts them, so keys re-rotated for a bounded cache
are rotated uncentered.

A cache is built from its `KVCacheConfig` (`kv_cache/spec.py`): the format (`KVFormat`: element type and
key centers), the block size and shape, and each layer group's layers and blocks.

The cache knows tensors and slots; it does not know requests, blocks' owners or the model.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from kvlm.attention.metadata import AttentionMetadata
from kvlm.attention.paged import PagedKV
from kvlm.kernels.kv_quant import K0Correction, KeyCenter, KVQuantFormat, centered, dequantize, quantize, unrotated
from kvlm.kv_cache.spec import KVCacheConfig, KVFormat

if TYPE_CHECKING:
    from kvlm.kv_cache.manager import StepKV

# What a cache stores per K/V value: a torch float type, or a quantized format.
KVElement = torch.dtype | KVQuantFormat


class KVCache(Protocol):
    block_size: int
    num_blocks: int

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store k, v (T, kv_heads, D) at meta.slot_mapping."""
        ...

    def fetch(self, layer: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every sequence of `meta` as (B, kv_heads, L, D), padded to the longest."""
        ...

    def update_and_fetch(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """write() then fetch()."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage allocated (all layers)."""
        ...

    @property
    def bytes_per_token(self) -> float:
        """Bytes of K/V storage per token slot (all layers), counted from the tensors."""
        ...

    def blocks(self, layer: int, meta: AttentionMetadata) -> PagedKV:
        """After `write`: the layer's K and V as blocks, (num_blocks, block_size, kv_heads, D) each, the
        (B, max_blocks) int32 table of each of meta's sequences into them, and the score correction of a
        centered cache's position-0 keys, for attention that reads every row's context in place
        (`attention.paged.paged_attention`)."""
        ...

    def begin_step(self, meta: AttentionMetadata) -> None:
        """Before a step's forward (module path or fused): the cache updates what its policies keep per
        block from the rows about to be written (a centered cache: which blocks start at a position-0 key)."""
        ...


def kv_format(elem: KVElement, center: KeyCenter | None = None) -> KVFormat:
    """The `KVFormat` of storing K/V as `elem` (keys centered by `center`, if given)."""
    if isinstance(elem, KVQuantFormat):
        return KVFormat(elem.name, elem.bytes_per_value, elem, center)
    return KVFormat(str(elem).removeprefix("torch."), torch.finfo(elem).bits / 8, elem, center)


def encode_kv(x: torch.Tensor, elem: KVElement) -> torch.Tensor:
    """x (..., D) as the cache stores it: `elem`'s float type, or (..., row_bytes) uint8 codes."""
    return quantize(x, elem) if isinstance(elem, KVQuantFormat) else x.to(elem)


def decode_kv(x: torch.Tensor, elem: KVElement, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Stored values (`encode_kv`'s) back as `dtype` (..., head_dim)."""
    if isinstance(elem, KVQuantFormat):
        return unrotated(dequantize(x, elem, head_dim), elem).to(dtype)
    return x if x.dtype == dtype else x.to(dtype)


def add_k0_delta(kk: torch.Tensor, center: KeyCenter | None, layer: int, seqs: torch.Tensor | None) -> torch.Tensor:
    """Fetched keys kk (B, kv_heads, L, D), K - mu as a centered cache gives them back, with k0 - mu added to
    token 0 of each sequence whose context starts at its position-0 key (stored as codes of k - k0; seqs
    (B,) uint8 marks them, None: every sequence), so that every key reads as k - mu; in place (kk is a
    fresh dequantized copy)."""
    if center is None or center.delta is None or kk.shape[2] == 0:
        return kk
    d = center.delta[layer].to(device=kk.device, dtype=kk.dtype)  # (kv_heads, D)
    if seqs is None:
        kk[:, :, 0] += d
    else:
        sel = seqs.to(device=kk.device, dtype=torch.bool)
        kk[sel, :, 0] += d
    return kk


def stored_row(elem: KVElement, head_dim: int) -> tuple[int, torch.dtype]:
    """The last dimension and element type of a cache of `elem` holding rows of head_dim values."""
    if isinstance(elem, KVQuantFormat):
        return elem.row_bytes(head_dim), torch.uint8
    return head_dim, elem


def _zero_padding(kk: torch.Tensor, vv: torch.Tensor, seq_lens: tuple[int, ...]) -> None:
    """Zero the slots past each sequence's length in gathered (B, kvh, L, D) keys/values.

    The pools are never zero-filled, so those slots may hold anything, NaN included; the attention mask
    gives them weight 0, but 0 * NaN = NaN in the weighted sum over V (and in Q.K for K)."""
    L = kk.shape[2]
    if min(seq_lens) >= L:
        return  # nothing padded (one sequence, or all of one length)
    pad = torch.arange(L, device=kk.device) >= torch.tensor(seq_lens, device=kk.device)[:, None]  # (B, L)
    pad = pad[:, None, :, None]  # (B, 1, L, 1)
    kk.masked_fill_(pad, 0)
    vv.masked_fill_(pad, 0)


def resident_bytes(tensors: list[torch.Tensor]) -> int | None:
    """Bytes of these tensors' memory that is resident now: all of it on CUDA (device memory is committed
    when allocated), the pages in RAM on CPU (Linux `mincore(2)`), None where that cannot be asked."""
    if not tensors:
        return 0
    if tensors[0].device.type != "cpu":
        return sum(t.untyped_storage().nbytes() for t in tensors)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mincore, page = libc.mincore, os.sysconf("SC_PAGE_SIZE")
    except (OSError, AttributeError, ValueError):
        return None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    total = 0
    for t in tensors:
        size = t.untyped_storage().nbytes()
        if size == 0:
            continue
        start = t.untyped_storage().data_ptr() & ~(page - 1)  # mincore wants a page-aligned start
        length = t.untyped_storage().data_ptr() + size - start
        vec = (ctypes.c_ubyte * -(-length // page))()
        if mincore(start, length, vec) != 0:
            return None
        pages = bytes(vec)
        total += (len(pages) - pages.count(0)) * page  # bit 0 set: resident (the other bits are reserved)
    return total


def untouched(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor none of whose pages is resident yet, on CPU: a private anonymous mapping of
    its own, so its memory becomes resident page by page as it is written. torch.empty gives no such
    promise: glibc serves allocations under its mmap threshold (which grows, up to 32 MiB, as large blocks
    are freed) from heap memory the process may already have touched; a 32 MiB pool tensor was found 10 MiB
    resident before any write (tests/kv_cache/test_kv_pool_memory.py). Elsewhere: torch.empty."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0 or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.empty(shape, dtype=dtype, device=device)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(m, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps m alive


class _LayerStorage:
    """K and V tensors of one shape per layer, and update_and_fetch as write then fetch.

    The tensors are allocated, not filled (`untouched`): memory becomes resident page by page as tokens
    are written and the pool size is a limit, not an up-front cost. Slots are read only after being
    written, except the padding of a gathered batch, which `fetch` zeroes (`_zero_padding`)."""

    def __init__(self, num_layers: int, shape: tuple[int, ...], dtype: KVElement, device: torch.device,
                 compute_dtype: torch.dtype | None = None, first_dims: list[int] | None = None,
                 k_center: KeyCenter | None = None) -> None:
        *lead, self.head_dim = shape  # (..., kv_heads, D): stored as (..., kv_heads, stored_row)
        row, tensor_dtype = stored_row(dtype, self.head_dim)
        self.element, self.k_center = dtype, k_center  # k_center: the keys' centers, or None
        dims = first_dims or [lead[0]] * num_layers  # per layer, when layers' pools differ (layer groups)
        self.k = [untouched((n, *lead[1:], row), tensor_dtype, device) for n in dims]
        self.v = [untouched((n, *lead[1:], row), tensor_dtype, device) for n in dims]
        # what fetch() returns (the model's activations)
        self.compute_dtype = compute_dtype or (torch.float32 if isinstance(dtype, KVQuantFormat) else dtype)

    def _encode_k(self, layer: int, k: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return encode_kv(centered(k, self.k_center, layer, positions), self.element)

    def _as_compute(self, kk: torch.Tensor, vv: torch.Tensor, layer: int,
                    meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        kk = decode_kv(kk, self.element, self.head_dim, self.compute_dtype)
        kk = add_k0_delta(kk, self.k_center, layer, self.k0_seqs(layer, meta))
        return kk, decode_kv(vv, self.element, self.head_dim, self.compute_dtype)

    def k0_seqs(self, layer: int, meta: AttentionMetadata) -> torch.Tensor | None:
        """(B,) uint8: which of meta's sequences' contexts start at their position-0 key; None: all of them
        (a cache whose sequences are always read from position 0)."""
        return None

    def k0_correction(self, layer: int, meta: AttentionMetadata) -> K0Correction | None:
        """The layer's position-0 key correction for meta's sequences (None: an uncentered cache)."""
        return K0Correction.of(self.k_center, layer, self.k0_seqs(layer, meta))

    def decode_centers(self, meta: AttentionMetadata, none: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What the fused decode step (`csrc/decode.cpp`) takes of this cache's centers for a step: mu,
        k0, k0 - mu rotated, and which sequences start at their position-0 key ((layers, kv_heads, D)
        float32 each, then (B,) uint8), each `none` where it does not apply."""
        c = self.k_center
        if c is None:
            return none, none, none, none
        if c.k0 is None:
            return c.mu, none, none, none
        seqs = self.k0_seqs(0, meta)
        return c.mu, c.k0, c.delta_rot, seqs if seqs is not None else none

    def begin_step(self, meta: AttentionMetadata) -> None:
        pass

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @property
    def bytes_per_token(self) -> float:
        """K/V bytes one token slot takes, counted from the pool's tensors (codes and scales), all layers."""
        return sum(self.slot_bytes(i) for i in range(len(self.k)))

    def slot_bytes(self, layer: int) -> float:
        """K/V bytes of one token slot of one layer, from its tensors."""
        k, v = self.k[layer], self.v[layer]
        return (k[0].numel() * k.element_size() + v[0].numel() * v.element_size()) / self.block_size

    @property
    def resident_bytes(self) -> int | None:
        """How much of `nbytes` is in memory now (see `resident_bytes`); None where it cannot be told."""
        return resident_bytes(self.k + self.v)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        raise NotImplementedError

    def fetch(self, layer: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def update_and_fetch(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                         meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        self.write(layer, k, v, meta)
        return self.fetch(layer, meta)


class PagedKVCache(_LayerStorage):
    """Block pools per layer: k[layer] and v[layer] are (num_blocks, block_size, kv_heads, D), or (...,
    kv_heads, row_bytes) uint8 for a quantized format (each head row's groups, `kernels/kv_quant.py`).

    Layer groups (`layer_groups.py`: sliding-window layers keep only their window): layer l belongs to
    group layer_group[l]; group 0's pools have num_blocks blocks and read meta.tables[0] and
    meta.slots[0], group g's have group_blocks[g] blocks plus a zero-filled null block (id group_blocks[g],
    what an evicted entry reads) and read meta.tables[g] / meta.slots[g].

    Position-0 keys (a cache centered by a `KeyCenter` with k0): a block whose first slot holds a
    sequence's position-0 key stores it as codes of k - k0, and attention adds k0 - mu back to that key.
    Which blocks do is the cache's own record (`_k0_blocks`, per group: set by `begin_step` from the rows
    about to be written, carried by `copy_blocks`, `write_keys` and `write_blocks`); a sequence's context
    starts at its position-0 key exactly when its table's first block is such a block (a bounded cache
    without sinks reads from a later block once its window has moved on), so no step has to say it."""

    def __init__(self, config: KVCacheConfig, device: torch.device, compute_dtype: torch.dtype | None = None) -> None:
        self.config = config
        num_blocks, block_size, k_center = config.num_blocks, config.block_size, config.format.center
        self.layer_group = list(config.group_of)
        self.group_blocks = [g.num_blocks for g in config.groups]
        dims = [num_blocks if g == 0 else self.group_blocks[g] + 1 for g in self.layer_group]
        super().__init__(config.num_layers, (num_blocks, block_size, config.kv_heads, config.head_dim),
                         config.format.element, device, compute_dtype, first_dims=dims, k_center=k_center)
        for layer, g in enumerate(self.layer_group):
            if g:
                self.k[layer][-1].zero_()
                self.v[layer][-1].zero_()
        self.block_size, self.num_blocks = block_size, num_blocks
        self._k0_blocks = ([torch.zeros(n, dtype=torch.bool) for n in
                            [num_blocks] + [b + 1 for b in self.group_blocks[1:]]]
                           if config.format.has_k0 else None)
        self._k0_memo: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)  # (tables, their k0_seqs)
        # Gather buffers reused by every layer (a layer's attention is done before the next one reads):
        # allocating megabytes per layer per step costs page faults that dominate batched decode on CPU.
        self._kbuf = self.k[0].new_empty(0, *self.k[0].shape[1:])
        self._vbuf = torch.empty_like(self._kbuf)

    def _group(self, layer: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot mapping and block tables layer `layer` reads in this step (its group's)."""
        g = self.layer_group[layer]
        return meta.slots[g], meta.tables[g]

    def begin_step(self, meta: AttentionMetadata) -> None:
        """Record, per group, which blocks the step's rows start (a row written at a block's first slot):
        those at position 0 hold a k0-centered key, the others no longer do."""
        if self._k0_blocks is None:
            return
        self._k0_memo = (None, None)
        for flags, slots in zip(self._k0_blocks, meta.slots):
            first = (slots % self.block_size) == 0
            if bool(first.any()):
                flags[(slots[first] // self.block_size).cpu()] = (meta.positions[first] == 0).cpu()

    def k0_seqs(self, layer: int, meta: AttentionMetadata) -> torch.Tensor | None:
        if self._k0_blocks is None:
            return None
        tables = meta.tables[self.layer_group[layer]]
        if self._k0_memo[0] is not tables:  # once per step and group: every layer of a group reads the same
            first = self._k0_blocks[self.layer_group[layer]][tables[:, 0].long().cpu()]
            self._k0_memo = (tables, None if bool(first.all()) else first.to(torch.uint8).to(tables.device))
        return self._k0_memo[1]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        kc, vc = self.k[layer], self.v[layer]
        kvh, D = kc.shape[2], kc.shape[3]
        slots = self._group(layer, meta)[0]
        kc.view(-1, kvh, D).index_copy_(0, slots, self._encode_k(layer, k, meta.positions))
        vc.view(-1, kvh, D).index_copy_(0, slots, encode_kv(v, self.element))

    def fetch(self, layer: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        kc, vc = self.k[layer], self.v[layer]
        kvh, D = kc.shape[2], kc.shape[3]
        L = meta.max_seq_len
        nblk = -(-L // self.block_size)
        bt = self._group(layer, meta)[1][:, :nblk]  # (B, nblk)
        B = bt.shape[0]
        # Gather each sequence's blocks: (B, nblk, bs, kvh, D) -> (B, kvh, L, D). Padding beyond a
        # sequence's length is masked by the attention mask.
        flat = bt.reshape(-1)  # index_select copies whole blocks (memcpy); x[bt] takes a slower generic path
        if self._kbuf.shape[0] < flat.numel():
            self._kbuf = kc.new_empty(flat.numel(), *kc.shape[1:])
            self._vbuf = torch.empty_like(self._kbuf)
        kg = torch.index_select(kc, 0, flat, out=self._kbuf[: flat.numel()])
        vg = torch.index_select(vc, 0, flat, out=self._vbuf[: flat.numel()])
        kk = kg.view(B, nblk * self.block_size, kvh, D)[:, :L].transpose(1, 2)
        vv = vg.view(B, nblk * self.block_size, kvh, D)[:, :L].transpose(1, 2)
        _zero_padding(kk, vv, meta.seq_lens)
        return self._as_compute(kk, vv, layer, meta)

    # Whole-block access for KV snapshots (the only way other modules touch the pool tensors).
    def group_layers(self, g: int) -> list[int]:
        """The layers of layer group g (all of them for g = 0 without layer groups)."""
        return [i for i, x in enumerate(self.layer_group) if x == g]

    def read_blocks(self, block_ids: list[int], g: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the K and V of group g's `block_ids`, each (group g's layers, n, block_size, kv_heads, D)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k[0].device)
        layers = self.group_layers(g)
        return (torch.stack([self.k[i].index_select(0, idx) for i in layers]),
                torch.stack([self.v[i].index_select(0, idx) for i in layers]))

    def write_blocks(self, block_ids: list[int], k: torch.Tensor, v: torch.Tensor, g: int = 0,
                     first_position: int = 0) -> None:
        """Store k, v (group g's layers, n, block_size, kv_heads, D) into its `block_ids` (cast to the pool's
        dtype): consecutive blocks of one sequence, the first starting at `first_position`."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k[0].device)
        if self._k0_blocks is not None and block_ids:
            self._k0_blocks[g][idx.cpu()] = False
            self._k0_blocks[g][block_ids[0]] = first_position == 0
        for j, layer in enumerate(self.group_layers(g)):
            kc, vc = self.k[layer], self.v[layer]
            kc.index_copy_(0, idx, k[j].to(device=kc.device, dtype=kc.dtype))
            vc.index_copy_(0, idx, v[j].to(device=vc.device, dtype=vc.dtype))

    def blocks(self, layer: int, meta: AttentionMetadata) -> PagedKV:
        # pools (blocks, block_size, kv_heads, D)
        return PagedKV(self.k[layer], self.v[layer], self._group(layer, meta)[1], self.k0_correction(layer, meta))

    # Bounded caches (kv_policy.py): private copies of sink blocks, and their keys re-rotated in place.
    def apply_step(self, step: StepKV, shift_keys: Callable[[int, torch.Tensor, int], torch.Tensor]) -> None:
        """Before a step: copy blocks into their private copies, then give each moved request's sink keys
        their new shift, rotated from the keys first computed (`shift_keys(layer, keys, delta)`: the model's
        RoPE, `LlamaForCausalLM.shift_keys`). Sliding layer groups never see the sinks: group 0's layers only."""
        if step.block_copies:
            self.copy_blocks(step.block_copies)
        for req in step.sink_moves:
            assert req.kv_policy is not None
            blocks = req.block_table[: req.kv_policy.sink_blocks]
            if req.sink_keys is None:
                req.sink_keys = self.read_keys(blocks)  # (layers, num_sinks, kv_heads, D), as first computed
            for i, layer in enumerate(self.group0_layers):
                self.write_keys(layer, blocks, shift_keys(layer, req.sink_keys[i], req.sink_shift))

    @property
    def group0_layers(self) -> list[int]:
        """The layers whose pools group 0's block ids address (all of them without layer groups)."""
        return self.group_layers(0)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """K and V of group 0's block src copied into its block dst, each of its layers, for each (src, dst)."""
        src = torch.tensor([a for a, _ in pairs], dtype=torch.long, device=self.k[0].device)
        dst = torch.tensor([b for _, b in pairs], dtype=torch.long, device=self.k[0].device)
        for layer in self.group0_layers:
            kc, vc = self.k[layer], self.v[layer]
            kc.index_copy_(0, dst, kc.index_select(0, src))
            vc.index_copy_(0, dst, vc.index_select(0, src))
        if self._k0_blocks is not None:
            self._k0_blocks[0][dst.cpu()] = self._k0_blocks[0][src.cpu()]

    def read_keys(self, block_ids: list[int]) -> torch.Tensor:
        """The keys of group 0's `block_ids`, a sequence's first blocks (its sinks), as the model computes
        with them (uncentered: + mu, + k0 for its position-0 key), (len(group0_layers), n * block_size,
        kv_heads, D), in the order of `group0_layers`."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k[0].device)
        c = self.k_center
        def keys(i: int) -> torch.Tensor:  # (n * block_size, kv_heads, D)
            k = decode_kv(self.k[i].index_select(0, idx), self.element, self.head_dim,
                          torch.float32 if c is not None else self.compute_dtype).flatten(0, 1)
            if c is None:
                return k
            out = k + c.mu[i]
            if c.k0 is not None:
                out[0] = k[0] + c.k0[i]
            return out.to(self.compute_dtype)
        return torch.stack([keys(i) for i in self.group0_layers])

    def write_keys(self, layer: int, block_ids: list[int], k: torch.Tensor) -> None:
        """Store keys k (n * block_size, kv_heads, D) into `block_ids` of `layer`, a sequence's first blocks
        (its sinks: row 0 is its position-0 key), centered, rounded / quantized."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k[0].device)
        kc = self.k[layer]
        positions = torch.arange(k.shape[0], device=k.device)
        kc.index_copy_(0, idx, self._encode_k(layer, k, positions).view(len(block_ids), *kc.shape[1:]))
        if self._k0_blocks is not None:
            self._k0_blocks[0][block_ids[0]] = True


class ContiguousKVCache(_LayerStorage):
    """One max_len row per sequence: k[layer], v[layer] are (max_seqs, max_len, kv_heads, D).

    It is a paged cache whose block is a whole row (block_size = max_len): the same block manager, slot
    mapping and in-place attention drive it; only a lone sequence's fetch differs (a view, no gather).
    """

    def __init__(self, config: KVCacheConfig, device: torch.device, compute_dtype: torch.dtype | None = None) -> None:
        self.config = config
        max_seqs, max_len = config.num_blocks, config.block_size  # one block a sequence's whole row
        super().__init__(config.num_layers, (max_seqs, max_len, config.kv_heads, config.head_dim),
                         config.format.element, device, compute_dtype, k_center=config.format.center)
        self.block_size, self.num_blocks = max_len, max_seqs

    def blocks(self, layer: int, meta: AttentionMetadata) -> PagedKV:
        # (max_seqs, max_len, kv_heads, D): one block a row
        return PagedKV(self.k[layer], self.v[layer], meta.block_tables, self.k0_correction(layer, meta))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        row = meta.slot_mapping // self.block_size
        off = meta.slot_mapping % self.block_size
        self.k[layer][row, off] = self._encode_k(layer, k, meta.positions)  # (T, kvh, D) into (row, off)
        self.v[layer][row, off] = encode_kv(v, self.element)

    def fetch(self, layer: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        kc, vc = self.k[layer], self.v[layer]
        L = meta.max_seq_len
        if meta.num_seqs == 1:
            r = int(meta.block_tables[0, 0])  # the runner builds block tables on the host
            # views, no copy (same dtype): (1, L, kvh, D) -> (1, kvh, L, D)
            return self._as_compute(kc[r : r + 1, :L].transpose(1, 2), vc[r : r + 1, :L].transpose(1, 2), layer, meta)
        rows = meta.block_tables[:, 0].long()
        kk, vv = kc[rows, :L].transpose(1, 2), vc[rows, :L].transpose(1, 2)  # advanced indexing: copies we may zero
        _zero_padding(kk, vv, meta.seq_lens)
        return self._as_compute(kk, vv, layer, meta)
