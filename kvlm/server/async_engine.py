"""`AsyncEngine`: one thread steps the `Engine` continuously; asyncio handlers submit and stream requests.

The engine is single-threaded bookkeeping, so only the loop thread touches it. Handlers talk to that thread
through a thread-safe inbox (add, abort, abort-all) and read its load (`EngineLoad`: running, waiting, KV
blocks) from a snapshot the loop thread publishes after every step; each request has an asyncio queue on
the server's event loop, fed by the loop thread with `loop.call_soon_threadsafe`. A request joins the
running batch at the next step after it is submitted, and an HTTP handler never waits on a forward pass.

`submit()` returns a `Submission`, an async iterator over (choice index, `StreamDelta`); when its consumer
goes away (client disconnect, cancelled task) the handler's `finally` calls `close()`, which aborts every
request it still owns, so the engine frees their KV blocks at the next step. This module knows nothing
about HTTP or JSON.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvlm.engine.engine import Engine
from kvlm.kv_cache.block_manager import held_blocks
from kvlm.outputs import StreamDelta
from kvlm.request import Request
from kvlm.sampling_params import SamplingParams

log = logging.getLogger("kvlm.server")


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an internal error; the server answers 500/503 from then on."""


class QueueFullError(RuntimeError):
    """More requests are waiting than `max_queued_requests` allows."""


@dataclass(slots=True)
class _Stream:
    """Where the loop thread sends one request's deltas."""

    index: int
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    last_token_time: float | None = None


