"""KV snapshots: a prompt's cached K/V saved to a safetensors file and loaded back into the prefix cache.

File layout (safetensors, so loading never unpickles anything):
  tensors  k, v       (layers, blocks, block_size, kv_heads, head_dim) in the engine's KV cache dtype
           token_ids  (blocks * block_size,) int64: the tokens whose K/V these are (full blocks only)
  metadata format "kvlm-prefix-snapshot/1"; model_fingerprint (sha256 over the model's files); dtype; kv_dtype;
           block_size; kv_layout ("paged", layers, kv_heads, head_dim); num_tokens; crc32 of the
           tensors' bytes (a flipped byte in the data is caught, not served).

`load_prefix` checks everything before it touches the engine: a snapshot for another model, dtype,
block size or layout, or a corrupt or truncated file raises `SnapshotError` (one line) and leaves the
engine unchanged and serving. Loaded blocks enter the prefix cache as cached-free blocks, exactly as if
a request had computed them, so the next request starting with those tokens reuses them (and the LRU
may evict them like any other cached block).
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvlm.errors import SnapshotError
from kvlm.kv_cache import PagedKVCache
from kvlm.request import Request
from kvlm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvlm.engine import Engine

FORMAT = "kvlm-prefix-snapshot/1"


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    path: str
    num_tokens: int  # tokens whose K/V the file holds (whole blocks)
    num_blocks: int
    blocks_loaded: int  # blocks written into the pool (the rest were already cached)


def model_files(path: Path) -> list[Path]:
    """The files that define a model's weights and shapes: the GGUF file, or a folder's config and weights."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.name == "config.json" or p.suffix in (".safetensors", ".gguf"))


