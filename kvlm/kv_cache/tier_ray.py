"""The KV tier on a Ray cluster: `--kv-tier-dir ray://NAME` keeps tier blocks in a named, detached Ray actor
(`kvlm-kv-tier-NAME` in namespace "kvlm") instead of a directory, so replicas on several machines of one
Ray cluster share one tier (`kvlm serve --replicas N --ray-address ...`).

Why Ray and not Redis/Valkey: `kvlm serve --replicas` already runs on a Ray cluster, so the store needs no
other server to install, start, secure and size; the actor starts with the first engine that asks for it
(`get_if_exists`) and lives until the cluster stops or `ray.kill` (detached: it outlives the replicas and
restarts of `kvlm serve`). It holds an LRU of block files' bytes, bounded by `--kv-tier-bytes`, in its
own process's memory (one process: the byte bound must fit one machine's RAM).

`RayTier` is a `KVTier` whose storage is the actor: the same files (safetensors bytes with the snapshot
header, crc32 and `tier_hash`), written by the same background writer thread, validated the same way on
read (`read_snapshot_meta` over bytes), a bad block removed with one warning. A store that fails turns
storing off with one warning, like a full disk. One call per lookup and one per loaded run, never per
block; `has` is this process's own record of what it stored or loaded (a stale answer only skips or
repeats a store).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import torch

from kvlm.errors import SnapshotError
from kvlm.kv_cache.snapshot import read_snapshot_meta
from kvlm.kv_cache.tier import KVTier, _Pending
from kvlm.kv_cache.tier_codec import TierCodec

SCHEME = "ray://"
NAMESPACE = "kvlm"
KNOWN = 1 << 16  # names `has` remembers


class TierStore:
    """The actor's body (plain Python; `RayTier` makes it a Ray actor): block files by hash, LRU in bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.total, self.evicted = max_bytes, 0, 0
        self.blocks: OrderedDict[bytes, bytes] = OrderedDict()

    def put(self, name: bytes, data: bytes) -> tuple[bool, int, int]:
        """Store a block (an existing one is only refreshed); returns (stored, evicted by this put, bytes held)."""
        if name in self.blocks:
            self.blocks.move_to_end(name)
            return False, 0, self.total
        self.blocks[name] = data
        self.total += len(data)
        evicted = 0
        while self.total > self.max_bytes and len(self.blocks) > 1:
            _, old = self.blocks.popitem(last=False)
            self.total -= len(old)
            evicted += 1
        self.evicted += evicted
        return True, evicted, self.total

    def lookup(self, names: list[bytes]) -> int:
        n = 0
        while n < len(names) and names[n] in self.blocks:
            n += 1
        return n

    def get(self, names: list[bytes]) -> list[bytes | None]:
        out = []
        for n in names:
            data = self.blocks.get(n)
            if data is not None:
                self.blocks.move_to_end(n)
            out.append(data)
        return out

    def remove(self, name: bytes) -> None:
        data = self.blocks.pop(name, None)
        if data is not None:
            self.total -= len(data)

    def names(self, prefix_bytes: int, limit: int) -> list[bytes]:
        return [n[:prefix_bytes] for n, _ in zip(reversed(self.blocks), range(limit))]

    def size(self) -> int:
        return self.total


class RayTier(KVTier):
    """A `KVTier` over the named actor of `url` (ray://NAME); needs Ray connected (a replica, or
    `ray.init` before the engine starts)."""

    def __init__(self, url: str, max_bytes: int, header: dict[str, str], vocab_size: int, block_bytes: int,
                 codec: TierCodec | None = None) -> None:
        import ray

        name = url.removeprefix(SCHEME).strip("/") or "default"
        if not ray.is_initialized():
            raise OSError(f"{url}: Ray is not connected here (the tier lives on a Ray cluster: use it with "
                          "kvlm serve --replicas, or call ray.init first)")
        self.url = url
        self.actor = ray.remote(TierStore).options(name=f"kvlm-kv-tier-{name}", namespace=NAMESPACE,
                                                   lifetime="detached", get_if_exists=True, num_cpus=0,
                                                   max_concurrency=1).remote(max_bytes)
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._fetched: dict[bytes, bytes | None] = {}
        gcs = ray.get_runtime_context().gcs_address
        self._start(f"{SCHEME}{name}@{gcs}", max_bytes, header, vocab_size, block_bytes, codec)

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.actor, method).remote(*args), timeout=60)

    def path(self, name: bytes) -> Any:
        return f"{self.url}/{name.hex()}"  # names a block in messages

    def _remember(self, name: bytes) -> None:
        self._known[name] = None
        self._known.move_to_end(name)
        while len(self._known) > KNOWN:
            self._known.popitem(last=False)

    def has(self, name: bytes) -> bool:
        return name in self._known

    def names(self, prefix_bytes: int = 8, limit: int = 1 << 16) -> list[bytes]:
        return self._call("names", prefix_bytes, limit)

    def _write(self, item: _Pending) -> None:
        t0 = time.perf_counter()
        data = self._encode(item)
        stored, evicted, total = self._call("put", item.name, data)
        with self._lock:
            self._remember(item.name)
            if stored:
                self.stats.store_s += time.perf_counter() - t0
                self.stats.stored_blocks += 1
                self.stats.stored_bytes += len(data)
            self.stats.evicted_files += evicted
            self.stats.size_bytes = total

    def _scan_lru(self, evict: bool) -> None:
        total = self._call("size")  # the actor evicts as it stores: only its size to learn
        with self._lock:
            self.stats.size_bytes = total

    def lookup(self, names: list[bytes]) -> int:
        try:
            n = self._call("lookup", names)
        except Exception:  # noqa: BLE001 - the store unreachable: a miss, the request recomputes
            n = 0
        if n < len(names):
            self.stats.miss_blocks += 1
        return n

    def load_run(self, names: list[bytes], tokens: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            self._fetched = dict(zip(names, self._call("get", names)))
        except Exception:  # noqa: BLE001 - as a file removed mid-load: recomputed
            self._fetched = {}
        try:
            out = super().load_run(names, tokens)
        finally:
            self._fetched = {}
        self._scan_lru(evict=False)
        return out

    def _read(self, name: bytes) -> tuple[list[int], dict[str, torch.Tensor], dict[str, str], int]:
        data = self._fetched.get(name)
        if data is None:
            raise SnapshotError(f"{self.path(name)}: no such file")
        ids, kv, meta = read_snapshot_meta(self.path(name), self.header, self.vocab_size, data=data)
        self._remember(name)
        return ids, kv, meta, len(data)

    def _touch(self, name: bytes) -> None:
        pass  # `get` refreshed it

    def _drop_corrupt(self, name: bytes, why: str) -> None:
        try:
            self._call("remove", name)
        except Exception:  # noqa: BLE001 - the store unreachable: nothing to remove
            pass
        self._known.pop(name, None)
        self._count_corrupt(why)
