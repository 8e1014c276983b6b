"""`kvlm bench spec`: speculative decoding against none, side by side in one run, at batch 1.

Workloads (chat prompts built in, so every run measures the same thing): `rewrite` (repeat a given passage
with one word changed), `code` (return a given Python function with a docstring added), `extract` (fields of
a given record as JSON) are copy-heavy, where the output repeats the input; `chat` is open-ended, where
it does not. For each workload and each method (off, then `--methods`: ngram, suffix and any draft:PATH,
a draft model with the target's tokenizer) the same greedy request runs alone on its own engine: decode
tok/s (first token to last), acceptance (drafts kept / drafts verified), mean tokens per verification,
and the identity check (token ids and top-5 logprobs equal to the run without speculation). The methods'
engines are loaded together and their runs interleaved (off, ngram, suffix, off, ...; `--repeats`, median
tok/s), so a shared machine's changing load hits them alike. The last line is the JSON document;
`--plot FILE` draws it (tok/s and acceptance per workload and method).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvlm.args import speculative_config, speculative_method
from kvlm.bench.common import DEFAULT_MODEL, Bench, add_model_args, log, run_header, standalone
from kvlm.bench.plotting import new_figure, save_figure
from kvlm.config import DTYPES

_PASSAGE = ("The lighthouse stood on the northern cape for two hundred years. Every evening the keeper climbed "
            "the one hundred and twelve steps, trimmed the wick, wound the clockwork that turned the lens, and "
            "wrote the weather in the log: wind, sea, visibility, and the ships that passed. In winter the "
            "spray froze on the windows and the keeper scraped the glass twice a night.")
_CODE = '''def merge_intervals(intervals):
    intervals = sorted(intervals, key=lambda iv: iv[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
'''
_RECORD = ("Order 4471 was placed by Maria Lindqvist of Uppsala, Sweden, on 12 March 2024. She bought two "
           "copper kettles at 39.90 EUR each and one linen tablecloth at 24.50 EUR; shipping by post, "
           "tracking number SE-88214-77.")
WORKLOADS = {
    "rewrite": f"Repeat the following passage exactly, but replace the word 'keeper' with 'warden':\n\n{_PASSAGE}",
    "code": f"Return this Python function unchanged except for a one-line docstring:\n\n{_CODE}",
    "extract": f"Extract order id, name, city, country, date, items (name, quantity, unit price) and tracking "
               f"number from this text as JSON:\n\n{_RECORD}",
    "chat": "Tell me a short story about a fox who learns to play the violin.",
}
METHODS = ("ngram", "suffix")  # the default --methods; "off" always runs first


def run(model: str = DEFAULT_MODEL, threads: int = 2, max_tokens: int = 128, k: int = 5,
        workloads: list[str] | None = None, repeats: int = 3, methods: list[str] | None = None,
        dtype: str = "auto") -> dict[str, Any]:
    from statistics import median

    from kvlm import LLM, SamplingParams
    from kvlm.exactness import first_difference

    names = workloads or list(WORKLOADS)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5)
    doc = run_header("spec", model, threads)
    runs = ["off", *dict.fromkeys(methods or METHODS)]  # this run's methods, off first
    doc.update(max_tokens=max_tokens, num_speculative_tokens=k, batch=1, repeats=repeats, methods=runs,
               dtype=dtype, results=[])
    llms = {}
    for method in runs:  # one engine per method, all loaded first: their runs interleave below
        spec = None if method == "off" else speculative_config(method, k)
        llms[method] = llm = LLM(model, num_threads=threads, speculative_config=spec, enable_prefix_caching=False,
                                 dtype=dtype, adaptive_threads=False)
        llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm up
    for name in names:
        ids = llms["off"].render_chat([{"role": "user", "content": WORKLOADS[name]}])
        rates: dict[str, list[float]] = {m: [] for m in runs}
        outs: dict[str, Any] = {}
        for _ in range(repeats):  # off, ngram, suffix, off, ...: a shared machine's load hits them alike
            for method in runs:
                spec = llms[method].llm_engine.speculator
                if spec is not None:  # each run cold: suffix would otherwise learn the answer from the last repeat
                    spec.proposer.forget_finished()
                outs[method] = llms[method].generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
                rates[method].append(outs[method][0].metrics.decode_tokens_per_s or 0.0)
        base = median(rates["off"])
        for method in runs:
            m = outs[method][0].metrics
            row: dict[str, Any] = {"workload": name, "method": method, "output_tokens": m.num_generated_tokens,
                                   "decode_tokens_per_s": median(rates[method]), "runs_tokens_per_s": rates[method]}
            if method != "off":
                row["identical"] = first_difference(name, outs["off"], outs[method]) is None
                row["draft_tokens"], row["accepted_tokens"] = m.spec_num_draft_tokens, m.spec_num_accepted_tokens
                row["acceptance"] = (m.spec_num_accepted_tokens / m.spec_num_draft_tokens
                                     if m.spec_num_draft_tokens else None)
                row["tokens_per_verification"] = ((m.spec_num_accepted_tokens + m.spec_num_drafts) / m.spec_num_drafts
                                                  if m.spec_num_drafts else None)
                row["speedup"] = row["decode_tokens_per_s"] / base if base else None
            log(f"{method:6s} {name:8s} {row['decode_tokens_per_s']:.1f} tok/s")
            doc["results"].append(row)
    doc["identical"] = all(r.get("identical", True) for r in doc["results"])
    return doc


def label(method: str) -> str:
    """A method's short name: draft:/some/dir/model.gguf -> draft:model.gguf."""
    return f"draft:{method.rstrip('/').rsplit('/', 1)[-1]}" if method.startswith("draft:") else method