def model_fingerprint(path: Path) -> str:
    """sha256 over the model's files (names, sizes, contents). Computed once per file version and cached
    in $KVLM_HOME/fingerprints, keyed by path, size and modification time."""
    from kvlm.loader.registry import kvlm_home

    files = model_files(path)
    ident = json.dumps([[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files])
    cache = kvlm_home() / "fingerprints" / (hashlib.sha256(ident.encode()).hexdigest()[:32] + ".txt")
    try:
        return cache.read_text().strip()
    except OSError:
        pass
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    digest = h.hexdigest()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(digest + "\n")
    except OSError:  # a read-only home only costs recomputing next time
        pass
    return digest


def _checksum(*tensors: torch.Tensor) -> str:
    crc = 0
    for t in tensors:
        crc = zlib.crc32(t.contiguous().view(torch.uint8).numpy(), crc)
    return f"{crc:08x}"


def _expected_header(engine: Engine) -> dict[str, str]:
    mc = engine.model_config
    return {"format": FORMAT, "model_fingerprint": engine.model_fingerprint, "dtype": engine.config.dtype,
            "kv_dtype": str(engine.kv_dtype).removeprefix("torch."), "block_size": str(engine.block_manager.block_size),
            "kv_layout": json.dumps({"layout": "paged", "layers": mc.num_hidden_layers,
                                     "kv_heads": mc.num_key_value_heads, "head_dim": mc.head_dim})}


def _paged_cache(engine: Engine) -> PagedKVCache:
    if not isinstance(engine.kv_cache, PagedKVCache) or not engine.block_manager.enable_prefix_caching:
        raise SnapshotError("KV snapshots need the paged KV cache with prefix caching on")
    return engine.kv_cache


def save_prefix(engine: Engine, token_ids: list[int], path: str | os.PathLike) -> SnapshotInfo:
    """Compute (or find cached) the K/V of `token_ids`' full blocks and write them to `path`."""
    from safetensors.torch import save_file

    cache, bm = _paged_cache(engine), engine.block_manager
    nblk = len(token_ids) // bm.block_size
    if nblk == 0:
        raise SnapshotError(f"the prompt has {len(token_ids)} tokens, fewer than one block ({bm.block_size}): nothing to save")
    probe = Request("snapshot", list(token_ids), len(token_ids), SamplingParams())
    if len(bm.find_cached_prefix(probe, max_blocks=nblk)) < nblk:
        req = engine.add_request(list(token_ids), SamplingParams(temperature=0, max_tokens=1))
        while not req.is_finished:
            engine.step()
    blocks = bm.find_cached_prefix(probe, max_blocks=nblk)
    if len(blocks) < nblk:  # only if the pool is too small to keep the whole prompt cached
        raise SnapshotError(f"only {len(blocks)} of the prompt's {nblk} blocks stayed cached; use a larger KV pool")
    k, v = cache.read_blocks(blocks)  # read now: no step runs before the copy is made
    k, v = k.cpu().contiguous(), v.cpu().contiguous()
    ids = torch.tensor(token_ids[: nblk * bm.block_size], dtype=torch.int64)
    meta = {**_expected_header(engine), "num_tokens": str(ids.numel()), "crc32": _checksum(k, v, ids)}
    tmp = Path(f"{path}.tmp")
    save_file({"k": k, "v": v, "token_ids": ids}, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return SnapshotInfo(str(path), ids.numel(), nblk, 0)


def read_snapshot(engine: Engine, path: str | os.PathLike) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Read and validate a snapshot for `engine`: (token ids, k, v). Raises SnapshotError."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            if names != {"k", "v", "token_ids"} or meta.get("format") != FORMAT:
                raise SnapshotError(f"{path}: not a kvlm prefix snapshot")
            k, v, ids = f.get_tensor("k"), f.get_tensor("v"), f.get_tensor("token_ids")
    except SnapshotError:
        raise
    except FileNotFoundError:
        raise SnapshotError(f"{path}: no such file") from None
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise SnapshotError(f"{path}: corrupt or truncated snapshot ({str(e).splitlines()[0]})") from None
    want = _expected_header(engine)
    for key, label in (("model_fingerprint", "model"), ("dtype", "dtype"), ("kv_dtype", "KV cache dtype"),
                       ("block_size", "block size"),
                       ("kv_layout", "KV layout")):
        if meta.get(key) != want[key]:
            got, exp = meta.get(key, "missing"), want[key]
            if key == "model_fingerprint":
                got, exp = got[:12], exp[:12]
            raise SnapshotError(f"{path}: snapshot is for another {label} ({got}; this engine: {exp})")
    bs, lay = engine.block_manager.block_size, json.loads(want["kv_layout"])
    shape = (lay["layers"], ids.numel() // bs, bs, lay["kv_heads"], lay["head_dim"])
    if (ids.dtype != torch.int64 or ids.ndim != 1 or ids.numel() % bs or str(ids.numel()) != meta.get("num_tokens")
            or tuple(k.shape) != shape or tuple(v.shape) != shape or k.dtype != engine.kv_dtype or v.dtype != engine.kv_dtype):
        raise SnapshotError(f"{path}: corrupt snapshot (tensor shapes disagree with its header)")
    if _checksum(k, v, ids) != meta.get("crc32"):
        raise SnapshotError(f"{path}: corrupt snapshot (checksum mismatch)")
    tokens = ids.tolist()
    if any(not 0 <= t < engine.model_config.vocab_size for t in tokens):
        raise SnapshotError(f"{path}: corrupt snapshot (token ids outside the vocabulary)")
    return tokens, k, v


def load_prefix(engine: Engine, path: str | os.PathLike) -> SnapshotInfo:
    """Put a snapshot's blocks into the prefix cache. All checks come first: on error nothing changed."""
    cache, bm = _paged_cache(engine), engine.block_manager
    tokens, k, v = read_snapshot(engine, path)
    nblk = len(tokens) // bm.block_size
    if nblk > bm.num_blocks or len(tokens) >= engine.max_model_len:
        raise SnapshotError(f"{path}: {len(tokens)} tokens do not fit this engine's KV pool or context")
    holder = Request(f"snapshot-load-{os.fspath(path)}", tokens, len(tokens), SamplingParams())
    hit = bm.find_cached_prefix(holder, max_blocks=nblk)
    if not bm.can_allocate(holder, nblk * bm.block_size, hit):
        raise SnapshotError(f"{path}: needs {nblk - len(hit)} free KV blocks, {bm.num_free_blocks} are free now")
    bm.allocate(holder, nblk * bm.block_size, hit)  # may evict least recently used cached blocks
    new = holder.block_table[len(hit):]
    if new:
        cache.write_blocks(new, k[:, len(hit):], v[:, len(hit):])
    holder.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(holder)
    bm.free(holder)  # the blocks stay cached (ref 0, in the LRU) for the next request with this prefix
    return SnapshotInfo(str(path), len(tokens), nblk, len(new))
