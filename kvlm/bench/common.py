"""What every `kvlm bench` command shares: the `Bench` contract and the one `main` that drives it, the two
ways to start a benchmark (`kvlm bench NAME`, `python -m kvlm.bench.NAME`), the run header every JSON
document starts with, progress logging, and the measurements several benchmarks make the same way
(random prompts, peak RSS, one timed kvlm request, the Hugging Face peer).

torch and transformers are imported inside the functions that use them: `kvlm/bench/__init__.py`
imports this module while building the parser, and `kvlm --help` must not pay for either.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvlm.config import KV_DTYPES

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class Bench:
    """One `kvlm bench` command. Its output is `print_table`'s text, then one JSON line: the document
    that `run` returned (with `"plot": PATH` added when `--plot` drew one)."""

    name: str  # the subcommand, also the module: `kvlm bench NAME`, `python -m kvlm.bench.NAME`
    help: str  # the line `kvlm bench --help` shows
    add_args: Callable[[argparse.ArgumentParser], None]  # the command's own flags
    run: Callable[[argparse.Namespace], dict[str, Any]]  # the parsed flags -> the JSON document
    # The document -> its table on stdout. None: the run prints its rows as it measures them (kernels,
    # whose full run takes minutes) or has no table (serve reports each rate on stderr as it ends).
    print_table: Callable[[dict[str, Any]], None] | None
    # (document, --plot FILE) -> the path written, or None when the document has nothing to draw (prefix
    # with only the snapshot part). Only for commands that have a --plot flag.
    plot: Callable[[dict[str, Any], str], str | None] | None = None
    description: str | None = None  # of the `python -m` parser (kernels shows its docstring's first line)


def main(b: Bench, args: argparse.Namespace) -> int:
    """Run the benchmark: measure, draw the plot if asked, print the table, then the document as one line."""
    doc = b.run(args)
    if b.plot is not None and args.plot:
        path = b.plot(doc, args.plot)
        if path is not None:
            doc["plot"] = path
    if b.print_table is not None:
        b.print_table(doc)
    print(json.dumps(doc))
    return 0


def register(sub: argparse._SubParsersAction, b: Bench) -> None:
    """Add `kvlm bench NAME` to the `bench` subparsers."""
    p = sub.add_parser(b.name, help=b.help)
    b.add_args(p)
    p.set_defaults(func=functools.partial(main, b))


def standalone(b: Bench) -> None:
    """`python -m kvlm.bench.NAME`: the same flags and output as `kvlm bench NAME`; a bad value is one
    `kvlm: error:` line and exit 2, as under `kvlm`."""
    parser = argparse.ArgumentParser(prog=f"python -m kvlm.bench.{b.name}", description=b.description)
    b.add_args(parser)
    try:
        code = main(b, parser.parse_args())
    except ValueError as e:
        parser.exit(2, f"kvlm: error: {e}\n")
    raise SystemExit(code)


def log(msg: str) -> None:
    """Progress on stderr, flushed: stdout carries only the table and the JSON line."""
    print(msg, file=sys.stderr, flush=True)


def dtype_choices(*names: str) -> tuple[str, ...]:
    """The `choices` of a dtype flag: `names`, each one of `kvlm.config.KV_DTYPES`, in the order the flag's
    `--help` has always listed them."""
    unknown = [n for n in names if n not in KV_DTYPES]
    if unknown:
        raise ValueError(f"not in kvlm.config.KV_DTYPES: {', '.join(unknown)}")
    return names


# Every K/V element type the engine takes (all of KV_DTYPES), float16 listed before bfloat16.
KV_CACHE_DTYPES = dtype_choices("auto", "float32", "float16", "bfloat16", "int8", "int4")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The optional MODEL positional (a registry name or a path) and --threads, 2 by default: the thread
    count the published numbers are measured with (scripts/bench_all.sh). --help lists the options in the
    order they are added and the positional apart, so a command calls this where its --threads goes."""
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    p.add_argument("--threads", type=int, default=2)


