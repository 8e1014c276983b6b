"""`ReplicaClient`: what the OpenAI endpoints call instead of `AsyncEngine` when replicas serve.

Same surface as `AsyncEngine` (`reserve` / `release` / `submit` -> an async iterator of (choice index,
`StreamDelta`), `close()` aborting, `abort_all`, `dead`, `draining`, `load`, `health`), so `server.app`
and the endpoint classes run unchanged in front of N replicas. Each engine request goes to the replicas'
deployment handle with its prompt's block hashes (`RouteHint`); `KvlmRequestRouter` picks the replica.

Faults: a request whose replica dies (the process killed, out of memory) before it delivered anything to
the client is sent again, to whichever replica the router picks (up to `MAX_ATTEMPTS`). A non-streamed
request has delivered nothing until it finished (its deltas are held back), so it is always retried; a
streamed one that already sent tokens ends with an OpenAI-shaped error event instead. Greedy and seeded
requests come out the same on the retry: replicas run the same engine, whose tokens do not depend on
batch or cache. Back-pressure: `--max-queued-requests` counts the requests beyond what the running
replicas take at once (`max_ongoing_requests` each): past it, 503.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from kvlm.kv_cache.block_manager import prefix_block_hashes
from kvlm.outputs import StreamDelta
from kvlm.sampling_params import SamplingParams
from kvlm.serve_ray.records import RemoteRequest, ReplicaInfo, raise_record
from kvlm.serve_ray.routing import RouteHint, RoutingBook, short_hashes
from kvlm.server.async_engine import DeltaStream, EngineLoad, QueueFullError
from kvlm.server.protocol import APIError

log = logging.getLogger("kvlm.server")
MAX_ATTEMPTS = 4  # per engine request: the first try and three retries on other (or restarted) replicas


def _replica_lost(detail: str) -> APIError:
    return APIError(503, f"the replica serving this request stopped ({detail}); retry the request",
                    "service_unavailable", None, 503)


class ReplicaClient:
    def __init__(self, handle: Any, book: RoutingBook, info: ReplicaInfo, *, target_replicas: int,
                 max_ongoing_requests: int, max_queued_requests: int | None = None) -> None:
        self.handle = handle.options(stream=True)
        self.book, self.info = book, info
        self.target_replicas, self.max_ongoing = target_replicas, max_ongoing_requests
        self.max_queued_requests = max_queued_requests
        self.dead: BaseException | None = None  # never set: a lost replica is Serve's to restart
        self.draining = False
        self._in_flight = 0  # engine requests reserved or running, from this process
        self._subs: set[ReplicaSubmission] = set()
        self._loop: asyncio.AbstractEventLoop | None = None  # the app's, seen at the first submit

    # -- what app / serving read ------------------------------------------------------------------------
    def _replica_stats(self) -> list[dict[str, Any]]:
        return list(self.book.snapshot()["replicas"].values())

    @property
    def num_replicas(self) -> int:
        return len(self.book.snapshot()["replicas"])

    @property
    def load(self) -> EngineLoad:
        s = self._replica_stats()
        return EngineLoad(sum(r.get("running", 0) for r in s), sum(r.get("waiting", 0) for r in s),
                          sum(r.get("kv_used_blocks", 0) for r in s), max(1, sum(r.get("kv_total_blocks", 0)
                                                                                 for r in s)))

    @property
    def num_waiting(self) -> int:
        return max(0, self._in_flight - self.num_replicas * self.max_ongoing)

    def health(self) -> tuple[int, dict[str, Any]] | None:
        """None while every replica runs; else (status, body): 200 "degraded" while some serve, 503 with none."""
        n = self.num_replicas
        if n >= self.target_replicas:
            return None
        body = {"status": "degraded" if n else "unavailable", "replicas": n, "target_replicas": self.target_replicas}
        return (200 if n else 503), body

    # -- what the endpoints call ------------------------------------------------------------------------
    def reserve(self, count: int) -> None:
        cap = self.max_queued_requests
        if cap is not None and self.num_waiting + count > cap:
            raise QueueFullError(f"the request queue is full ({cap} waiting beyond what the replicas run)")
        self._in_flight += count

    def release(self, count: int) -> None:
        self._in_flight -= count

    async def submit(self, specs: list[tuple[list[int], SamplingParams, str]], reserved: int = 0,
                     stream: bool = True, lora: str | None = None) -> ReplicaSubmission:
        """Start every request; all or none (an engine refusal of one aborts its siblings and is raised).
        LoRA adapters are not served by replicas (`lora` is always None here: no adapter name resolves)."""
        assert lora is None, "LoRA adapters are not served with --replicas"
        if reserved < len(specs):
            self.reserve(len(specs) - reserved)
        if self.draining:
            self.release(len(specs))
            raise APIError(503, "the server is shutting down", "service_unavailable", None, 503)
        self._loop = asyncio.get_running_loop()
        sub = ReplicaSubmission(self, specs, stream)
        try:
            await sub.started()
        except BaseException:
            sub.close()
            raise
        return sub

    def abort_all(self) -> None:
        """Shutdown: every open request ends at once with `finish_reason="abort"`; new ones get 503."""
        self.draining = True
        if self._loop is not None:  # called from a signal handler: cancel the tasks on their own loop
            self._loop.call_soon_threadsafe(self._abort_subs)

    def _abort_subs(self) -> None:
        for sub in list(self._subs):
            sub.abort_all()

    def hashes(self, ids: Sequence[int]) -> list[bytes]:
        return short_hashes(prefix_block_hashes(self.info.root_hash, ids, self.info.block_size))


class ReplicaSubmission(DeltaStream):
    """One API call's engine requests on the replicas: iterate for (choice index, delta); `close()` aborts."""

    def __init__(self, client: ReplicaClient, specs: list[tuple[list[int], SamplingParams, str]],
                 stream: bool) -> None:
        self._client, self._stream = client, stream
        self.request_ids = [rid for _, _, rid in specs]
        self.requests: list[RemoteRequest] = [RemoteRequest() for _ in specs]  # filled as each finishes
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = set(self.request_ids)
        self._accepted = [asyncio.get_running_loop().create_future() for _ in specs]
        self._aborting = False
        client._subs.add(self)
        self._tasks = [asyncio.ensure_future(self._pump(i, spec)) for i, spec in enumerate(specs)]

    async def started(self) -> None:
        await asyncio.gather(*self._accepted)

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._open.clear()
        self._client._subs.discard(self)

    def abort_all(self) -> None:
        self._aborting = True
        for t in self._tasks:
            t.cancel()

    def _accept(self, i: int, error: BaseException | None = None) -> None:
        f = self._accepted[i]
        if not f.done():
            f.set_result(None) if error is None else f.set_exception(error)

    async def _pump(self, i: int, spec: tuple[list[int], SamplingParams, str]) -> None:
        """Run engine request i on a replica, retrying on another while nothing reached the client."""
        from ray.serve.exceptions import BackPressureError

        c = self._client
        ids, params, rid = spec
        hashes = c.hashes(ids)
        held: list[StreamDelta] = []  # non-streamed: the deltas until the request finished
        delivered = False
        try:
            for attempt in range(MAX_ATTEMPTS):
                hint = RouteHint(hashes)
                gen = c.handle.generate.remote(ids, params, rid, route=hint)
                held.clear()
                try:
                    async for rec in gen:
                        if rec[0] == "error":
                            try:
                                raise_record(rec)
                            except Exception as e:
                                self._accept(i, e)
                            return
                        if rec[0] == "accepted":
                            self._accept(i)
                            continue
                        _, d, summary = rec
                        if summary is not None:
                            self.requests[i] = summary
                        if self._stream:
                            delivered = True
                            self._queue.put_nowait((i, d))
                        else:
                            held.append(d)
                        if d.finished:
                            for x in held:
                                self._queue.put_nowait((i, x))
                            return
                    detail = "its stream ended early"
                except asyncio.CancelledError:
                    gen.cancel()  # Serve cancels the replica's generator: the engine aborts the request
                    raise
                except BackPressureError:
                    self._accept(i, APIError(503, "every replica is full; retry later", "service_unavailable",
                                             None, 503, {"Retry-After": "1"}))
                    return
                except Exception as e:  # RayActorError: the replica died or became unreachable
                    detail = type(e).__name__
                    log.warning("kvlm: request %s lost its replica (%s)", rid, detail)
                finally:
                    if hint.replica_id is not None:
                        c.book.finished(hint.replica_id)
                if delivered or c.draining:
                    break
                c.book.count_retry()
                await asyncio.sleep(0.05 * (attempt + 1))
            err = _replica_lost(detail)
            self._accept(i, err)
            self._queue.put_nowait(err)
        except asyncio.CancelledError:
            if self._aborting:  # shutdown: what was held back, then the abort delta, as one engine does
                self._accept(i)
                for x in held:
                    self._queue.put_nowait((i, x))
                self._queue.put_nowait((i, StreamDelta(rid, "", [], True, "abort")))
            raise
        finally:
            c.release(1)