def _send(s: _Stream, item: Any) -> bool:
    """Hand `item` to the stream's queue on its event loop; False when that loop is closed."""
    try:
        s.loop.call_soon_threadsafe(s.queue.put_nowait, item)
    except RuntimeError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What handler threads may know of the engine's state: a snapshot the loop thread publishes after
    it adds requests and after every step (`AsyncEngine.load`), never the live scheduler."""

    num_running: int
    num_waiting: int  # in the scheduler's queue (submitted but not yet added: `AsyncEngine._pending`)
    kv_used_blocks: int
    kv_total_blocks: int


@dataclass(slots=True)
class _Add:
    specs: list[tuple[list[int], SamplingParams, str]]
    streams: list[_Stream]
    future: Future = field(default_factory=Future)
    lora: str | None = None  # the LoRA adapter every request of this add runs under (None: the base)


class AsyncEngine:
    """Owns the engine loop thread. The `on_token` / `on_finish` hooks (metrics) run on that thread."""

    def __init__(self, engine: Engine, max_queued_requests: int | None = None,
                 on_token: Callable[[Request, float, float | None], None] | None = None,
                 on_finish: Callable[[Request], None] | None = None) -> None:
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.on_token, self.on_finish = on_token, on_finish
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # loop thread only: request id -> its queue
        self._requests_by_id: dict[str, Request] = {}  # loop thread only: live requests, for the hooks
        self._pending = 0  # requests submitted but not yet in the scheduler (guarded by _lock)
        self._lock = threading.Lock()
        self.load = EngineLoad(0, 0, engine.block_manager.num_used_blocks, engine.block_manager.num_blocks)
        self._stop = False
        self.dead: BaseException | None = None
        self.draining = False
        self._thread = threading.Thread(target=self._run, name="kvlm-engine-loop", daemon=True)

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    def abort_all(self) -> None:
        """Abort everything in flight (shutdown): each stream gets a final `finish_reason="abort"` delta."""
        self.draining = True
        self._post(("abort_all",))

    # -- what handlers call ----------------------------------------------------------------------------
    def health(self) -> tuple[int, dict[str, Any]] | None:
        """None: healthy (a bare 200). Replicas (`serve_ray.client`) report a degraded state here."""
        return None

    @property
    def num_waiting(self) -> int:
        """Requests queued: in the scheduler's queue at the last snapshot, plus submitted but not added."""
        with self._lock:
            return self.load.num_waiting + self._pending

    def reserve(self, count: int) -> None:
        """Count `count` requests as queued now, or raise `QueueFullError`. Called before any tokenizing,
        so a refused request costs nothing; pair with `submit(..., reserved=count)` or `release(count)`."""
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        with self._lock:
            cap = self.max_queued_requests
            if cap is not None and self.load.num_waiting + self._pending + count > cap:
                raise QueueFullError(f"the request queue is full ({cap} waiting)")
            self._pending += count

    def release(self, count: int) -> None:
        """Give back a `reserve()` that will not be submitted (the request failed validation)."""
        with self._lock:
            self._pending -= count

    async def submit(self, specs: list[tuple[list[int], SamplingParams, str]], reserved: int = 0,
                     stream: bool = True, lora: str | None = None) -> Submission:
        """Start the requests `specs[i] = (prompt ids, params, request id)`; `reserved` of them were
        counted by `reserve()` already. All or none: if the engine refuses one (too long, bad ids), none
        runs and the engine's error is raised here, before anything was streamed. `stream` (whether the
        client sees deltas as they come) matters only to replicas (`serve_ray.client`), which may retry
        a request elsewhere while nothing of it was shown. `lora`: a loaded adapter's name, for every request."""
        if reserved < len(specs):
            self.reserve(len(specs) - reserved)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        add = _Add(specs, [_Stream(i, q, loop) for i in range(len(specs))], lora=lora)
        try:
            self._post(add)
        except BaseException:
            self.release(len(specs))
            raise
        sub = Submission(self, [rid for _, _, rid in specs], q)
        try:
            sub.requests = await asyncio.wrap_future(add.future)
        except asyncio.CancelledError:
            sub.close()  # the client left while we were adding: abort whatever landed
            raise
        return sub

    async def kv_map(self) -> dict[str, Any]:
        """The KV pool block by block (the chat page's panel), built by the loop thread at its next turn:
        handler threads never read the block manager themselves."""
        fut: Future = Future()
        self._post(("kv_map", fut))
        return await asyncio.wrap_future(fut)

    def abort(self, request_id: str) -> None:
        if self.dead is None:
            self._post(("abort", request_id))

    def _post(self, msg: Any) -> None:
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        self._inbox.put(msg)
        self._wake.set()

    # -- the loop thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._stop:
                self._wake.clear()
                self._drain_inbox()
                with self._lock:  # aborts change the load even when no step follows
                    self._publish_load()
                if not eng.has_unfinished:
                    self._wake.wait(0.5)
                    continue
                deltas = eng.step()
                with self._lock:
                    self._publish_load()
                now = time.perf_counter()
                for d in deltas:
                    self._deliver(d, now)
        except BaseException as e:  # an engine bug: fail every stream loudly, refuse new work
            log.exception("kvlm: engine loop failed")
            self.dead = e
            err = EngineDeadError("the engine stopped on an internal error")
            for s in self._streams.values():
                _send(s, err)
            self._streams.clear()
            self._fail_inbox(err)

    def _deliver(self, d: StreamDelta, now: float) -> None:
        s = self._streams.get(d.request_id)
        req = None
        if self.on_token is not None or (d.finished and self.on_finish is not None):
            req = self._requests_by_id.get(d.request_id)
        if req is not None and self.on_token is not None and d.token_ids:  # (an embedding's delta holds none)
            self.on_token(req, now, s.last_token_time if s else None)
        if s is not None:
            s.last_token_time = now
            if not _send(s, (s.index, d)) and not d.finished:
                self._abort(d.request_id)  # its event loop is gone: nobody will read this request
                return
        if d.finished:
            self._streams.pop(d.request_id, None)
            if req is not None:
                self._requests_by_id.pop(d.request_id, None)
                if self.on_finish is not None:
                    self.on_finish(req)

    def _take_inbox(self) -> Iterator[Any]:
        """Every message in the inbox now, without waiting."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain_inbox(self) -> None:
        for msg in self._take_inbox():
            if isinstance(msg, _Add):
                self._add(msg)
            elif msg[0] == "abort":
                self._abort(msg[1])
            elif msg[0] == "abort_all":
                for rid in list(self._streams):
                    self._abort(rid)
            elif msg[0] == "kv_map":
                self._set_future(msg[1], None, self._kv_map())

    def _kv_map(self) -> dict[str, Any]:
        """Loop thread: each block's state as one number (0 free, 1 cached-free: a finished request's prefix
        kept for reuse, 2 + i: held by owners[i], the first running request that reads it), the blocks more
        than one request reads, and the pool's counters. O(blocks), built only when asked."""
        eng = self.engine
        bm = eng.block_manager
        state = [0] * bm.num_blocks
        for b in bm.cached_free:
            state[b] = 1
        owners = []
        for req in eng.scheduler.running:
            held = held_blocks(req)
            for b in held:
                if state[b] < 2:
                    state[b] = 2 + len(owners)
            owners.append({"id": req.request_id, "blocks": len(held), "tokens": req.num_computed_tokens})
        shared = [b for b, n in enumerate(bm.ref_counts) if n > 1]
        return {"num_blocks": bm.num_blocks, "block_size": bm.block_size,
                "bytes_per_block": bm.block_size * eng.kv_bytes_per_token, "blocks": state, "owners": owners,
                "shared": shared, "used": bm.num_used_blocks, "cached": len(bm.cached_free),
                "free": len(bm.free_blocks), "freed": bm.num_freed, "evicted": bm.num_evictions,
                "running": len(eng.scheduler.running), "waiting": len(eng.scheduler.waiting)}

    def _add(self, msg: _Add) -> None:
        added: list[Request] = []
        try:
            for (ids, params, rid), stream in zip(msg.specs, msg.streams):
                req = self.engine.add_request(ids, params, request_id=rid, lora=msg.lora)
                added.append(req)
                self._streams[rid] = stream
                self._requests_by_id[rid] = req
        except Exception as e:  # refused by the engine: undo the siblings, report to the handler
            for req in added:
                self.engine.abort(req.request_id)
                self._streams.pop(req.request_id, None)
                self._requests_by_id.pop(req.request_id, None)
            self._set_future(msg.future, e)
        else:
            if self.draining:  # submitted while shutting down: end at once with "abort"
                for req in added:
                    self._abort(req.request_id)
            self._set_future(msg.future, None, added)
        finally:
            with self._lock:  # one update: the added requests move from _pending to the engine's queue
                self._pending -= len(msg.specs)
                self._publish_load()

    def _publish_load(self) -> None:
        """Loop thread, under `_lock`: the snapshot handler threads read instead of the engine."""
        sched, bm = self.engine.scheduler, self.engine.block_manager
        self.load = EngineLoad(len(sched.running), len(sched.waiting), bm.num_used_blocks, bm.num_blocks)

    @staticmethod
    def _set_future(fut: Future, error: BaseException | None, result: Any = None) -> None:
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)

    def _abort(self, rid: str) -> None:
        req = self._requests_by_id.pop(rid, None)
        if self.engine.abort(rid) and req is not None:
            s = self._streams.get(rid)
            if s is not None:
                _send(s, (s.index, StreamDelta(rid, "", [], True, "abort")))
            if self.on_finish is not None:
                self.on_finish(req)
        self._streams.pop(rid, None)

    def _fail_inbox(self, err: BaseException) -> None:
        for msg in self._take_inbox():
            if isinstance(msg, _Add):
                self._set_future(msg.future, err)
            elif msg[0] == "kv_map":
                self._set_future(msg[1], err)


class DeltaStream:
    """Iterating one API call's deltas: (choice index, delta) items, or an exception, from `self._queue`,
    until every request id in `self._open` has finished. `Submission` here and the replicas' one share it."""

    _queue: asyncio.Queue
    _open: set[str]

    def __aiter__(self) -> DeltaStream:
        return self

    async def __anext__(self) -> tuple[int, StreamDelta]:
        if not self._open:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._open.clear()
            raise item
        index, delta = item
        if delta.finished:
            self._open.discard(delta.request_id)
        return index, delta


class Submission(DeltaStream):
    """The requests of one API call in flight: iterate for (choice index, delta); `close()` aborts the
    ones not finished yet (idempotent; call it in a `finally`)."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str], q: asyncio.Queue) -> None:
        self._engine, self._queue = engine, q
        self.request_ids = request_ids
        self.requests: list[Request] = []  # read-only here; the loop thread owns them until they finish
        self._open = set(request_ids)

    def close(self) -> None:
        for rid in self._open:
            self._engine.abort(rid)
        self._open.clear()
