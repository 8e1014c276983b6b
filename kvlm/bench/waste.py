"""`kvlm bench waste`: what decoding without a KV cache wastes, and when the cache does not pay.

For output lengths n after a short prompt of P tokens it reports, with and without the cache:

* tokens processed by the model (counted, not measured):
    no cache: step s (s = 0..n-1) recomputes the whole sequence, P + s tokens, so n*P + n(n-1)/2;
    cache:    the prompt once, then one token per step; the last sampled token is never fed: P + n - 1.
* estimated FLOPs (`forward_flops`, shared with `kvlm bench latency`):
    2 x N_params x tokens  +  4 x layers x (heads x head_dim) x sum over tokens of its context length,
  the first term being the weight matmuls (the usual 2N per token; it counts the tied embedding /
  lm_head once per token although kvlm applies lm_head only to the sampled row), the second QK^T and
  softmax(.)V: 2 matmuls x 2 FLOPs per multiply-add per key. A token at 0-based position p attends
  to p + 1 keys, so a pass over positions 0..T-1 has context sum T(T+1)/2.
* measured seconds from request arrival to the n-th token. Greedy decoding with ignore_eos makes the
  first n steps of one long generation exactly a generation with max_tokens = n, so a single run
  per mode gives every n (the cached run is repeated and the best time per n kept).
* whether both modes produced identical tokens (greedy: they must).

The no-cache run is quadratic, so it stops at `--no-cache-seconds`; longer n are reported as not
measured (their counts and FLOPs are still exact). n = 1 (prefill-only: scoring, classification,
one-token answers) is always included: both modes do the same single prefill, so the speed-up is ~1
there; the cache pays only from the second output token on. The memory side: the cache holds
(P + n - 1) x kv_bytes_per_token bytes; it outgrows the float32 weights at
weight_bytes / kv_bytes_per_token tokens of context.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

from kvlm.bench.common import (
    DEFAULT_MODEL,
    Bench,
    add_model_args,
    log,
    prompt_ids,
    run_header,
    standalone,
)
from kvlm.bench.plotting import fmt_bytes, new_figure, save_figure


def forward_flops(cfg: Any, num_tokens: int, context_sum: int) -> float:
    """Estimated FLOPs of forward passes over `num_tokens` tokens whose context lengths sum to
    `context_sum` (see the module docstring for the formula)."""
    attn_width = cfg.num_attention_heads * cfg.head_dim
    return 2.0 * cfg.num_parameters * num_tokens + 4.0 * cfg.num_hidden_layers * attn_width * context_sum


def tokens_processed(prompt_len: int, n: int, cache: bool) -> tuple[int, int]:
    """(tokens fed through the model, sum of their context lengths) to produce n tokens."""
    P = prompt_len
    if cache:
        T = P + n - 1  # positions 0..P+n-2, each computed exactly once
        return T, T * (T + 1) // 2
    # step s runs positions 0..P+s-1: P+s tokens with context sum (P+s)(P+s+1)/2
    return sum(P + s for s in range(n)), sum((P + s) * (P + s + 1) // 2 for s in range(n))


def timed_generation(llm: Any, ids: list[int], max_tokens: int,
                     budget_s: float | None = None) -> tuple[list[int], list[float]]:
    """Greedy generation of up to max_tokens tokens (ignore_eos), step by step: the tokens and the
    seconds from request arrival to each of them. Stops early (aborting the request) once budget_s
    has passed, so quadratic no-cache runs stay bounded."""
    from kvlm.sampling_params import SamplingParams

    eng = llm.llm_engine
    t0 = time.perf_counter()
    req = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    times: list[float] = []
    while not req.is_finished:
        for d in eng.step():
            if d.request_id == req.request_id:
                times.append(time.perf_counter() - t0)
        if budget_s is not None and not req.is_finished and time.perf_counter() - t0 > budget_s:
            eng.abort(req.request_id)
            break
    return req.output_token_ids[: len(times)], times


def run(model: str = DEFAULT_MODEL, threads: int = 2, prompt_len: int = 16,
        lengths: tuple[int, ...] = (16, 32, 64, 128, 256), repeats: int = 1, no_cache_seconds: float = 75.0,
        log: Callable[[str], None] = log) -> dict[str, Any]:
    import torch

    from kvlm.llm import LLM

    lengths = tuple(sorted({1, *lengths}))  # n = 1 is the break-even point: always measured
    n_max = lengths[-1]
    torch.set_num_threads(threads)
    llm = LLM(model, num_threads=threads, max_num_seqs=1, kv_cache_layout="contiguous",
              max_model_len=prompt_len + n_max + 1)
    eng = llm.llm_engine
    cfg = eng.model_config
    ids = prompt_ids(cfg.vocab_size, prompt_len)
    kv_per_token = eng.kv_bytes_per_token
    # kvlm holds the weights in the engine dtype (float32 by default: GGUF is dequantized at load)
    weight_bytes = cfg.num_parameters * (torch.finfo(eng.dtype).bits // 8)
    timed_generation(llm, ids, 4)  # warm-up: first-call allocations are not the cache's cost

    cached_tokens: list[int] = []
    cached_best: list[float] = []
    for r in range(repeats):
        toks, times = timed_generation(llm, ids, n_max)
        cached_tokens = toks
        cached_best = times if not cached_best else [min(a, b) for a, b in zip(cached_best, times)]
        log(f"  cache run {r + 1}/{repeats}: {n_max} tokens in {times[-1]:.2f} s")
    del llm, eng
    gc.collect()

    nc = LLM(model, num_threads=threads, max_num_seqs=1, enable_kv_cache=False)
    timed_generation(nc, ids, 2)
    nc_tokens, nc_times = timed_generation(nc, ids, n_max, budget_s=no_cache_seconds)
    log(f"  no-cache run: {len(nc_times)} tokens in {nc_times[-1]:.2f} s"
        + ("" if len(nc_times) == n_max else f" (stopped at the {no_cache_seconds:g} s budget)"))
    del nc
    gc.collect()

    rows = []
    for n in lengths:
        tc, cc = tokens_processed(prompt_len, n, cache=True)
        tn, cn = tokens_processed(prompt_len, n, cache=False)
        measured = n <= len(nc_times)
        sec_c = cached_best[n - 1]
        sec_n = nc_times[n - 1] if measured else None
        rows.append({
            "n": n, "tokens_cache": tc, "tokens_no_cache": tn,
            "flops_cache": forward_flops(cfg, tc, cc), "flops_no_cache": forward_flops(cfg, tn, cn),
            "seconds_cache": sec_c, "seconds_no_cache": sec_n,
            "speedup": sec_n / sec_c if sec_n else None,
            "token_ratio": tn / tc,
            "identical": cached_tokens[:n] == nc_tokens[:n] if measured else None,
            "kv_bytes": tc * kv_per_token,
            "kv_vs_weights": tc * kv_per_token / weight_bytes,
        })
    # Why the speed-up is far below the token ratio: recomputation runs as batched prefill (many tokens
    # per weight read: compute-bound), cached decode as one token per weight read (memory-bound).
    last = max((r for r in rows if r["seconds_no_cache"] is not None), key=lambda r: r["n"])
    doc = run_header("waste", model, threads)
    doc.update({
        "prompt_len": prompt_len, "lengths": list(lengths), "repeats": repeats,
        "no_cache_seconds_budget": no_cache_seconds, "no_cache_tokens_measured": len(nc_times),
        "parameters": cfg.num_parameters, "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token,
        "kv_outgrows_weights_at_tokens": weight_bytes // kv_per_token + 1,  # first context with KV > weights
        "flops_formula": "2*params*tokens + 4*layers*heads*head_dim*sum(context)",
        "break_even_speedup": rows[0]["speedup"],
        "all_identical": all(r["identical"] for r in rows if r["identical"] is not None),
        "largest_measured_n": last["n"],
        "processed_tokens_per_s_cache": last["tokens_cache"] / last["seconds_cache"],
        "processed_tokens_per_s_no_cache": last["tokens_no_cache"] / last["seconds_no_cache"],
        "rows": rows,
    })
    return doc


def plot(d: dict[str, Any], path: str) -> str:
    fig, (ax1, ax2) = new_figure(ncols=2)
    rows = d["rows"]
    ns = [r["n"] for r in rows]
    ax1.plot(ns, [r["seconds_cache"] for r in rows], "o-", label="KV cache")
    meas = [r for r in rows if r["seconds_no_cache"] is not None]
    ax1.plot([r["n"] for r in meas], [r["seconds_no_cache"] for r in meas], "s-", label="no cache")
    ax1.set(xscale="log", yscale="log", xlabel="generated tokens n", ylabel="seconds (measured)",
            title="time to generate n tokens")
    ax2.plot(ns, [r["tokens_cache"] for r in rows], "o-", label="KV cache: P + n - 1")
    ax2.plot(ns, [r["tokens_no_cache"] for r in rows], "s-", label="no cache: nP + n(n-1)/2")
    ax2.set(xscale="log", yscale="log", xlabel="generated tokens n", ylabel="tokens processed",
            title=f"model work (prompt P = {d['prompt_len']})")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path)


def print_table(d: dict[str, Any]) -> None:
    def f(x: Any, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    print(f"{d['model']}: prompt {d['prompt_len']} tokens, greedy, {d['threads']} threads; "
          f"FLOPs = {d['flops_formula']}")
    print(f"{'n':>5s} {'tokens cache':>12s} {'no cache':>9s} {'ratio':>6s} {'GFLOP cache':>11s} {'no cache':>9s} "
          f"{'s cache':>8s} {'s no cache':>10s} {'speed-up':>8s} {'same':>5s} {'KV cache':>10s} {'KV/weights':>10s}")
    for r in d["rows"]:
        same = "-" if r["identical"] is None else ("yes" if r["identical"] else "NO")
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        print(f"{r['n']:5d} {r['tokens_cache']:12d} {r['tokens_no_cache']:9d} {r['token_ratio']:6.1f} "
              f"{r['flops_cache'] / 1e9:11.3g} {r['flops_no_cache'] / 1e9:9.3g} {r['seconds_cache']:8.3f} "
              f"{f(r['seconds_no_cache'], '10.3f'):>10s} {speedup:>8s} {same:>5s} "
              f"{fmt_bytes(r['kv_bytes']):>10s} {r['kv_vs_weights']:10.4f}")
    if d["no_cache_tokens_measured"] < d["lengths"][-1]:
        print(f"no-cache run stopped after {d['no_cache_tokens_measured']} tokens "
              f"(--no-cache-seconds {d['no_cache_seconds_budget']:g}); '-' = not measured")
    be = d["break_even_speedup"]
    print(f"break-even: at n = 1 (prefill only: scoring, one-token answers) both modes run the same single "
          f"prefill, speed-up {f(be, '.2f')}x; the cache pays from the second output token on")
    print(f"at n = {d['largest_measured_n']} the no-cache run processes more tokens per second "
          f"({d['processed_tokens_per_s_no_cache']:.0f} vs {d['processed_tokens_per_s_cache']:.0f} with the cache): "
          f"it recomputes in prefill-sized batches (compute-bound) where cached decode feeds one token per pass over "
          f"the weights (memory-bound), so the speed-up stays below the token ratio")
    print(f"memory: the cache costs {d['kv_bytes_per_token']:,} B/token; it outgrows the "
          f"{fmt_bytes(d['weight_bytes'])} of weights at {d['kv_outgrows_weights_at_tokens']:,} tokens")
    print(f"generated tokens identical with and without the cache: {'yes' if d['all_identical'] else 'NO'}")


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 128, 256],
                   help="output lengths n (n = 1 is always added)")
    p.add_argument("--repeats", type=int, default=1, help="cached runs (best time per n is kept)")
    p.add_argument("--no-cache-seconds", type=float, default=75.0,
                   help="stop the quadratic no-cache run after this many seconds")
    p.add_argument("--plot", metavar="FILE", help="write a PNG: seconds and tokens processed vs n")


def run_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(a.model, threads=a.threads, prompt_len=a.prompt_len, lengths=tuple(a.lengths), repeats=a.repeats,
               no_cache_seconds=a.no_cache_seconds)


BENCH = Bench("waste", "tokens, FLOPs and seconds with vs without the KV cache per output length", add_args,
              run_args, print_table, plot)

if __name__ == "__main__":
    standalone(BENCH)
