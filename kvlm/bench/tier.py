"""`kvlm bench tier`: what the disk KV tier (`--kv-tier-dir`) saves on a RAG-like workload, side by side.

Documents (`--docs`, default 40, of `--doc-tokens`, default 2000, seeded random token ids) are asked about
by questions (`--questions`, default 3 per document) that revisit them in a skewed order (document i with
weight 1 / (i + 1)); a question is its document followed by a short question. Two engines with the same
KV pool, sized to hold `--pool-docs` documents (default 8), run the questions one at a time, alternating
question by question so both see the same machine load:

* `pool`: prefix caching only: a document evicted from the pool is prefilled again;
* `tier`: the same plus a tier directory (write-through on unless `--no-write-through`): an evicted
  document's blocks come back from disk.

Then `restart`: a new engine on the tier directory asks one question per document (the first pass over
the documents after a restart), against the pool engine's TTFT for questions that found their document in
the pool (warm) and those that prefilled it (cold).

Reported: prefill tokens, TTFT p50/p95 per engine and per hit kind (pool / tier / miss), and the tier's
load throughput (tokens/s and MB/s of files read and validated) against recompute (prefill tokens/s of the
misses). One JSON line at the end; `--plot FILE` draws TTFT by hit kind.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from typing import Any

from kvlm.bench.common import Bench, add_model_args, run_header, standalone
from kvlm.bench.plotting import new_figure, save_figure

KINDS = ("pool", "tier", "miss")


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _ask(llm: Any, ids: list[int]) -> dict[str, Any]:
    """One greedy question, alone: its TTFT, prefill and where its document's K/V came from."""
    from kvlm.sampling_params import SamplingParams

    eng = llm.llm_engine
    req = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while not req.is_finished:
        eng.step()
    m = req.metrics
    kind = "tier" if m.num_tier_tokens else "pool" if m.num_cached_tokens * 2 >= m.num_prompt_tokens else "miss"
    return {"ttft_s": m.ttft, "prefilled": m.num_prefilled_tokens, "cached": m.num_cached_tokens,
            "tier_tokens": m.num_tier_tokens, "kind": kind, "tokens": req.output_token_ids}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = [r["ttft_s"] for r in rows]
    out: dict[str, Any] = {"questions": len(rows), "prefilled_tokens": sum(r["prefilled"] for r in rows),
                           "tier_tokens": sum(r["tier_tokens"] for r in rows),
                           "ttft_p50_s": _percentile(ttft, 0.5), "ttft_p95_s": _percentile(ttft, 0.95),
                           "seconds": sum(ttft)}
    for kind in KINDS:
        xs = [r["ttft_s"] for r in rows if r["kind"] == kind]
        out[kind] = {"n": len(xs), "ttft_p50_s": _percentile(xs, 0.5), "ttft_p95_s": _percentile(xs, 0.95)}
    return out