# ------------------------------------------------------------------------------------------ header


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo; `platform.processor()` is empty on most Linux systems."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_header(bench: str, model: Any, threads: int) -> dict[str, Any]:
    """The fields every bench JSON starts with (read back by scripts/make_benchmarks_md.py). "cpu" names the
    kernels' ISA path beside the model ("AMD EPYC (avx2)"): AVX2 and AVX-512 differ by 2-3x, and
    KVLM_KERNEL_ISA can force the narrower one on a wider CPU."""
    import torch

    from kvlm.kernels.backend import isa_name

    return {"bench": bench, "model": str(model), "threads": threads,
            "date": datetime.now(UTC).strftime("%Y-%m-%d"), "cpu": f"{cpu_name()} ({isa_name()})",
            "torch": torch.__version__}


# ------------------------------------------------------------------------------------ measurements


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def prompt_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    """n seeded random token ids, clear of the low ids where tokenizers keep their special tokens."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 20000), (n,), generator=g).tolist()


def kvlm_times(llm: Any, ids: list[int], max_tokens: int) -> tuple[float, float | None]:
    """(TTFT seconds, decode tokens/s) of one greedy request with exactly max_tokens outputs."""
    from kvlm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    return out.metrics.ttft or 0.0, out.metrics.decode_tokens_per_s


def load_hf(path: Any, threads: int) -> Any:
    """Hugging Face transformers' float32 model of the same file (a GGUF or an HF folder), in eval mode;
    None when transformers is not installed."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    import torch

    p = Path(path)
    torch.set_num_threads(threads)
    if p.suffix == ".gguf":
        m = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    else:
        m = AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32)
    return m.eval()


def hf_times(model: Any, ids: list[int], max_tokens: int) -> tuple[float, float]:
    """HF: (prefill seconds, decode tokens/s) from generate() with 1 and with max_tokens new tokens."""
    import torch

    x = torch.tensor([ids])
    kw = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(x, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kw)
        tn = time.perf_counter() - t
    return t1, (max_tokens - 1) / max(tn - t1, 1e-9)


def step_in_turn(runs: list[tuple[Any, list[Any]]],
                 before_step: Callable[[int], None] | None = None) -> list[list[float]]:
    """Side by side on one machine: engines (each with its requests, already added) take one step each in
    turn until all their requests finish, so each round of steps sees the same load. `before_step(k)` runs
    before engine k's step (an A/B switches an implementation there). Returns each engine's decode step
    times: its steps once every one of its requests has its first token."""
    times: list[list[float]] = [[] for _ in runs]
    while any(not r.is_finished for _, reqs in runs for r in reqs):
        for k, (eng, reqs) in enumerate(runs):
            if all(r.is_finished for r in reqs):
                continue
            if before_step is not None:
                before_step(k)
            decoding = all(r.num_output_tokens > 0 for r in reqs)
            t0 = time.perf_counter()
            eng.step()
            if decoding:
                times[k].append(time.perf_counter() - t0)
    return times


@contextlib.contextmanager
def background_load(n: int) -> Iterator[None]:
    """`n` CPU-bound processes beside the benchmark (a busy laptop, a shared server), stopped after it."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        if procs:
            time.sleep(0.5)  # let them reach the scheduler
        yield
    finally:
        for pr in procs:
            pr.kill()
        for pr in procs:
            pr.wait()


def percentiles(xs: list[float], name: str) -> dict[str, float]:
    """mean / median / p90 / p99 of `xs` (seconds) in ms, under `vllm bench serve`'s key names."""
    if not xs:
        return {f"{k}_{name}_ms": float("nan") for k in ("mean", "median", "p90", "p99")}
    s = sorted(xs)

    def pct(p: float) -> float:
        return s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))]

    return {f"mean_{name}_ms": statistics.fmean(s) * 1e3, f"median_{name}_ms": statistics.median(s) * 1e3,
            f"p90_{name}_ms": pct(90) * 1e3, f"p99_{name}_ms": pct(99) * 1e3}
