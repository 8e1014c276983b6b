"""`/metrics` of a replicated `kvlm serve`: every replica's series with a `replica` label, and the router's.

Built at each scrape from the `RoutingBook`: replicas' own reports (`EngineReplica.record_routing_stats`,
polled by Serve every `request_routing_stats_period_s`, so gauges are at most that old) and the router's
counters. Names are the single server's (`server.metrics`), plus `kvlm:router_*` and `kvlm:replicas_*`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvlm.serve_ray.routing import RoutingBook

_GAUGES = (("num_requests_running", "running", "Requests in the running batch."),
           ("num_requests_waiting", "waiting", "Requests waiting to be scheduled."),
           ("kv_cache_used_blocks", "kv_used_blocks", "KV-cache blocks held by requests."),
           ("kv_cache_total_blocks", "kv_total_blocks", "KV-cache blocks in the pool."),
           ("prefix_cache_blocks", "cached_blocks", "Blocks the router believes the replica's prefix cache holds."),
           ("replica_in_flight", "in_flight", "Requests this server has sent to the replica, not yet finished."))
_COUNTERS = (("prompt_tokens", "prompt_tokens", "Prompt tokens of finished requests."),
             ("generation_tokens", "generation_tokens", "Generated tokens of finished requests."),
             ("prefix_cache_queries", "prompt_tokens", "Prompt tokens looked up in the prefix cache."),
             ("prefix_cache_hits", "cached_tokens", "Prompt tokens found in the prefix cache."),
             ("num_preemptions", "preemptions", "Preemptions (by recompute)."),
             ("request_finished", "requests", "Finished requests."),
             ("spec_decode_num_drafts", "spec_drafts", "Verifications of drafts."),
             ("spec_decode_num_draft_tokens", "spec_draft_tokens", "Draft tokens verified."),
             ("spec_decode_num_accepted_tokens", "spec_accepted_tokens", "Draft tokens accepted."))


class _Collector:
    def __init__(self, book: RoutingBook, model_name: str, target_replicas: int) -> None:
        self.book, self.model_name, self.target = book, model_name, target_replicas

    def collect(self) -> Iterator[Metric]:
        snap = self.book.snapshot()
        reps = snap["replicas"]
        labels = ["model_name", "replica"]
        for name, key, doc in _GAUGES:
            g = GaugeMetricFamily(f"kvlm:{name}", doc, labels=labels)
            for rid, s in sorted(reps.items()):
                g.add_metric([self.model_name, rid], float(s.get(key, 0)))
            yield g
        usage = GaugeMetricFamily("kvlm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                                  labels=labels)
        for rid, s in sorted(reps.items()):
            usage.add_metric([self.model_name, rid], s.get("kv_used_blocks", 0) / max(1, s.get("kv_total_blocks", 1)))
        yield usage
        for name, key, doc in _COUNTERS:
            c = CounterMetricFamily(f"kvlm:{name}", doc, labels=labels)
            for rid, s in sorted(reps.items()):
                c.add_metric([self.model_name, rid], float(s.get(key, 0)))
            yield c
        src = CounterMetricFamily("kvlm:prefix_cache_source_tokens", "Prompt tokens by where their K/V came "
                                  "from: pool, tier (--kv-tier-dir) or miss (prefilled).", labels=[*labels, "source"])
        for rid, s in sorted(reps.items()):
            tier, cached = s.get("tier_tokens", 0), s.get("cached_tokens", 0)
            for source, n in (("pool", cached - tier), ("tier", tier), ("miss", s.get("prompt_tokens", 0) - cached)):
                src.add_metric([self.model_name, rid, source], float(n))
        yield src
        for key, doc in (("size_bytes", "Bytes of the tier directory's block files (shared by replicas using it)."),
                         ("stored_blocks", "Blocks this replica wrote to the tier."),
                         ("evicted_files", "Tier files this replica removed to keep the byte bound.")):
            g = GaugeMetricFamily(f"kvlm:kv_tier_{key}", doc, labels=labels)
            for rid, s in sorted(reps.items()):
                if "tier_id" in s:
                    g.add_metric([self.model_name, rid], float(s.get(f"tier_{key}", 0)))
            yield g
        d = CounterMetricFamily("kvlm:router_decisions", "Requests routed, by why that replica: prefix (longest "
                                "cached prefix), tier (the best one holds it in its KV tier only), "
                                "load_fallback (it was too busy: power of two choices), no_prefix "
                                "(no replica held any block), pow2, round_robin.", labels=["model_name", "decision"])
        for k, v in sorted(snap["decisions"].items()):
            d.add_metric([self.model_name, k], float(v))
        yield d
        r = CounterMetricFamily("kvlm:router_retries", "Requests sent again after their replica was lost.",
                                labels=["model_name"])
        r.add_metric([self.model_name], float(snap["retries"]))
        yield r
        n = GaugeMetricFamily("kvlm:replicas_running", "Replicas serving now.", labels=["model_name"])
        n.add_metric([self.model_name], float(len(reps)))
        yield n
        t = GaugeMetricFamily("kvlm:replicas_target", "Replicas wanted (the minimum when autoscaling).",
                              labels=["model_name"])
        t.add_metric([self.model_name], float(self.target))
        yield t


class ReplicaMetrics:
    """`render()` as `server.metrics.ServerMetrics` has it, over every replica."""

    def __init__(self, book: RoutingBook, model_name: str, target_replicas: int) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(book, model_name, target_replicas))

    def render(self) -> bytes:
        return generate_latest(self.registry)