def plot(d: dict[str, Any], path: str) -> str:
    """Two panels: decode tok/s per workload, one bar per method (off included); acceptance per workload,
    one bar per speculating method."""
    methods = d.get("methods") or ["off", *METHODS]
    names = list(dict.fromkeys(r["workload"] for r in d["results"]))
    rows = {(r["workload"], r["method"]): r for r in d["results"]}
    fig, (ax, bx) = new_figure(ncols=2, width=10.0, height=3.6)
    for ax_, shown, key in ((ax, methods, "decode_tokens_per_s"), (bx, methods[1:], "acceptance")):
        width = 0.8 / max(len(shown), 1)
        for j, m in enumerate(shown):
            ys = [(rows.get((w, m)) or {}).get(key) or 0.0 for w in names]
            ax_.bar([i + (j - (len(shown) - 1) / 2) * width for i in range(len(names))], ys, width, label=label(m),
                    color=f"C{methods.index(m)}")  # one colour per method in both panels
        ax_.set_xticks(range(len(names)), names)
        ax_.grid(True, axis="y", alpha=0.3)
        ax_.legend(fontsize=7)
    ax.set(ylabel="decode tokens/s (batch 1)", title=f"{Path(d['model']).name}, {d['threads']} threads, "
                                                     f"k = {d['num_speculative_tokens']}")
    same = "yes" if d["identical"] else "NO"
    bx.set(ylabel="drafts accepted", ylim=(0, 1), title=f"acceptance (output identical to off: {same})")
    return save_figure(fig, path)


def print_table(d: dict[str, Any]) -> None:
    def f(x: Any, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    print(f"batch 1, greedy, {d['max_tokens']} tokens, k = {d['num_speculative_tokens']}, {d['threads']} threads, "
          f"dtype {d.get('dtype', 'auto')}, "
          f"{d['cpu']}, median of {d['repeats']} interleaved runs")
    w = max([7, *(len(label(r["method"])) for r in d["results"])])
    print(f"{'workload':10s} {'method':{w}s} {'tok/s':>7s} {'speedup':>8s} {'accept':>7s} {'tok/verif':>9s} identical")
    for r in d["results"]:
        print(f"{r['workload']:10s} {label(r['method']):{w}s} {f(r['decode_tokens_per_s'], '7.1f')} "
              f"{f(r.get('speedup'), '7.2f')}x {f(r.get('acceptance'), '7.0%')} "
              f"{f(r.get('tokens_per_verification'), '9.2f')} {r.get('identical', '')}")


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per workload")
    p.add_argument("--num-speculative-tokens", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="runs of each workload and method, interleaved (median)")
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=None,
                   help="which workloads (default: all)")
    p.add_argument("--methods", nargs="+", type=speculative_method, default=None, metavar="METHOD",
                   help="proposers measured against none: ngram, suffix, draft:PATH (a draft model with the "
                        "same tokenizer) (default: ngram suffix)")
    p.add_argument("--plot", metavar="FILE", help="PNG of tok/s and acceptance per workload and method")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="the target's compute dtype (a draft model always runs with auto: quantized on a CPU)")


def run_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(a.model, threads=a.threads, max_tokens=a.max_tokens, k=a.num_speculative_tokens,
               workloads=a.workloads, repeats=a.repeats, methods=a.methods, dtype=a.dtype)


BENCH = Bench("spec", "speculative decoding (ngram, suffix, draft:PATH) vs none: tok/s, acceptance, identity",
              add_args, run_args, print_table, plot)

if __name__ == "__main__":
    standalone(BENCH)
