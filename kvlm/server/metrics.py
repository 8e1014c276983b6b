"""Prometheus metrics of the server, under vLLM's names with the `kvlm:` prefix and a `model_name` label.

Gauges (running, waiting, KV usage) are read from the loop thread's published `EngineLoad` when
`/metrics` is scraped (never from the engine, which only the loop thread touches); counters and
histograms are updated by the engine loop thread when a request produces a token or finishes. Existing
vLLM dashboards work after replacing `vllm:` with `kvlm:`. Intervals use `time.perf_counter` of one process.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from kvlm.request import Request
from kvlm.server.async_engine import AsyncEngine

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)


class ServerMetrics:
    """One registry per server (tests run several in one process). Built on the server's `AsyncEngine`,
    whose hooks it takes (`on_token`, `on_finish`: they run on the loop thread)."""

    def __init__(self, aengine: AsyncEngine, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        lbl = {"model_name": model_name}
        self._name = model_name

        def gauge(name: str, doc: str, fn) -> None:
            Gauge(name, doc, ["model_name"], registry=r).labels(**lbl).set_function(fn)

        gauge("kvlm:num_requests_running", "Requests in the running batch.", lambda: aengine.load.num_running)
        gauge("kvlm:num_requests_waiting", "Requests waiting to be scheduled.", lambda: aengine.load.num_waiting)
        gauge("kvlm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
              lambda: aengine.load.kv_used_blocks / aengine.load.kv_total_blocks)
        gauge("kvlm:kv_cache_used_blocks", "KV-cache blocks held by requests.", lambda: aengine.load.kv_used_blocks)
        gauge("kvlm:kv_cache_total_blocks", "KV-cache blocks in the pool.", lambda: aengine.load.kv_total_blocks)
        # Counted from the pool's tensors (codes and scales for int8 / int4): fixed once the engine exists.
        bpt, bs = aengine.engine.kv_bytes_per_token, aengine.engine.block_manager.block_size
        gauge("kvlm:kv_cache_bytes_per_token", "KV-cache bytes per token slot, counted from the pool's tensors.",
              lambda: bpt)
        gauge("kvlm:kv_cache_used_bytes", "KV-cache bytes in the blocks requests hold.",
              lambda: aengine.load.kv_used_blocks * bs * bpt)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, ["model_name", *labels], registry=r)

        self.prompt_tokens = counter("kvlm:prompt_tokens", "Prompt tokens of finished requests.").labels(**lbl)
        self.generation_tokens = counter("kvlm:generation_tokens", "Generated tokens.").labels(**lbl)
        self.preemptions = counter("kvlm:num_preemptions", "Preemptions (by recompute).").labels(**lbl)
        self.evicted = counter("kvlm:kv_evicted_tokens",
                               "Tokens whose K/V a bounded cache (--max-kv-tokens) gave back.").labels(**lbl)
        self.prefix_queries = counter("kvlm:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.").labels(**lbl)
        self.prefix_hits = counter("kvlm:prefix_cache_hits", "Prompt tokens found in the prefix cache.").labels(**lbl)
        # The same tokens split by where their K/V came from: the pool, the disk tier (--kv-tier-dir) or
        # nowhere (computed); bytes = tokens x the pool's bytes per token.
        self.prefix_source = counter("kvlm:prefix_cache_source_tokens",
                                     "Prompt tokens by where their K/V came from: pool, tier or miss.", ("source",))
        self.prefix_source_bytes = counter("kvlm:prefix_cache_source_bytes",
                                           "K/V bytes of prompt tokens by source: pool, tier or miss.", ("source",))
        self._bpt = bpt
        pt = aengine.engine.tier
        if pt is not None:  # the tier's own figures (kv_cache/tier.py TierStats), read when scraped
            st = pt.tier.stats
            for key, doc in (("size_bytes", "Bytes of the tier directory's block files (last scan + writes since)."),
                             ("hit_blocks", "Blocks loaded from the tier into the pool."),
                             ("stored_blocks", "Blocks this process wrote to the tier."),
                             ("dropped_blocks", "Blocks not stored: the writer's queue was full or storing was off."),
                             ("evicted_files", "Tier files this process removed to keep the byte bound."),
                             ("corrupt_files", "Tier files removed because they failed validation.")):
                gauge(f"kvlm:kv_tier_{key}", doc, lambda key=key: getattr(st, key))
            gauge("kvlm:kv_tier_load_bytes_per_second", "Tier read throughput (files read and validated).",
                  lambda: st.hit_bytes / st.load_s if st.load_s else 0.0)
            gauge("kvlm:kv_tier_store_bytes_per_second", "Tier write throughput (serialize, write, fsync, rename).",
                  lambda: st.stored_bytes / st.store_s if st.store_s else 0.0)
            gauge("kvlm:kv_tier_storing", "1 while the tier stores blocks (0 after a write failed).",
                  lambda: float(pt.tier.writable))
        self.success = counter("kvlm:request_success", "Finished requests by finish reason.", ("finished_reason",))
        self.spec = None  # speculative decoding's counters, vLLM's names (only when it is on)
        if aengine.engine.speculator is not None:
            self.spec = (counter("kvlm:spec_decode_num_drafts", "Verifications of drafts.").labels(**lbl),
                         counter("kvlm:spec_decode_num_draft_tokens", "Draft tokens verified.").labels(**lbl),
                         counter("kvlm:spec_decode_num_accepted_tokens", "Draft tokens accepted.").labels(**lbl),
                         counter("kvlm:spec_decode_num_accepted_tokens_per_pos",
                                 "Draft tokens accepted, by their position among a verification's drafts.",
                                 ("position",)))

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**lbl)

        self.ttft = hist("kvlm:time_to_first_token_seconds", "Arrival to first token.")
        self.itl = hist("kvlm:inter_token_latency_seconds", "Time between two tokens of one request.")
        self.e2e = hist("kvlm:e2e_request_latency_seconds", "Arrival to finish.")
        self.queue_time = hist("kvlm:request_queue_time_seconds", "Arrival to first scheduled.")
        self.prefill_time = hist("kvlm:request_prefill_time_seconds", "First scheduled to first token.")
        self.decode_time = hist("kvlm:request_decode_time_seconds", "First token to finish.")
        aengine.on_token, aengine.on_finish = self.on_token, self.on_finish

    # Called on the engine loop thread.
    def on_token(self, req: Request, now: float, last: float | None) -> None:
        self.generation_tokens.inc()
        if last is not None:
            self.itl.observe(now - last)

    def on_finish(self, req: Request) -> None:
        m = req.metrics
        self.prompt_tokens.inc(m.num_prompt_tokens)
        if req.pooling is None:  # an embedding never looks the prefix cache up (engine/pooling.py)
            self.prefix_queries.inc(m.num_prompt_tokens)
            self.prefix_hits.inc(m.num_cached_tokens)
            split = {"pool": m.num_cached_tokens - m.num_tier_tokens, "tier": m.num_tier_tokens,
                     "miss": m.num_prompt_tokens - m.num_cached_tokens}
            for source, n in split.items():
                self.prefix_source.labels(model_name=self._name, source=source).inc(n)
                self.prefix_source_bytes.labels(model_name=self._name, source=source).inc(n * self._bpt)
        self.preemptions.inc(m.num_preemptions)
        self.evicted.inc(m.num_evicted_tokens)
        if self.spec is not None and m.spec_num_drafts:
            drafts, draft_tokens, accepted, per_pos = self.spec
            drafts.inc(m.spec_num_drafts)
            draft_tokens.inc(m.spec_num_draft_tokens)
            accepted.inc(m.spec_num_accepted_tokens)
            for pos, n in enumerate(m.spec_accepted_per_pos):
                per_pos.labels(model_name=self._name, position=str(pos)).inc(n)
        self.success.labels(model_name=self._name, finished_reason=req.finish_reason or "abort").inc()
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
            if m.first_token_time is not None:
                self.decode_time.observe(m.finished_time - m.first_token_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
