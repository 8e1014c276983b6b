"""The KV tier: full prefix-cache blocks on disk, under the pool, keyed by the same block-hash chain.

A block that leaves the pool's prefix cache (evicted for room), or a finished request's prompt block when
write-through is on, is copied out of the pool on the engine thread (`offer`: one `read_blocks` copy, no
disk I/O) and written by a background thread to `DIR/<hash hex>.kvb`. A later request whose prefix misses
the pool but whose next block hashes are files here loads them (`load_run`) into fresh pool blocks, which
then enter the prefix cache as if computed (`Engine` does the wiring, `kv_cache/snapshot.py` the copy).

File = a one-block KV snapshot (`kv_cache/snapshot.py`'s format and header, so the same validation: model
fingerprint, dtype, KV dtype, block size, layout, K center, crc32 over K/V and token ids), stored in the
pool's own format (raw codes and scales for int8 / int4), so a load is a copy, or, for a float pool with
`--kv-tier-dtype int8`, as int8 rows (`tier_codec.py`: lossy, quantized by the writer thread, dequantized
on load); plus `tier_dtype`, which of the two, and `tier_hash`, the
block's chain hash, which must equal the file name and the hash the reader expects, and whose tokens must
equal the reader's. The chain hash covers every earlier token and the engine's hash root (model, dtype,
KV format, K center, block size), so a file names one prefix's K/V only.

Crash safety and sharing (several engines, several processes, one directory):
* a write goes to a temporary name in the same directory (`.tmp-...`, never read), is fsynced and renamed
  over `<hash>.kvb` (atomic on POSIX): a reader sees the whole file or none; a SIGKILL mid-write leaves
  only a temp file, which the next eviction pass removes once it is stale;
* two writers of one block write equal bytes, and the last rename wins;
* a reader that finds a file corrupt, truncated or foreign removes it, with one warning per tier;
* a file removed between lookup and read is a miss: the request recomputes those tokens.

Bounded in bytes (`max_bytes`): a hit refreshes the file's atime and mtime (`os.utime`); when the
writer's running count passes the bound, one process at a time (`fcntl.flock` on `DIR/.lock`) scans the
directory and removes the least recently used files down to 90% of it. A write that fails (a full disk,
a quota) turns storing off with one warning; what the tier holds is still served.

What it knows: hashes, files, tensors handed to it. Not the block manager, the scheduler or requests.
`kv_cache/tier_ray.py`'s `RayTier` keeps the same files in a Ray actor instead (`--kv-tier-dir ray://NAME`).
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvlm.errors import SnapshotError
from kvlm.kv_cache.snapshot import checksum, read_snapshot_meta
from kvlm.kv_cache.tier_codec import TierCodec

log = logging.getLogger("kvlm")

SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 600.0  # a temp file older than this is a dead writer's (SIGKILL): removed at eviction
QUEUE_BYTES = 256 << 20  # copies waiting for the writer at most; more are dropped (counted)


@dataclass(slots=True)
class TierStats:
    """What the tier did since this engine started (the directory's size is shared with other processes)."""

    hit_blocks: int = 0  # blocks loaded into the pool
    hit_bytes: int = 0
    miss_blocks: int = 0  # lookups past the pool's hit that found no (valid) file
    stored_blocks: int = 0  # files written by this process
    stored_bytes: int = 0
    dropped_blocks: int = 0  # offered while the writer's queue was full (or storing was off)
    evicted_files: int = 0  # removed by this process's LRU passes
    corrupt_files: int = 0  # removed because they failed validation
    load_s: float = 0.0  # reading and validating files (engine thread)
    store_s: float = 0.0  # serializing and writing files (writer thread)
    size_bytes: int = 0  # the directory's .kvb bytes at the last scan plus what this process wrote since

    def as_dict(self) -> dict[str, float | int | None]:
        mb = 2**20
        return {"tier_hit_blocks": self.hit_blocks, "tier_hit_bytes": self.hit_bytes,
                "tier_miss_blocks": self.miss_blocks, "tier_stored_blocks": self.stored_blocks,
                "tier_stored_bytes": self.stored_bytes, "tier_dropped_blocks": self.dropped_blocks,
                "tier_evicted_files": self.evicted_files, "tier_corrupt_files": self.corrupt_files,
                "tier_size_bytes": self.size_bytes,
                "tier_load_mb_per_s": self.hit_bytes / mb / self.load_s if self.load_s else None,
                "tier_store_mb_per_s": self.stored_bytes / mb / self.store_s if self.store_s else None}


@dataclass(slots=True)
class _Pending:
    name: bytes  # the block's chain hash
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # k, v (layers, 1, bs, heads, row), token_ids

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class KVTier:
    """A directory of one-block snapshots named by chain hash (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int, header: dict[str, str], vocab_size: int,
                 block_bytes: int, codec: TierCodec | None = None) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        st = self.dir.stat()  # names the directory across processes on one machine (the router groups by it)
        self._start(f"{os.uname().nodename}:{st.st_dev}:{st.st_ino}", max_bytes, header, vocab_size, block_bytes,
                    codec)

    def _start(self, tier_id: str, max_bytes: int, header: dict[str, str], vocab_size: int, block_bytes: int,
               codec: TierCodec | None) -> None:
        self.tier_id = tier_id
        self.max_bytes, self.vocab_size = max_bytes, vocab_size
        # codec: the files' K/V format (tier_codec.py; None: as handed in), recorded in every file's header
        self.codec = codec
        self.header = header if codec is None else {**header, "tier_dtype": codec.tier_dtype}
        self.stats = TierStats()
        self.writable = True
        self._warned_corrupt = False
        self._lock = threading.Lock()  # stats and the queue's byte count
        self._queued_bytes = 0
        self._max_queued = max(QUEUE_BYTES, 2 * block_bytes)
        self._queue: queue.Queue[_Pending] = queue.Queue()
        self._scan_lru(evict=False)
        self._writer = threading.Thread(target=self._write_loop, name="kvlm-kv-tier", daemon=True)
        self._writer.start()
        atexit.register(self._at_exit)  # a stopping server's queued blocks still reach the store

    def path(self, name: bytes) -> Path:
        return self.dir / (name.hex() + SUFFIX)

    def has(self, name: bytes) -> bool:
        return self.path(name).is_file()

    def names(self, prefix_bytes: int = 8, limit: int = 1 << 16) -> list[bytes]:
        """The first `prefix_bytes` of the hashes of (at most `limit`) files here, for the router's view."""
        out: list[bytes] = []
        with os.scandir(self.dir) as it:
            for entry in it:
                if entry.name.endswith(SUFFIX) and len(out) < limit:
                    try:
                        out.append(bytes.fromhex(entry.name[: 2 * prefix_bytes]))
                    except ValueError:
                        continue  # not one of ours
        return out

    # -- engine thread: store ---------------------------------------------------------------------------
    def offer(self, name: bytes, token_ids: tuple[int, ...], k: torch.Tensor, v: torch.Tensor) -> bool:
        """Queue one block's K/V (copies the caller no longer touches: (layers, 1, bs, heads, row)) for the
        writer. Never blocks: when the queue holds `QUEUE_BYTES` already, or storing is off, the block is
        dropped (counted). Returns whether it was queued."""
        item = _Pending(name, {"k": k, "v": v, "token_ids": torch.tensor(token_ids, dtype=torch.int64)})
        with self._lock:
            if not self.writable or self._queued_bytes + item.nbytes > self._max_queued:
                self.stats.dropped_blocks += 1
                return False
            self._queued_bytes += item.nbytes
        self._queue.put(item)
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written (or dropped): tests and benchmarks, before a restart, and
        at interpreter exit (at most 30 s there). Returns False if `timeout` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def _at_exit(self) -> None:
        self.flush(timeout=30.0)

    # -- writer thread ----------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if self.writable:
                    self._write(item)
            except Exception as e:  # noqa: BLE001 - a tier failure must never take the engine down
                self._stop_storing(e)
            finally:
                with self._lock:
                    self._queued_bytes -= item.nbytes
                self._queue.task_done()

    def _encode(self, item: _Pending) -> bytes:
        """A block's file: the snapshot format and header, plus its chain hash."""
        from safetensors.torch import save

        ts = item.tensors
        k, v = ts["k"], ts["v"]
        if self.codec is not None:  # int8 rows of a float pool's K/V: quantized here, off the engine thread
            k, v = self.codec.encode(k), self.codec.encode(v)
        meta = {**self.header, "num_tokens": str(ts["token_ids"].numel()),
                "crc32": checksum(k, v, ts["token_ids"]), "tier_hash": item.name.hex()}
        return save({"k": k.contiguous(), "v": v.contiguous(), "token_ids": ts["token_ids"]}, metadata=meta)

    def _write(self, item: _Pending) -> None:
        final = self.path(item.name)
        if final.exists():  # another process (or an earlier eviction) stored it: refresh its place in the LRU
            _touch(final)
            return
        t0 = time.perf_counter()
        data = self._encode(item)
        tmp = self.dir / f"{TMP_PREFIX}{item.name.hex()}-{os.getpid()}-{threading.get_ident()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            self.stats.store_s += time.perf_counter() - t0
            self.stats.stored_blocks += 1
            self.stats.stored_bytes += len(data)
            self.stats.size_bytes += len(data)
            over = self.stats.size_bytes > self.max_bytes
        if over:
            self._scan_lru(evict=True)

    def _stop_storing(self, e: BaseException) -> None:
        if self.writable:
            self.writable = False
            log.warning("kvlm: KV tier: writing to %s failed (%s); the tier stops storing blocks and still serves "
                        "the ones it has", self.dir, str(e).splitlines()[0] if str(e) else type(e).__name__)

    def _scan_lru(self, evict: bool) -> None:
        """Count the directory's bytes; with `evict`, remove least recently used files (and dead writers'
        temp files) down to 90% of `max_bytes`, holding the directory's lock so processes take turns."""
        with open(self.dir / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                files, total, now = [], 0, time.time()
                with os.scandir(self.dir) as it:
                    for entry in it:
                        try:
                            st = entry.stat()
                        except FileNotFoundError:
                            continue  # removed by another process meanwhile
                        if entry.name.endswith(SUFFIX):
                            files.append((st.st_atime, st.st_size, entry.path))
                            total += st.st_size
                        elif evict and entry.name.startswith(TMP_PREFIX) and now - st.st_mtime > STALE_TMP_S:
                            _unlink(entry.path)
                removed = 0
                if evict and total > self.max_bytes:
                    files.sort()
                    target = int(self.max_bytes * 0.9)
                    for _, size, p in files:
                        if total <= target:
                            break
                        if _unlink(p):
                            removed += 1
                        total -= size
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        with self._lock:
            self.stats.size_bytes = total
            self.stats.evicted_files += removed

    # -- engine thread: load ----------------------------------------------------------------------------
    def lookup(self, names: list[bytes]) -> int:
        """How many of `names` (the next block hashes of a prompt, in order) have a file here: a leading run."""
        n = 0
        while n < len(names) and self.has(names[n]):
            n += 1
        if n < len(names):
            self.stats.miss_blocks += 1
        return n

    def load_run(self, names: list[bytes], tokens: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Read the files of `names` in order, each checked against this engine's header and `tokens` (the
        block's token ids); stops at the first missing or invalid one (an invalid one is removed).
        Returns K and V (layers, n, block_size, kv_heads, row) in the pool's format (decoded from the files'
        by the codec) for the n blocks read (n may be 0)."""
        t0 = time.perf_counter()
        ks, vs, nbytes = [], [], 0
        for name, toks in zip(names, tokens):
            try:
                ids, kv, meta, size = self._read(name)
            except SnapshotError as e:
                if "no such file" not in str(e):
                    self._drop_corrupt(name, str(e))
                self.stats.miss_blocks += 1
                break
            if tuple(ids) != toks or meta.get("tier_hash") != name.hex():
                self._drop_corrupt(name, f"{self.path(name)}: holds another block than its name says")
                self.stats.miss_blocks += 1
                break
            self._touch(name)
            ks.append(kv["k"])
            vs.append(kv["v"])
            nbytes += size
        k, v = (torch.cat(ks, dim=1), torch.cat(vs, dim=1)) if ks else (torch.empty(0), torch.empty(0))
        if ks and self.codec is not None:
            k, v = self.codec.decode(k), self.codec.decode(v)
        self.stats.load_s += time.perf_counter() - t0
        self.stats.hit_blocks += len(ks)
        self.stats.hit_bytes += nbytes
        return k, v

    def _read(self, name: bytes) -> tuple[list[int], dict[str, torch.Tensor], dict[str, str], int]:
        """(token ids, K/V, metadata, bytes) of a block's file, validated; SnapshotError when missing or bad."""
        path = self.path(name)
        try:  # read whole first: a file removed or replaced meanwhile is then either all there or missing
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise SnapshotError(f"{path}: no such file") from None
        except OSError as e:
            raise SnapshotError(f"{path}: unreadable ({e.strerror or e})") from None
        ids, kv, meta = read_snapshot_meta(path, self.header, self.vocab_size, data=data)
        return ids, kv, meta, len(data)

    def _touch(self, name: bytes) -> None:
        _touch(self.path(name))

    def _drop_corrupt(self, name: bytes, why: str) -> None:
        _unlink(self.path(name))
        self._count_corrupt(why)

    def _count_corrupt(self, why: str) -> None:
        self.stats.corrupt_files += 1
        if not self._warned_corrupt:
            self._warned_corrupt = True
            log.warning("kvlm: KV tier: removed an unusable file (%s); the request recomputes those tokens "
                        "(further ones are counted, not logged)", why)


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass  # evicted by another process meanwhile


def _unlink(path: str | os.PathLike) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
