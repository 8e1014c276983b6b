"""KV snapshots: a prompt's cached K/V saved to a safetensors file and loaded back into the prefix cache.

File layout (safetensors, so loading never unpickles anything):
  tensors  k, v       (layers, blocks, block_size, kv_heads, head_dim) in the engine's KV cache dtype, or
                      (..., kv_heads, row_bytes) uint8 for int8 / int4 (the pool's bytes as stored); with
                      layer groups (sliding-window layers, `layer_groups.py`) the full layers' only, and
           k1, v1 ..  per sliding group g: its layers' blocks inside the window of the token after the
                      snapshot (what a prefix hit there needs), (layers of g, blocks, block_size, ...)
           token_ids  (blocks * block_size,) int64: the tokens whose K/V these are (full blocks only)
  metadata format "kvlm-prefix-snapshot/1"; model_fingerprint (sha256 over the model's files); dtype;
           kv_dtype; block_size; kv_layout ("paged", layers, kv_heads, head_dim); k_center ("none", or a
           digest of the mean key an int8 / int4 cache subtracts, `kv_cache/k_center.py`; absent: "none");
           num_tokens; crc32 of the tensors' bytes (a flipped byte in the data is caught, not served);
           lora: "none" (absent: "none"), or the LoRA adapter the K/V were computed under, as JSON
           {"name", "key"} (`LoRAAdapter.key`, a digest of its weights and scale: `lora_identity`).
           A KV tier's one-block files (`tier.py`) add tier_hash and tier_dtype (the tensors' format when
           it differs from kv_dtype's: int8 codes of a float pool, `tier_codec.py`).

The functions work on a block manager, a paged cache and the header this engine expects
(`snapshot_header`); they know nothing of the engine. `load_prefix` checks everything before it touches
the pool: a snapshot for another model, dtype, block size, layout or K center, one saved under a LoRA
adapter this engine has not loaded (same weights and scale, any name), or a corrupt or truncated file
raises `SnapshotError` (one line) and leaves the cache unchanged and serving. An adapter's blocks are
hashed from its own root (`block_manager.lora_root`), so they are a prefix hit for its requests only.
Loaded blocks enter the prefix cache as cached-free blocks, exactly as if a request had computed them, so
the next request
starting with those tokens reuses them (and the LRU may evict them like any other cached block).
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvlm.errors import SnapshotError
from kvlm.kernels.kv_quant import FORMATS
from kvlm.kv_cache.block_manager import BlockManager
from kvlm.kv_cache.layer_groups import GroupView
from kvlm.kv_cache.storage import KVCache, KVElement, PagedKVCache, stored_row
from kvlm.request import Request
from kvlm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvlm.lora.adapter import LoRAAdapter

FORMAT = "kvlm-prefix-snapshot/1"


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    path: str
    num_tokens: int  # tokens whose K/V the file holds (whole blocks)
    num_blocks: int
    blocks_loaded: int  # blocks written into the pool (the rest were already cached)


def checksum(*tensors: torch.Tensor) -> str:
    crc = 0
    for t in tensors:
        crc = zlib.crc32(t.contiguous().view(torch.uint8).numpy(), crc)
    return f"{crc:08x}"


Groups = list[BlockManager]  # layer groups 1..: their block managers (each with its spec, kv_cache/spec.py)


def snapshot_header(model_fingerprint: str, dtype: str, kv_dtype: KVElement, block_size: int, layers: int,
                    kv_heads: int, head_dim: int, layer_group: list[int] | None = None,
                    k_center: str = "none", lora: LoRAAdapter | None = None) -> dict[str, str]:
    """The metadata a snapshot for this engine carries, and that a snapshot must carry to load
    (`layer_group`: each layer's group, for a model with sliding-window layers; `k_center`: the digest of
    the K center the cache subtracts from its keys, `kv_cache/k_center.center_digest`, "none" if it stores them
    as computed; `lora`: the adapter the snapshot's K/V are computed under, None for the base)."""
    layout = {"layout": "paged", "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}
    if layer_group and any(layer_group):
        layout["layer_group"] = list(layer_group)
    return {"format": FORMAT, "model_fingerprint": model_fingerprint, "dtype": dtype,
            "kv_dtype": str(kv_dtype).removeprefix("torch."), "block_size": str(block_size),
            "kv_layout": json.dumps(layout), "k_center": k_center, "lora": lora_identity(lora)}


def lora_identity(lora: LoRAAdapter | None) -> str:
    """The `lora` metadata of a snapshot computed under `lora`: "none" for the base."""
    return "none" if lora is None else json.dumps({"name": lora.name, "key": lora.key})


def _lora_key(value: str | None) -> str | None:
    """The adapter key in a `lora` metadata value ("none" for the base; None if unreadable)."""
    if value == "none":
        return value
    try:
        ident = json.loads(value or "")
    except ValueError:
        return None
    return ident.get("key") if isinstance(ident, dict) else None


def snapshot_lora(path: str | os.PathLike) -> dict[str, str] | None:
    """The adapter a snapshot file says its K/V were computed under ({"name", "key"}), None for the base or
    a file without readable metadata (`read_snapshot` then says what is wrong with it)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            value = (f.metadata() or {}).get("lora", "none")
    except (SafetensorError, OSError, ValueError, RuntimeError):
        return None
    try:
        ident = json.loads(value) if value != "none" else None
    except ValueError:
        raise SnapshotError(f"{path}: corrupt snapshot (lora metadata is not JSON)") from None
    if ident is not None and not (isinstance(ident, dict) and isinstance(ident.get("name"), str)
                                  and isinstance(ident.get("key"), str)):
        raise SnapshotError(f"{path}: corrupt snapshot (lora metadata is not {{name, key}})")
    return ident


def _group_firsts(nblk: int, groups: Groups) -> list[int]:
    """Per extra group, its first block a prefix hit of `nblk` blocks needs (its spec's `hit_start`)."""
    return [gbm.spec.hit_start(nblk) for gbm in groups]


def _holder(name: str, tokens: list[int], groups: Groups, lora: LoRAAdapter | None = None) -> Request:
    req = Request(name, list(tokens), len(tokens), SamplingParams())
    req.lora = lora  # the hash chain's root: an adapter's blocks are its own
    n = len(groups)
    req.group_tables, req.group_cached, req.group_evicted = [[] for _ in range(n)], [0] * n, [0] * n
    return req


def _paged_cache(cache: KVCache, bm: BlockManager) -> PagedKVCache:
    if not isinstance(cache, PagedKVCache) or not bm.enable_prefix_caching:
        raise SnapshotError("KV snapshots need the paged KV cache with prefix caching on")
    return cache


def cached_prefix_blocks(bm: BlockManager, token_ids: list[int], lora: LoRAAdapter | None = None) -> list[int]:
    """The blocks of `token_ids`' full blocks (computed under `lora`) in the prefix cache now (a leading run)."""
    nblk = len(token_ids) // bm.block_size
    return bm.find_cached_prefix(_holder("snapshot", token_ids, (), lora), max_blocks=nblk)


def prefix_cached(bm: BlockManager, token_ids: list[int], groups: Groups = (), lora: LoRAAdapter | None = None) -> bool:
    """Whether the prefix cache holds everything a snapshot of `token_ids` under `lora` saves (every group's part)."""
    nblk = len(token_ids) // bm.block_size
    if len(cached_prefix_blocks(bm, token_ids, lora)) < nblk:
        return False
    probe = _holder("snapshot", token_ids, groups, lora)
    return all(gbm.find_window_blocks(GroupView(probe, g), nblk, first) is not None
               for g, (gbm, first) in enumerate(zip(groups, _group_firsts(nblk, groups)), 1))


def save_prefix(bm: BlockManager, cache: KVCache, header: dict[str, str], token_ids: list[int],
                path: str | os.PathLike, groups: Groups = (), lora: LoRAAdapter | None = None) -> SnapshotInfo:
    """Write the cached K/V of `token_ids`' full blocks, computed under `lora` (None: the base; `header`
    records it), to `path`. The caller computes them first (`Engine.save_prefix` runs the prompt when
    `cached_prefix_blocks` falls short)."""
    from safetensors.torch import save_file

    cache = _paged_cache(cache, bm)
    nblk = len(token_ids) // bm.block_size
    if nblk == 0:
        raise SnapshotError(f"the prompt has {len(token_ids)} tokens, fewer than one block ({bm.block_size}): "
                            "nothing to save")
    if header.get("lora", "none") != lora_identity(lora):
        raise SnapshotError("the snapshot header and the adapter to save under disagree")
    blocks = cached_prefix_blocks(bm, token_ids, lora)
    if len(blocks) < nblk:  # only if the pool is too small to keep the whole prompt cached
        raise SnapshotError(f"only {len(blocks)} of the prompt's {nblk} blocks stayed cached; use a larger KV pool")
    k, v = cache.read_blocks(blocks)  # read now: no step runs before the copy is made
    tensors = {"k": k.cpu().contiguous(), "v": v.cpu().contiguous()}
    probe = _holder("snapshot", token_ids, groups, lora)
    for g, (gbm, first) in enumerate(zip(groups, _group_firsts(nblk, groups)), 1):
        found = gbm.find_window_blocks(GroupView(probe, g), nblk, first)
        if found is None:
            raise SnapshotError(f"the sliding layers' window ({gbm.spec.window} tokens) of the prompt did not stay "
                                "cached; use a larger KV pool")
        kg, vg = cache.read_blocks(found, g)
        tensors[f"k{g}"], tensors[f"v{g}"] = kg.cpu().contiguous(), vg.cpu().contiguous()
    ids = torch.tensor(token_ids[: nblk * bm.block_size], dtype=torch.int64)
    meta = {**header, "num_tokens": str(ids.numel()), "crc32": checksum(*tensors.values(), ids)}
    tmp = Path(f"{path}.tmp")
    save_file({**tensors, "token_ids": ids}, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return SnapshotInfo(str(path), ids.numel(), nblk, 0)


def read_snapshot(path: str | os.PathLike, header: dict[str, str], vocab_size: int,
                  groups: Groups = ()) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Read a snapshot and check it against `header` (this engine's; `groups`: its extra layer groups'):
    (token ids, the K/V tensors by name: k, v, then k1, v1, ...). Raises SnapshotError."""
    tokens, kv, _ = read_snapshot_meta(path, header, vocab_size, groups)
    return tokens, kv


def _open_bytes(data: bytes) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """A safetensors file held in memory (the KV tier's Ray store): its metadata and tensors."""
    from safetensors.torch import load

    n = int.from_bytes(data[:8], "little")
    meta = json.loads(bytes(data[8 : 8 + n])).get("__metadata__") or {}
    return meta, load(bytes(data))


def read_snapshot_meta(path: str | os.PathLike, header: dict[str, str], vocab_size: int,
                       groups: Groups = (), data: bytes | None = None
                       ) -> tuple[list[int], dict[str, torch.Tensor], dict[str, str]]:
    """`read_snapshot`, with the file's metadata too (the KV tier's one-block files carry their hash there).
    `data`: the file's bytes, already in memory (then `path` only names it in errors)."""
    from safetensors import SafetensorError, safe_open

    kv_names = ["k", "v"] + [f"{x}{g}" for g in range(1, len(groups) + 1) for x in "kv"]

    def check_names(meta: dict[str, str], names: set[str]) -> None:
        if names != {*kv_names, "token_ids"} or meta.get("format") != FORMAT:
            raise SnapshotError(f"{path}: not a kvlm prefix snapshot" + (" for this model's layer groups"
                                                                          if meta.get("format") == FORMAT else ""))

    try:
        if data is not None:
            meta, tensors = _open_bytes(data)
            check_names(meta, set(tensors))
            kv, ids = {n: tensors[n] for n in kv_names}, tensors["token_ids"]
        else:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                check_names(meta, set(f.keys()))
                kv, ids = {n: f.get_tensor(n) for n in kv_names}, f.get_tensor("token_ids")
    except SnapshotError:
        raise
    except FileNotFoundError:
        raise SnapshotError(f"{path}: no such file") from None
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        if data is None and not os.path.exists(path):  # safetensors names a missing file its own way
            raise SnapshotError(f"{path}: no such file") from None
        raise SnapshotError(f"{path}: corrupt or truncated snapshot ({str(e).splitlines()[0]})") from None
    checks = [("model_fingerprint", "model"), ("dtype", "dtype"), ("kv_dtype", "KV cache dtype"),
              ("block_size", "block size"), ("kv_layout", "KV layout"), ("k_center", "K center"),
              ("lora", "LoRA adapter")] + [("tier_dtype", "KV tier dtype")] * ("tier_dtype" in header)
    for key, label in checks:
        # a snapshot without k_center (written before centering existed) holds uncentered keys; without
        # lora (written before adapters existed), the base's K/V; a tier file without tier_dtype (written
        # before `--kv-tier-dtype` existed), the pool's own format
        got = meta.get(key, {"k_center": "none", "lora": "none", "tier_dtype": meta.get("kv_dtype")}.get(key))
        if key == "lora" and _lora_key(got) == _lora_key(header[key]):
            continue  # an adapter is the same by its weights and scale, whatever name it is loaded under
        if got != header[key]:
            got, exp = got or "missing", header[key]
            if key == "model_fingerprint":
                got, exp = got[:12], exp[:12]
            raise SnapshotError(f"{path}: snapshot is for another {label} ({got}; this engine: {exp})")
    bs, lay = int(header["block_size"]), json.loads(header["kv_layout"])
    name = header.get("tier_dtype", header["kv_dtype"])  # what the tensors hold (a KV tier file: tier_codec.py)
    row, kv_dtype = stored_row(FORMATS[name] if name in FORMATS else getattr(torch, name), lay["head_dim"])
    nblk, group_of = ids.numel() // bs, lay.get("layer_group", [0] * lay["layers"])
    firsts = [0] + _group_firsts(nblk, groups)
    shapes = {n: (group_of.count(int(n[1:] or 0)), nblk - firsts[int(n[1:] or 0)], bs, lay["kv_heads"], row)
              for n in kv_names}
    if (ids.dtype != torch.int64 or ids.ndim != 1 or ids.numel() % bs or str(ids.numel()) != meta.get("num_tokens")
            or any(tuple(t.shape) != shapes[n] or t.dtype != kv_dtype for n, t in kv.items())):
        raise SnapshotError(f"{path}: corrupt snapshot (tensor shapes disagree with its header)")
    if checksum(*kv.values(), ids) != meta.get("crc32"):
        raise SnapshotError(f"{path}: corrupt snapshot (checksum mismatch)")
    tokens = ids.tolist()
    if any(not 0 <= t < vocab_size for t in tokens):
        raise SnapshotError(f"{path}: corrupt snapshot (token ids outside the vocabulary)")
    return tokens, kv, meta


def load_prefix(bm: BlockManager, cache: KVCache, header: dict[str, str], path: str | os.PathLike, *,
                vocab_size: int, max_model_len: int, groups: Groups = (),
                lora: LoRAAdapter | None = None) -> SnapshotInfo:
    """Put a snapshot's blocks into the prefix cache (every layer group's), hashed under `lora` (the adapter
    the file records, as the caller resolved it; `header` must record it too). All checks come first: on
    error nothing changed."""
    cache = _paged_cache(cache, bm)
    tokens, kv = read_snapshot(path, header, vocab_size, groups)
    bs = bm.block_size
    nblk = len(tokens) // bs
    if nblk > bm.num_blocks or len(tokens) >= max_model_len:
        raise SnapshotError(f"{path}: {len(tokens)} tokens do not fit this engine's KV pool or context")
    holder = _holder(f"snapshot-load-{os.fspath(path)}", tokens, groups, lora)
    hit = bm.find_cached_prefix(holder, max_blocks=nblk)
    firsts = _group_firsts(nblk, groups)
    views = [GroupView(holder, g) for g in range(1, len(groups) + 1)]
    if not bm.can_allocate(holder, nblk * bs, hit) or not all(
            gbm.can_allocate(view, nblk * bs, skip=first) for gbm, view, first in zip(groups, views, firsts)):
        raise SnapshotError(f"{path}: needs {nblk - len(hit)} free KV blocks, {bm.num_free_blocks} are free now")
    bm.allocate(holder, nblk * bs, hit)  # may evict least recently used cached blocks
    new = holder.block_table[len(hit):]
    if new:
        cache.write_blocks(new, kv["k"][:, len(hit):], kv["v"][:, len(hit):], first_position=len(hit) * bs)
    holder.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(holder)
    bm.free(holder)  # the blocks stay cached (ref 0, in the LRU) for the next request with this prefix
    for g, (gbm, view, first) in enumerate(zip(groups, views, firsts), 1):
        gbm.allocate(view, nblk * bs, skip=first)  # the window's blocks (an equal cached one wins below)
        cache.write_blocks(view.block_table[first:], kv[f"k{g}"], kv[f"v{g}"], g, first_position=first * bs)
        gbm.cache_full_blocks(view)
        gbm.free(view)
    return SnapshotInfo(str(path), len(tokens), nblk, len(new))
