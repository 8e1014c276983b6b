"""`kvlm bench serve`: a load generator against a running `kvlm serve` (asyncio + httpx, SSE), loopback only.

Workload: the same seeded random token-id prompts as `kvlm bench throughput` (or lines of a file), greedy,
`ignore_eos` with a fixed output length per request, sent at a fixed concurrency (`--max-concurrency`) or as
Poisson arrivals at `--request-rate` (several rates make a sweep). Per request it measures TTFT (first
streamed text), ITL (between chunks), TPOT ((latency - TTFT) / (output tokens - 1)) and end-to-end latency,
and reports mean/p50/p90/p99 under `vllm bench serve`'s names. `--compare-offline` then runs the same
prompts through `LLM` in this process (batched, and one at a time for TTFT) and reports the ratios.
Bounded in count (`--num-prompts`) and time (`--max-duration`). The last line is one JSON document.
`--conversations C --turns T` runs the multi-turn chat workload instead (`bench.conversations`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kvlm.bench.common import Bench, log, percentiles, run_header, standalone
from kvlm.bench.plotting import new_figure

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass(slots=True)
class Result:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


async def one_request(client: Any, url: str, model: str, prompt: list[int] | str, max_tokens: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    res = Result()
    t0 = last = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue  # comments (pings) and the end marker
                doc = json.loads(line[6:])
                if "error" in doc:
                    res.error = doc["error"]["message"]
                    return res
                now = time.perf_counter()
                if doc.get("usage"):
                    res.output_tokens = doc["usage"]["completion_tokens"]
                    res.prompt_tokens = doc["usage"]["prompt_tokens"]
                if doc["choices"] and doc["choices"][0]["text"]:
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
        res.latency = time.perf_counter() - t0
        res.ok = res.output_tokens > 0
    except Exception as e:  # connection refused, timeouts: counted as failed, never retried
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(url: str, model: str, prompts: list[Any], outs: list[int], concurrency: int | None,
                   rate: float, seed: int, max_duration: float) -> dict[str, Any]:
    import httpx

    sem = asyncio.Semaphore(concurrency or len(prompts))
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=(concurrency or len(prompts)) + 4)

    async with httpx.AsyncClient(timeout=httpx.Timeout(max_duration), limits=limits) as client:
        async def limited(p: Any, n: int) -> Result:
            async with sem:
                return await one_request(client, url, model, p, n)

        t0 = time.perf_counter()
        tasks = []
        for p, n in zip(prompts, outs):
            tasks.append(asyncio.create_task(limited(p, n)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, max_duration - (time.perf_counter() - t0)))
        for t in pending:
            t.cancel()
        dt = time.perf_counter() - t0
    results = [t.result() for t in done] + [Result(error="over --max-duration") for _ in pending]
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    doc: dict[str, Any] = {
        "request_rate": rate, "max_concurrency": concurrency, "completed": len(ok), "failed": len(results) - len(ok),
        "duration": dt, "total_input_tokens": sum(r.prompt_tokens for r in ok), "total_output_tokens": out_tok,
        "request_throughput": len(ok) / dt, "output_throughput": out_tok / dt,
        "total_token_throughput": (out_tok + sum(r.prompt_tokens for r in ok)) / dt,
        **percentiles([r.ttft for r in ok], "ttft"), **percentiles(tpots, "tpot"),
        **percentiles([x for r in ok for x in r.itl], "itl"), **percentiles([r.latency for r in ok], "e2el"),
    }
    errors = sorted({r.error for r in results if r.error})
    if errors:
        doc["errors"] = errors[:5]
    return doc


def offline(model_path: str, prompts: list[list[int]], outs: list[int], max_num_seqs: int,
            threads: int) -> dict[str, Any]:
    """The same prompts through `LLM` in this process: batched output tok/s, and TTFT one at a time."""
    import torch

    from kvlm.bench.throughput import run_kvlm_batched
    from kvlm.llm import LLM
    from kvlm.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model_path, num_threads=threads, max_num_seqs=max_num_seqs)
    llm.generate({"prompt_token_ids": prompts[0][:16]}, use_tqdm=False)  # warm-up
    batched = run_kvlm_batched(llm, prompts, outs)
    ttfts = []
    for p in prompts:
        r = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                         use_tqdm=False)[0]
        ttfts.append(r.metrics.ttft)
    return {"output_throughput": batched["output_tokens_per_s"], "median_ttft_ms": statistics.median(ttfts) * 1e3,
            "seconds": batched["seconds"]}


def check_loopback(url: str) -> str:
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"--url: kvlm bench serve only loads a server on this machine (127.0.0.1), got {host!r}")
    return url.rstrip("/")


def plot(doc: dict[str, Any], path: str) -> str:
    """TTFT and E2EL percentiles against the request rate each run achieved."""
    title = f"kvlm serve {doc['model']}: latency vs request rate ({doc['cpu']}, {doc['date']})"
    runs = [r for r in doc["runs"] if r["completed"]]
    xs = [r["request_throughput"] for r in runs]  # achieved rate (an "inf" offered rate has no x of its own)
    fig, axes = new_figure(ncols=2)
    for ax, metric in zip(axes, ("ttft", "e2el")):
        for p, style in (("median", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(xs, [r[f"{p}_{metric}_ms"] for r in runs], style, label=p)
        ax.set_xlabel("request rate achieved (req/s)")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return path


def check_flags(a: argparse.Namespace) -> None:
    """The limits argparse cannot express: a usage error (exit 2) before anything is imported or sent."""
    for name in ("num_prompts", "max_duration"):
        if getattr(a, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if a.max_concurrency is not None and a.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if any(r <= 0 for r in a.request_rate or ()):
        raise ValueError("--request-rate must be positive (inf for all at once)")
    if a.conversations is not None and (a.conversations < 1 or a.turns < 1):
        raise ValueError("--conversations and --turns must be >= 1")


def run(a: argparse.Namespace) -> dict[str, Any]:
    check_flags(a)
    import logging

    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise

    from kvlm.bench.throughput import make_workload

    url = check_loopback(a.url)
    models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    model = a.model or models[0]["id"]
    if a.conversations:
        from kvlm.bench.conversations import run_conversations

        return {**run_header("serve", model, a.threads), "url": url, **run_conversations(url, model, a)}
    vocab = httpx.get(url + "/tokenizer_info", timeout=10).json()["vocab_size"]
    if a.prompts_file:
        lines = [ln for ln in Path(a.prompts_file).read_text().splitlines() if ln.strip()][: a.num_prompts]
        prompts: list[Any] = lines
        outs = [a.output_len[0]] * len(lines)
    else:
        prompts, outs = make_workload(a.num_prompts, vocab, tuple(a.input_len), tuple(a.output_len), a.seed)
    rates = a.request_rate or [float("inf")]
    runs = []
    for rate in rates:
        d = asyncio.run(run_load(url, model, prompts, outs, a.max_concurrency, rate, a.seed, a.max_duration))
        runs.append(d)
        log(f"rate {rate:g} req/s, concurrency {a.max_concurrency}: {d['completed']} ok, {d['failed']} failed, "
            f"{d['output_throughput']:.1f} output tok/s, TTFT p50 {d['median_ttft_ms']:.1f} ms "
            f"p99 {d['p99_ttft_ms']:.1f} ms, TPOT p50 {d['median_tpot_ms']:.1f} ms, "
            f"E2EL p50 {d['median_e2el_ms']:.0f} ms")
    doc = {**run_header("serve", model, a.threads), "url": url, "num_prompts": len(prompts),
           "input_len": a.input_len, "output_len": a.output_len, "seed": a.seed, "runs": runs}
    if a.compare_offline:
        if a.prompts_file:
            raise ValueError("--compare-offline needs the random token workload (no --prompts-file)")
        off = offline(models[0]["root"], prompts, outs, a.offline_max_num_seqs, a.threads)
        doc["offline"] = off
        doc["throughput_ratio"] = runs[0]["output_throughput"] / off["output_throughput"]
        log(f"offline (same prompts, this process): {off['output_throughput']:.1f} output tok/s, "
            f"TTFT p50 {off['median_ttft_ms']:.1f} ms; server/offline throughput {doc['throughput_ratio']:.2f}")
    return doc


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (loopback only)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, nargs=2, default=[64, 512], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"))
    p.add_argument("--prompts-file", default=None, help="one text prompt per line instead of random token ids")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: all)")
    p.add_argument("--request-rate", type=float, nargs="+", default=None,
                   help="Poisson arrivals per second; several values make a sweep (default: inf, all at once)")
    p.add_argument("--max-duration", type=float, default=600.0, help="seconds per run before giving up")
    p.add_argument("--compare-offline", action="store_true", help="also run the same prompts through LLM here")
    p.add_argument("--offline-max-num-seqs", type=int, default=16, help="engine seats offline (the server's default)")
    p.add_argument("--threads", type=int, default=2, help="torch threads for --compare-offline")
    p.add_argument("--plot", metavar="FILE", help="PNG of TTFT and E2EL percentiles against request rate")
    m = p.add_argument_group("multi-turn chat (kvlm.bench.conversations): compare routers of --replicas")
    m.add_argument("--conversations", type=int, default=None,
                   help="C conversations with their own system prompts, each resending its history every turn, "
                        "turns sent in shuffled rounds; output tokens per turn: --output-len MIN; concurrency: "
                        "--max-concurrency (4 if not given) (default: the one-shot workload)")
    m.add_argument("--turns", type=int, default=6, help="turns per conversation")
    m.add_argument("--system-words", type=int, default=120, help="filler words in each system prompt")


# No table: each rate's summary goes to stderr as its run ends, the document to stdout.
BENCH = Bench("serve", "load a running `kvlm serve` (TTFT, TPOT, ITL, E2EL; vllm bench serve names)", add_args, run,
              None, plot)

if __name__ == "__main__":
    standalone(BENCH)
