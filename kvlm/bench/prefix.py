"""`kvlm bench prefix`: what the prefix cache saves, measured side by side in one run.

(a) shared: N requests (default 32) that share a long system prompt (default 1024 tokens) followed by
    different short questions, all submitted at once, with prefix caching off and on: prompt tokens
    prefilled, TTFT p50/p90, total time and output tokens/s.
(b) chat: a 10-turn greedy chat, with and without reuse: tokens prefilled and seconds per turn (with
    reuse each turn prefills only its new tokens), and whether both give the same replies.
(c) snapshot: the K/V of a 2048-token prefix loaded from a safetensors snapshot vs recomputed.
Once the parts have run, each prints its table (from the document, so a saved JSON can be printed
again); the output ends with one JSON line (the part's, or all three under one header); `--plot FILE`
draws (a) and (b) in one PNG.
`--explain PROMPT_A PROMPT_B` runs A then B and prints why B reused less of A than it shares (if so).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from kvlm.bench.common import Bench, add_model_args, run_header, standalone
from kvlm.bench.plotting import new_figure, save_figure

PARAGRAPH = ("You are a careful assistant for a small hardware shop. Answer in one short sentence, be polite, "
             "never invent prices, and when you do not know something say so plainly. The shop sells cables, "
             "adapters, keyboards, mice, monitors and spare parts, and it is open from nine to six. ")
PARTS = ("shared", "chat", "snapshot")  # (a), (b), (c)
CHAT_TURNS = ["Hi! What is a KV cache?", "Why does it make decoding faster?", "How much memory does it take?",
              "What is paging in this context?", "And what is prefix caching?", "Give me an example workload.",
              "What happens when the cache is full?", "Is the result exactly the same?",
              "What is a snapshot of the cache?", "Thanks, summarize everything in one line."]


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _llm(model: str, threads: int, caching: bool, **kw: Any) -> Any:
    from kvlm.llm import LLM
    from kvlm.sampling_params import SamplingParams

    llm = LLM(model, num_threads=threads, enable_prefix_caching=caching, **kw)
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    llm.llm_engine.reset_prefix_cache()
    return llm


def system_prompt(tokenizer: Any, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids = tokenizer.encode(PARAGRAPH * (1 + n // 32), add_special_tokens=False)
    return ids[:n]


def run_shared(model: str, threads: int, num_requests: int, system_len: int, max_tokens: int) -> dict[str, Any]:
    from kvlm.sampling_params import SamplingParams

    out: dict[str, Any] = {**run_header("prefix-shared", model, threads), "num_requests": num_requests,
                           "system_tokens": system_len, "max_tokens": max_tokens}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for mode, caching in (("off", False), ("on", True)):
        llm = _llm(model, threads, caching)
        eng, tok = llm.llm_engine, llm.tokenizer
        sys_ids = system_prompt(tok, system_len)
        prompts = [sys_ids + tok.encode(f"\nQuestion {i}: what is {i} times {i + 3}?", add_special_tokens=False)
                   for i in range(num_requests)]
        t0 = time.perf_counter()
        reqs = [eng.add_request(p, params) for p in prompts]
        while eng.has_unfinished:
            eng.step()
        dt = time.perf_counter() - t0
        ttft = [r.metrics.ttft for r in reqs]
        out[mode] = {"prompt_tokens": sum(len(p) for p in prompts),
                     "prefilled_tokens": sum(r.metrics.num_prefilled_tokens for r in reqs),
                     "cached_tokens": sum(r.metrics.num_cached_tokens for r in reqs),
                     "ttft_p50_s": _percentile(ttft, 0.5), "ttft_p90_s": _percentile(ttft, 0.9),
                     "seconds": dt, "output_tokens_per_s": sum(r.num_output_tokens for r in reqs) / dt,
                     "token_ids": [r.output_token_ids for r in reqs]}
    off, on = out["off"], out["on"]
    out["same_tokens"] = off.pop("token_ids") == on.pop("token_ids")
    out["prefill_reduction"] = 1 - on["prefilled_tokens"] / off["prefilled_tokens"]
    out["ttft_p50_speedup"] = off["ttft_p50_s"] / on["ttft_p50_s"]
    out["total_speedup"] = off["seconds"] / on["seconds"]
    return out


def run_chat(model: str, threads: int, turns: int, max_tokens: int) -> dict[str, Any]:
    from kvlm.sampling_params import SamplingParams

    out: dict[str, Any] = {**run_header("prefix-chat", model, threads), "turns": turns, "max_tokens": max_tokens}
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    replies = {}
    for mode, caching in (("off", False), ("on", True)):
        llm = _llm(model, threads, caching)
        messages = [{"role": "system", "content": "You are a concise assistant."}]
        rows, texts = [], []
        for i in range(turns):
            messages.append({"role": "user", "content": CHAT_TURNS[i % len(CHAT_TURNS)]})
            t0 = time.perf_counter()
            o = llm.chat(messages, params, use_tqdm=False)[0]
            dt = time.perf_counter() - t0
            m = o.metrics
            rows.append({"prompt_tokens": m.num_prompt_tokens, "cached_tokens": m.num_cached_tokens,
                         "prefilled_tokens": m.num_prefilled_tokens, "seconds": dt,
                         "prefix_miss": m.prefix_miss})
            texts.append(o.outputs[0].text)
            messages.append({"role": "assistant", "content": o.outputs[0].text})
        out[mode] = rows
        replies[mode] = texts
    out["same_replies"] = replies["off"] == replies["on"]
    return out


def run_snapshot(model: str, threads: int, prefix_len: int) -> dict[str, Any]:
    from kvlm.sampling_params import SamplingParams

    out: dict[str, Any] = {**run_header("prefix-snapshot", model, threads), "prefix_tokens": prefix_len}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = _llm(model, threads, True)
    ids = system_prompt(a.tokenizer, prefix_len)
    prompt = {"prompt_token_ids": ids + a.tokenizer.encode("\nQuestion: what now?", add_special_tokens=False)}
    t0 = time.perf_counter()
    ref = a.generate(prompt, params, use_tqdm=False)[0]
    out["recompute_ttft_s"] = ref.metrics.ttft
    out["recompute_total_s"] = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prefix.safetensors"
        t0 = time.perf_counter()
        a.save_prefix({"prompt_token_ids": ids}, path)
        out["save_s"] = time.perf_counter() - t0
        out["file_bytes"] = path.stat().st_size
        del a
        b = _llm(model, threads, True)
        b.llm_engine.model_fingerprint  # noqa: B018  (computed once per model file and cached on disk)
        t0 = time.perf_counter()
        info = b.load_prefix(path)
        out["load_s"] = time.perf_counter() - t0
    out["snapshot_tokens"] = info.num_tokens
    got = b.generate(prompt, params, use_tqdm=False)[0]
    out["ttft_after_load_s"] = got.metrics.ttft
    out["cached_tokens_after_load"] = got.metrics.num_cached_tokens
    out["same_tokens"] = got.outputs[0].token_ids == ref.outputs[0].token_ids
    out["load_speedup"] = out["recompute_ttft_s"] / out["load_s"]
    return out


def explain(model: str, threads: int, a: str, b: str, chat: bool, block_size: int) -> dict[str, Any]:
    from kvlm.llm import LLM
    from kvlm.sampling_params import SamplingParams

    llm = LLM(model, num_threads=threads, block_size=block_size)
    params = SamplingParams(temperature=0, max_tokens=1)

    def inp(text: str) -> Any:
        return {"prompt_token_ids": llm.render_chat([{"role": "user", "content": text}])} if chat else text

    llm.generate(inp(a), params, use_tqdm=False)
    m = llm.generate(inp(b), params, use_tqdm=False)[0].metrics
    return {"bench": "prefix-explain", "prompt_tokens": m.num_prompt_tokens, "cached_tokens": m.num_cached_tokens,
            "block_size": block_size, "miss": m.prefix_miss}


def parts_of(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The parts a document holds, in run order: all three under `bench: prefix`, else the one `--part`
    ran (none for `--explain`)."""
    if doc["bench"] == "prefix":
        return {k: doc[k] for k in PARTS if k in doc}
    name = doc["bench"].removeprefix("prefix-")
    return {name: doc} if name in PARTS else {}


