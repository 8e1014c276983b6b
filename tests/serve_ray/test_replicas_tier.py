"""`kvlm serve --replicas 2 --kv-tier-dir D`: two replicas sharing one KV tier prefill each document once in
total, not once per replica, counted from each replica's own figures (`/metrics`, by replica and source).

Round-robin routing sends a document's second request to the other replica, whose pool never saw it: only
the shared tier (write-through, which sharing turns on) spares that prefill. And the prefix router, live:
a document that is in the shared tier and in neither replica's pool is routed by the replicas' own tier
reports (decision "tier" in /metrics) and loaded, not prefilled. The scoring itself is tested without Ray
in test_routing.py.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
from deps import need
from server_utils import ServerProcess

pytestmark = pytest.mark.slow
BLOCK = 16  # EngineConfig.block_size's default
WORDS = "river stone lamp garden copper violin harbor meadow lantern orbit signal marble thunder cedar".split()


def document(i: int) -> str:
    words = [WORDS[(i * 7 + j * (i + 3)) % len(WORDS)] for j in range(180)]
    return f"Document {i}. " + " ".join(words) + "\nSummary:"


def tier_files(d: Path) -> int:
    return sum(1 for p in d.iterdir() if p.name.endswith(".kvb"))


def by_replica(server: ServerProcess, name: str, source: str) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=5.0).text
    out = {}
    for m in re.finditer(rf'^{re.escape(name)}_total\{{([^}}]*)\}} ([0-9.e+-]+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("source", source) == source:
            out[labels["replica"]] = float(m.group(2))
    return out


def tier_decisions(server: ServerProcess) -> float:
    return server.metrics().get('kvlm:router_decisions_total{decision="tier"}', 0.0)


def test_router_decides_tier_for_a_document_only_in_the_shared_tier(smollm2_gguf, tmp_path):
    """The tier is filled before the server starts (another process, as a restart would leave it), so the
    replicas' pools are empty: only their tier reports can rank one above the other."""
    need("ray")
    from kvlm import LLM, SamplingParams

    tier = tmp_path / "tier"
    writer = LLM(smollm2_gguf, max_model_len=1024, kv_tier_dir=str(tier), kv_tier_write_through=True)
    ids = writer.tokenizer.encode(document(5), add_special_tokens=False)
    writer.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    writer.llm_engine.flush_kv_tier()
    blocks = tier_files(tier)
    assert blocks == len(ids) // BLOCK and blocks >= 8
    del writer
    with ServerProcess(smollm2_gguf, "--replicas", "2", "--threads", "1", "--router", "prefix",
                       "--served-model-name", "smollm2-135m", "--max-model-len", "1024", "--kv-cache-memory", "64MiB",
                       "--kv-tier-dir", str(tier), "--kv-tier-bytes", "1GiB", startup_timeout=240) as server:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # both replicas have reported their tier (every 0.5 s)
            sizes = [v for k, v in server.metrics().items() if k.startswith("kvlm:kv_tier_size_bytes{")]
            if len(sizes) == 2 and min(sizes) > 0:
                break
            time.sleep(0.2)
        assert len(sizes) == 2 and min(sizes) > 0, sizes
        assert tier_decisions(server) == 0
        r = httpx.post(server.url + "/v1/completions", timeout=300,
                       json={"model": "smollm2-135m", "prompt": ids, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        want = min(blocks, (len(ids) - 1) // BLOCK) * BLOCK  # the last token always runs
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the replica's counters arrive with its next report
            from_tier = by_replica(server, "kvlm:prefix_cache_source_tokens", "tier")
            if sum(from_tier.values()) >= want:
                break
            time.sleep(0.2)
        assert tier_decisions(server) == 1, server.metrics()
        assert sorted(from_tier.values()) == [0.0, float(want)], from_tier
        miss = by_replica(server, "kvlm:prefix_cache_source_tokens", "miss")
        assert sum(miss.values()) == len(ids) - want


def test_two_replicas_sharing_a_tier_prefill_each_document_once(smollm2_gguf, tmp_path):
    need("ray")
    tier = tmp_path / "tier"
    with ServerProcess(smollm2_gguf, "--replicas", "2", "--threads", "1", "--router", "round-robin",
                       "--served-model-name", "smollm2-135m",
                       "--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--kv-tier-dir", str(tier),
                       "--kv-tier-bytes", "1GiB", startup_timeout=240) as server:
        want_miss, stored = 0, 0
        for i in range(3):
            for _ in range(2):  # round-robin: the second request goes to the other replica
                r = httpx.post(server.url + "/v1/completions", timeout=300,
                               json={"model": "smollm2-135m", "prompt": document(i), "max_tokens": 2, "temperature": 0})
                assert r.status_code == 200, r.text
                p = r.json()["usage"]["prompt_tokens"]
                deadline = time.monotonic() + 30
                while tier_files(tier) < stored + p // BLOCK and time.monotonic() < deadline:
                    time.sleep(0.05)  # write-through is asynchronous: the next request comes after it landed
                stored = max(stored, tier_files(tier))
            want_miss += p + (p - (p - 1) // BLOCK * BLOCK)  # once whole, then only the last block's rest
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # replicas report every 0.5 s
            reqs = by_replica(server, "kvlm:request_finished", "")
            if len(reqs) == 2 and sum(reqs.values()) == 6:
                break
            time.sleep(0.2)
        assert sorted(reqs.values()) == [3.0, 3.0], f"round-robin sent 3 requests to each replica: {reqs}"
        miss = by_replica(server, "kvlm:prefix_cache_source_tokens", "miss")
        from_tier = by_replica(server, "kvlm:prefix_cache_source_tokens", "tier")
        assert sum(miss.values()) == want_miss, f"each document prefilled once in total: {miss}"
        assert sum(from_tier.values()) > 0 and all(v > 0 for v in miss.values()), (miss, from_tier)
        assert stored >= 3 * (p // BLOCK), "the tier holds every document's prompt blocks"
