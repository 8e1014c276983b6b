"""`EngineReplica`: the body of one Ray Serve replica, one process holding one `Engine`.

It runs the same `AsyncEngine` loop thread as a single `kvlm serve` (so batching, prefix caching and
aborts behave exactly as there) and streams each request back as records:
    ("accepted", replica id)          the engine took the request (the client may stop retrying elsewhere)
    ("delta", StreamDelta, summary)   summary: a `RemoteRequest` on the request's last delta, else None
    ("error", kind, message, param)   the engine refused it (`records.error_record`); nothing else follows
When the caller goes away (client disconnect, the serving process cancels), Serve cancels this generator
and its `finally` aborts the engine request, which frees its blocks at the next step.

`record_routing_stats` (Serve polls it every `request_routing_stats_period_s`) reports the pool's cached
block hashes (8-byte prefixes) for the router, with the KV tier's (`--kv-tier-dir`) files when there is one,
plus the load and counters `/metrics` shows per replica.
Ray is imported only inside methods, to name this replica; the class itself is plain Python.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from typing import Any

from kvlm.config import EngineConfig
from kvlm.engine.engine import Engine
from kvlm.request import Request
from kvlm.sampling_params import SamplingParams
from kvlm.serve_ray.records import RemoteRequest, ReplicaInfo, error_record
from kvlm.serve_ray.routing import short_hashes
from kvlm.server.async_engine import AsyncEngine

TIER_LIST_PERIOD_S = 1.0  # how often a report lists the KV tier's directory again


class EngineReplica:
    def __init__(self, model: str, engine_config: dict[str, Any]) -> None:
        self.engine = Engine(model, EngineConfig(**engine_config), quiet=True)
        self.aengine = AsyncEngine(self.engine)
        self.totals = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "tier_tokens": 0, "generation_tokens": 0,
                       "preemptions": 0, "spec_drafts": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0}
        self.aengine.on_finish = self._count  # loop thread
        self._seq = 0
        self._tier_listed: tuple[float, list[bytes]] = (-TIER_LIST_PERIOD_S, [])
        self.replica_id = _replica_id()
        self.aengine.start()

    def _count(self, req: Request) -> None:
        t, m = self.totals, req.metrics
        t["requests"] += 1
        t["prompt_tokens"] += m.num_prompt_tokens
        t["cached_tokens"] += m.num_cached_tokens
        t["tier_tokens"] += m.num_tier_tokens  # (part of cached_tokens: loaded from the KV tier)
        t["generation_tokens"] += req.num_output_tokens
        t["preemptions"] += m.num_preemptions
        t["spec_drafts"] += m.spec_num_drafts  # speculative decoding (zeros when it is off)
        t["spec_draft_tokens"] += m.spec_num_draft_tokens
        t["spec_accepted_tokens"] += m.spec_num_accepted_tokens

    def describe(self) -> ReplicaInfo:
        e, bm = self.engine, self.engine.block_manager
        return ReplicaInfo(e.tokenizer, e.model_config, e.max_model_len, e.model_path, bm.block_size,
                           bm.num_blocks, bm.root_hash, e.describe_cache(), e.config.max_kv_tokens)

    async def generate(self, ids: list[int], params: SamplingParams, request_id: str,
                       route: Any = None) -> AsyncIterator[tuple[Any, ...]]:
        """Run one request; `route` is the router's hint (read by the router in the serving process)."""
        try:
            sub = await self.aengine.submit([(ids, params, request_id)])
        except Exception as e:  # refused by the engine: a bad id, too long, the queue is full
            yield error_record(e)
            return
        try:
            yield ("accepted", self.replica_id)
            async for _, d in sub:
                yield ("delta", d, RemoteRequest.of(sub.requests[0]) if d.finished else None)
        finally:
            sub.close()

    def record_routing_stats(self) -> dict[str, Any]:
        bm, load = self.engine.block_manager, self.aengine.load
        for _ in range(3):
            try:  # the loop thread may register a block meanwhile; a copy that raced is taken again
                hashes = short_hashes(list(bm.hash_to_block))
                break
            except RuntimeError:
                continue
        else:
            hashes = []
        self._seq += 1
        return {"seq": self._seq, "pid": os.getpid(), "num_blocks": bm.num_blocks, "hashes": hashes,
                "running": load.num_running, "waiting": self.aengine.num_waiting,
                "kv_used_blocks": load.kv_used_blocks, "kv_total_blocks": load.kv_total_blocks,
                **self._tier_report(), **self.totals}

    def _tier_report(self) -> dict[str, Any]:
        """The KV tier's files (hash prefixes, listed at most every `TIER_LIST_PERIOD_S`), which directory
        it is (replicas sharing one report the same `tier_id`) and its counters; {} without a tier."""
        pt = self.engine.tier
        if pt is None:
            return {}
        now = time.monotonic()
        if now - self._tier_listed[0] >= TIER_LIST_PERIOD_S:
            try:
                self._tier_listed = (now, short_hashes(pt.tier.names()))
            except OSError:  # the directory went away: report no files, serve on
                self._tier_listed = (now, [])
        st = pt.tier.stats
        return {"tier_id": pt.tier.tier_id, "tier_write_through": pt.write_through_on,
                "tier_hashes": self._tier_listed[1], "tier_size_bytes": st.size_bytes,
                "tier_stored_blocks": st.stored_blocks, "tier_evicted_files": st.evicted_files}

    def pid(self) -> int:
        return os.getpid()

    def __del__(self) -> None:
        aengine = getattr(self, "aengine", None)
        if aengine is not None:
            aengine.stop(1.0)


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not inside a Serve replica (a test builds one directly)
        return f"pid{os.getpid()}"