def plot(doc: dict[str, Any], path: str) -> str | None:
    """One PNG: (a) tokens prefilled and TTFT, caching off vs on; (b) tokens prefilled and seconds per
    chat turn, with and without reuse (the panels of the parts that ran). None when neither ran."""
    parts = parts_of(doc)
    shared, chat = parts.get("shared"), parts.get("chat")
    if shared is None and chat is None:
        return None
    panels = (2 if shared is not None else 0) + (2 if chat is not None else 0)
    fig, axes = new_figure(panels, width=4.0 * panels)
    axes = axes if isinstance(axes, list) else [axes]
    modes = ["off", "on"]
    if shared is not None:
        ax1, ax2 = axes[0], axes[1]
        axes = axes[2:]
        ax1.bar(modes, [shared[m]["prefilled_tokens"] for m in modes], color=["#999", "#3a7"])
        ax1.set_title(f"(a) tokens prefilled, {shared['num_requests']} requests")
        ax1.set_xlabel("prefix caching")
        ax2.bar([i - 0.2 for i in range(2)], [shared[m]["ttft_p50_s"] for m in modes], width=0.4, label="p50")
        ax2.bar([i + 0.2 for i in range(2)], [shared[m]["ttft_p90_s"] for m in modes], width=0.4, label="p90")
        ax2.set_xticks(range(2), modes)
        ax2.set_title("(a) time to first token (s)")
        ax2.set_xlabel("prefix caching")
        ax2.legend()
    if chat is not None:
        ax1, ax2 = axes[0], axes[1]
        turns = range(1, chat["turns"] + 1)
        for mode, label in (("off", "no reuse"), ("on", "prefix cache")):
            ax1.plot(turns, [r["prefilled_tokens"] for r in chat[mode]], marker="o", label=label)
            ax2.plot(turns, [r["seconds"] for r in chat[mode]], marker="o", label=label)
        ax1.set_title("(b) tokens prefilled per chat turn")
        ax2.set_title("(b) seconds per chat turn")
        for ax in (ax1, ax2):
            ax.set_xlabel("turn")
            ax.legend()
    return save_figure(fig, path)