def run(model: str, threads: int, docs: int, doc_tokens: int, questions: int, pool_docs: int,
        write_through: bool, seed: int) -> dict[str, Any]:
    from kvlm.llm import LLM

    probe = LLM(model, num_threads=threads, adaptive_threads=False)
    bpt, bs, tok = probe.llm_engine.kv_bytes_per_token, probe.llm_engine.block_manager.block_size, probe.tokenizer
    vocab = probe.llm_engine.model_config.vocab_size
    del probe
    rng = random.Random(seed)
    documents = [[rng.randrange(100, vocab - 100) for _ in range(doc_tokens)] for _ in range(docs)]
    order = rng.choices(range(docs), weights=[1 / (i + 1) for i in range(docs)], k=questions)
    asks = [documents[d] + tok.encode(f"\nQuestion {q}: what does part {q % 7} say?", add_special_tokens=False)
            for q, d in enumerate(order)]
    pool_bytes = pool_docs * (-(-(doc_tokens + 32) // bs) + 1) * bs * bpt
    out: dict[str, Any] = {**run_header("tier", model, threads), "docs": docs, "doc_tokens": doc_tokens,
                           "questions": questions, "pool_docs": pool_docs, "pool_bytes": pool_bytes,
                           "kv_bytes_per_token": bpt, "write_through": write_through, "seed": seed}
    common = dict(num_threads=threads, adaptive_threads=False, kv_cache_memory=pool_bytes)
    with tempfile.TemporaryDirectory(prefix="kvlm-tier-bench-") as tier_dir:
        engines = {"pool": LLM(model, **common),
                   "tier": LLM(model, **common, kv_tier_dir=tier_dir, kv_tier_write_through=write_through)}
        rows: dict[str, list[dict[str, Any]]] = {"pool": [], "tier": []}
        t0 = time.perf_counter()
        for i, ids in enumerate(asks):  # alternate which engine goes first, question by question
            for name in (("pool", "tier") if i % 2 == 0 else ("tier", "pool")):
                rows[name].append(_ask(engines[name], ids))
        out["seconds"] = time.perf_counter() - t0
        out["same_tokens"] = all(a["tokens"] == b["tokens"] for a, b in zip(rows["pool"], rows["tier"]))
        tier_engine = engines["tier"].llm_engine
        tier_engine.flush_kv_tier()
        st = tier_engine.tier.tier.stats  # type: ignore[union-attr]
        out["tier_stats"] = st.as_dict()
        del engines, tier_engine
        restarted = LLM(model, **common, kv_tier_dir=tier_dir)
        first = {d: asks[order.index(d)] for d in sorted(set(order))}
        again = [_ask(restarted, ids) for ids in first.values()]
        restarted.llm_engine.flush_kv_tier()  # evicted blocks still queued: written before tier_dir goes
        rst = restarted.llm_engine.tier.tier.stats  # type: ignore[union-attr]
        out["restart_tier_stats"] = rst.as_dict()
    for name in ("pool", "tier"):
        out[name] = _summary(rows[name])
        out[name]["ttft_by_question"] = [[r["kind"], r["ttft_s"]] for r in rows[name]]
    out["restart"] = _summary(again)
    out["restart"]["ttft_by_question"] = [[r["kind"], r["ttft_s"]] for r in again]
    misses = [r for r in rows["pool"] if r["kind"] == "miss"]
    recompute = sum(r["prefilled"] for r in misses) / sum(r["ttft_s"] for r in misses) if misses else None
    loads = [st, rst]
    load_s, load_bytes = sum(s.load_s for s in loads), sum(s.hit_bytes for s in loads)
    load_tokens = sum(s.hit_blocks for s in loads) * bs
    out["recompute_tokens_per_s"] = recompute
    out["tier_load_tokens_per_s"] = load_tokens / load_s if load_s else None
    out["tier_load_mb_per_s"] = load_bytes / 2**20 / load_s if load_s else None
    p50 = {k: out["tier"][k]["ttft_p50_s"] for k in KINDS}
    out["ttft_p50_speedup_tier_hit_vs_miss"] = (p50["miss"] / p50["tier"]) if p50["miss"] and p50["tier"] else None
    if p50["miss"] is None:  # every tier-engine question hit: compare with the pool engine's misses
        miss = out["pool"]["miss"]["ttft_p50_s"]
        out["ttft_p50_speedup_tier_hit_vs_miss"] = miss / p50["tier"] if miss and p50["tier"] else None
    return out


def print_table(d: dict[str, Any]) -> None:
    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    print(f"{d['docs']} documents x {d['doc_tokens']} tokens, {d['questions']} questions, a pool of "
          f"{d['pool_docs']} documents ({d['pool_bytes'] / 2**20:.0f} MiB); same tokens: {d['same_tokens']}")
    print(f"{'engine':<9}{'prefilled':>11}{'tier tok':>10}{'TTFT p50':>10}{'p95':>8}   "
          + "   ".join(f"{k}: n p50" for k in KINDS))
    for name in ("pool", "tier", "restart"):
        r = d[name]
        kinds = "   ".join(f"{k}: {r[k]['n']} {s(r[k]['ttft_p50_s'])}" for k in KINDS)
        print(f"{name:<9}{r['prefilled_tokens']:>11}{r['tier_tokens']:>10}{s(r['ttft_p50_s']):>10}"
              f"{s(r['ttft_p95_s']):>8}   {kinds}")
    # a ratio or a rate with nothing behind it (no tier hit, no miss) is "not measured", never 0
    rec, load = d["recompute_tokens_per_s"], d["tier_load_tokens_per_s"]
    speedup = d["ttft_p50_speedup_tier_hit_vs_miss"]
    load_s = "not measured (no tier hits)" if load is None else \
        f"{load:.0f} tok/s ({d['tier_load_mb_per_s']:.0f} MB/s)"
    rec_s = "not measured (no misses)" if rec is None else f"{rec:.0f} tok/s"
    speedup_s = "not measured (no tier hits or no misses)" if speedup is None else f"{speedup:.1f}x"
    print(f"tier load {load_s} vs recompute {rec_s}; TTFT p50 tier hit vs miss: {speedup_s}")


def plot(d: dict[str, Any], path: str) -> str | None:
    fig, ax = new_figure(1, 7.0, 4.0)
    colors = {"pool": "tab:green", "tier": "tab:blue", "miss": "tab:red"}
    for x, name in enumerate(("pool", "tier", "restart")):
        points = d[name]["ttft_by_question"]
        for kind in KINDS:
            xs = [x - 0.3 + 0.6 * j / max(1, len(points)) for j, (k, _) in enumerate(points) if k == kind]
            ys = [t for k, t in points if k == kind]
            if xs:
                ax.scatter(xs, ys, s=8, color=colors[kind], label=kind if x == 0 or kind == "tier" else None)
    ax.set_xticks([0, 1, 2], ["prefix cache only", "with the tier", "tier, after a restart"])
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"TTFT by hit kind: {d['docs']} docs x {d['doc_tokens']} tokens, pool of {d['pool_docs']}")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys())
    return save_figure(fig, path)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--docs", type=int, default=40, help="documents")
    p.add_argument("--doc-tokens", type=int, default=2000, help="tokens per document")
    p.add_argument("--questions", type=int, default=None, help="questions (default: 3 per document)")
    p.add_argument("--pool-docs", type=int, default=8, help="documents the KV pool holds")
    p.add_argument("--no-write-through", action="store_true",
                   help="store only blocks the pool evicts (a restart then misses what the pool held)")
    p.add_argument("--seed", type=int, default=0)
    add_model_args(p)
    p.add_argument("--plot", metavar="FILE", default=None, help="write a PNG of TTFT by hit kind")


def run_args(a: argparse.Namespace) -> dict[str, Any]:
    if min(a.docs, a.doc_tokens, a.pool_docs) < 1 or (a.questions is not None and a.questions < 1):
        raise ValueError("--docs, --doc-tokens, --pool-docs and --questions must be at least 1")
    return run(a.model, a.threads, a.docs, a.doc_tokens, a.questions or 3 * a.docs, a.pool_docs,
               not a.no_write_through, a.seed)


BENCH = Bench("tier", "disk KV tier: RAG-like documents revisited, TTFT with and without the tier, after a restart",
              add_args, run_args, print_table, plot)

if __name__ == "__main__":
    standalone(BENCH)