def print_shared(d: dict[str, Any]) -> None:
    print(f"(a) {d['num_requests']} requests sharing a {d['system_tokens']}-token system prompt")
    print(f"{'prefix caching':16s} {'prefilled':>10s} {'TTFT p50':>9s} {'TTFT p90':>9s} {'total s':>8s} "
          f"{'out tok/s':>9s}")
    for m in ("off", "on"):
        r = d[m]
        print(f"{m:16s} {r['prefilled_tokens']:10d} {r['ttft_p50_s']:9.3f} {r['ttft_p90_s']:9.3f} "
              f"{r['seconds']:8.2f} {r['output_tokens_per_s']:9.1f}")
    print(f"prefilled -{100 * d['prefill_reduction']:.1f}%, TTFT p50 {d['ttft_p50_speedup']:.1f}x, "
          f"total {d['total_speedup']:.1f}x, same tokens: {d['same_tokens']}")


def print_chat(d: dict[str, Any]) -> None:
    print(f"(b) {d['turns']}-turn chat: tokens prefilled (and seconds) per turn")
    print(f"{'turn':>4s} {'prompt':>7s} {'no reuse':>9s} {'s':>6s} {'reuse':>7s} {'cached':>7s} {'s':>6s}")
    for i, (a, b) in enumerate(zip(d["off"], d["on"]), 1):
        print(f"{i:4d} {b['prompt_tokens']:7d} {a['prefilled_tokens']:9d} {a['seconds']:6.2f} "
              f"{b['prefilled_tokens']:7d} {b['cached_tokens']:7d} {b['seconds']:6.2f}")
    print(f"same replies: {d['same_replies']}")


def print_snapshot(d: dict[str, Any]) -> None:
    print(f"(c) snapshot of a {d['snapshot_tokens']}-token prefix ({d['file_bytes'] / 2**20:.1f} MiB): "
          f"load {d['load_s']:.3f} s vs recompute (prefill) {d['recompute_ttft_s']:.3f} s = "
          f"{d['load_speedup']:.1f}x; TTFT after load {d['ttft_after_load_s']:.3f} s; same tokens: {d['same_tokens']}")


def print_table(doc: dict[str, Any]) -> None:
    if doc["bench"] == "prefix-explain":
        print(f"B: {doc['prompt_tokens']} prompt tokens, {doc['cached_tokens']} reused from A's cache")
        print(f"why not more: {doc['miss'] or 'nothing was missed (B reused all it shares with A in whole blocks)'}")
        return
    printers = {"shared": print_shared, "chat": print_chat, "snapshot": print_snapshot}
    for name, part in parts_of(doc).items():
        printers[name](part)
    if "plot" in doc:
        print(f"plot: {doc['plot']}")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", choices=["all", *PARTS], default="all")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--system-len", type=int, default=1024, help="tokens of the shared system prompt")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request in (a)")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--turn-tokens", type=int, default=48, help="max output tokens per chat turn in (b)")
    p.add_argument("--snapshot-len", type=int, default=2048, help="tokens of the snapshot prefix in (c)")
    add_model_args(p)  # MODEL and --threads: here, so that --help keeps --threads after --snapshot-len
    p.add_argument("--plot", metavar="FILE", default=None, help="write a PNG of (a) and (b)")
    p.add_argument("--explain", nargs=2, metavar=("PROMPT_A", "PROMPT_B"), default=None,
                   help="run A then B and print why B reused less of the cache than it shares with A")
    p.add_argument("--chat", action="store_true", help="with --explain: render each prompt as a chat user turn")
    p.add_argument("--block-size", type=int, default=16, help="with --explain")


def run_args(a: argparse.Namespace) -> dict[str, Any]:
    """--explain's document, the one part's, or all three parts under one header."""
    if a.explain:
        return explain(a.model, a.threads, a.explain[0], a.explain[1], a.chat, a.block_size)
    parts: dict[str, Any] = {}
    if a.part in ("all", "shared"):
        parts["shared"] = run_shared(a.model, a.threads, a.num_requests, a.system_len, a.max_tokens)
    if a.part in ("all", "chat"):
        parts["chat"] = run_chat(a.model, a.threads, a.turns, a.turn_tokens)
    if a.part in ("all", "snapshot"):
        parts["snapshot"] = run_snapshot(a.model, a.threads, a.snapshot_len)
    return parts[a.part] if a.part != "all" else {**run_header("prefix", a.model, a.threads), **parts}


BENCH = Bench("prefix", "prefix cache: shared system prompt, multi-turn chat, KV snapshot load", add_args, run_args,
              print_table, plot)

if __name__ == "__main__":
    standalone(BENCH)
