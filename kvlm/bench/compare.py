"""`kvlm bench compare`: kvlm against llama.cpp on the same GGUF and thread count, in one run.

Engines: kvlm with `--dtype auto` (weights computed on in their stored formats), kvlm with
`--dtype float32` (the dense reference path: every weight dequantized at load), llama.cpp through
llama-cpp-python, and optionally Hugging Face transformers (float32, `--hf`).

llama.cpp runs in a separate process with its own interpreter (`--llama-python`, default: this one if
it can import llama_cpp), by `llama_cpp_worker.py`, which needs only the standard library and
llama_cpp: the peer usually lives in its own virtual environment (docs/benchmarks.md says how to
build it). Flash attention is on, n_threads = n_threads_batch = `--threads`. `--llama-lib DIR` loads
llama.cpp's libraries from DIR instead (LLAMA_CPP_LIB_PATH), e.g. a build for AVX2 from
scripts/build_llama_cpp.sh, so an AVX-512 machine can time `KVLM_KERNEL_ISA=avx2` against an AVX2 peer;
the peer's column names the ISA its build reports (llama_print_system_info).

Measured, round-robin over `--repeats` rounds so every engine sees the same machine load, best kept, each
engine's timing after a second of rest (`SETTLE_S`: the previous engine's OpenMP threads spin for a while):
* prefill: a random `--prompt-len` (512) token prompt on a fresh context, tokens / time to first token;
* decode, batch 1: `--gen-tokens` (128) greedy tokens after a `--decode-prompt-len` prompt, tokens/s
  over the steps after the first;
* decode vs context: `--context-gen` tokens after prompts of each `--contexts` length (up to 2048);
* whole process (separate processes, started cold): load + a chat prompt + `--gen-tokens` greedy
  tokens + exit, wall time and peak RSS (the child's ru_maxrss from wait4), min time / max RSS.
Ratios are kvlm over each peer (higher is better for speeds, lower for time and memory).

Each engine's decode is also set against the memory bandwidth timed next to it (`decode_ceiling.py`).
The run ends with one JSON line; `--plot` draws decode tokens/s against context for kvlm and llama.cpp. An absent
or failing peer is a skipped column with its reason, never an error.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvlm.bench.common import (
    DEFAULT_MODEL,
    KV_CACHE_DTYPES,
    Bench,
    add_model_args,
    hf_times,
    kvlm_times,
    load_hf,
    log,
    prompt_ids,
    run_header,
    standalone,
)
from kvlm.bench.compare_files import print_files, run_files
from kvlm.bench.decode_ceiling import add_ceiling, ceiling_lines, file_decode_bytes
from kvlm.bench.plotting import new_figure, save_figure

WORKER = Path(__file__).with_name("llama_cpp_worker.py")
# kvlm's --kv-cache-dtype -> the ggml type llama.cpp stores K and V in for the same bytes per value
LLAMA_KV_TYPES = {"float32": 0, "float16": 1, "int8": 8, "int4": 2}
CHAT = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
# Idle seconds between one engine's work and the next timing: OpenMP threads keep spinning for a while after a
# parallel region, and on 2 cores a process started right after another's burst ran that first second at
# 0.75x (scripts/decode_ab.py, Zen 5, AVX-512 VNNI, the same build on both sides); a second of rest leaves
# the next engine the CPUs.
SETTLE_S = 1.0
NAMES = {"kvlm": "kvlm (--dtype auto)", "kvlm_float32": "kvlm (--dtype float32, reference)",
         "llama_cpp": "llama.cpp (llama-cpp-python)", "hf": "HF transformers (float32)"}


def default_llama_python() -> str | None:
    """This interpreter when it can import llama_cpp, else None."""
    return sys.executable if importlib.util.find_spec("llama_cpp") is not None else None


# A minimal launcher process starts each timed command: ru_maxrss of a forked child starts from its
# parent's peak (Linux copies the high-water mark at fork), so spawning from this benchmark process,
# which holds models, would report our memory, not the child's. The launcher holds ~10 MB.
_LAUNCHER = """
import json, os, sys, time
t = time.perf_counter()
pid = os.posix_spawnp(sys.argv[1], sys.argv[1:], dict(os.environ),
                      file_actions=[(os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0)])
_, status, usage = os.wait4(pid, 0)
print(json.dumps({"wall_s": time.perf_counter() - t, "rc": os.waitstatus_to_exitcode(status),
                  "peak_rss_bytes": usage.ru_maxrss * 1024}))
"""


def run_timed(cmd: list[str], timeout: float = 900.0, env: dict[str, str] | None = None) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of `cmd` run to completion in a fresh process (stdout discarded);
    RuntimeError with its last stderr line if it fails."""
    p = subprocess.run([sys.executable, "-c", _LAUNCHER, *cmd], capture_output=True, text=True, timeout=timeout,
                       check=False, env=env)
    try:
        r = json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        r = {"rc": p.returncode or 1}
    if r["rc"] != 0:
        raise RuntimeError((p.stderr.strip().splitlines() or [f"exit {r['rc']}"])[-1])
    return r["wall_s"], r["peak_rss_bytes"]


class _Kvlm:
    """kvlm in this process, batch 1, with the default paged cache (what `kvlm generate` runs: decode
    steps take the fused native step where the model allows, fused_decode.py)."""

    def __init__(self, model: str, threads: int, max_len: int, dtype: str, kv_cache_dtype: str = "auto") -> None:
        from kvlm.llm import LLM

        # Prefix caching off: every round must compute its prompt, as llama.cpp does on a fresh context.
        self.llm = LLM(model, num_threads=threads, max_num_seqs=1, max_model_len=max_len, dtype=dtype,
                       kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)

    def measure(self, spec: dict[str, Any]) -> dict[str, Any]:
        prefill_s = kvlm_times(self.llm, spec["prefill_ids"], 1)[0]
        return {"prefill_tokens_per_s": len(spec["prefill_ids"]) / prefill_s,
                "decode_tokens_per_s": kvlm_times(self.llm, spec["decode_ids"], spec["gen_tokens"])[1] or 0.0,
                "context_decode": [{"context": len(ids), "tokens_per_s": kvlm_times(self.llm, ids, gen)[1] or 0.0}
                                   for ids, gen in spec["contexts"]]}


_PROBE = ("import llama_cpp; print(llama_cpp.__version__); "
          "f = getattr(llama_cpp, 'llama_print_system_info', None); print((f() if f else b'').decode())")


def llama_env(lib: str | None) -> dict[str, str] | None:
    """The peer's environment: with `lib` (a folder of libllama.so and its ggml libraries, e.g. llama.cpp
    built for AVX2 by scripts/build_llama_cpp.sh), llama-cpp-python loads those instead of its own."""
    return None if lib is None else {**os.environ, "LLAMA_CPP_LIB_PATH": str(Path(lib).resolve())}


def llama_isa(system_info: str) -> str:
    """The best x86/ARM vector ISA llama.cpp says it was built with ("CPU : AVX2 = 1 | AVX512 = 0 | ...")."""
    on = set(re.findall(r"(\w+) = 1", system_info))
    if "AVX512" in on:
        if "AVX512_VNNI" in on and "AMX_INT8" in on:
            return "avx512-amx"
        return "avx512-vnni" if "AVX512_VNNI" in on else "avx512"
    if "AVX2" in on and "AVX_VNNI" in on:
        return "avx2-vnni"
    for isa, name in (("AVX2", "avx2"), ("DOTPROD", "neon-dotprod"), ("NEON", "neon")):
        if isa in on:
            return name
    return "unknown"


class _LlamaCpp:
    """llama.cpp in a child process per round (llama_cpp_worker.py under `python`, with `env`)."""

    def __init__(self, python: str, path: Path, env: dict[str, str] | None = None) -> None:
        self.python, self.path, self.env = python, path, env
        probe = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=False,
                               env=env)
        if probe.returncode != 0:
            raise ImportError(f"{python} cannot import llama_cpp"
                              + (f" with LLAMA_CPP_LIB_PATH={env['LLAMA_CPP_LIB_PATH']}" if env else ""))
        self.version, _, info = probe.stdout.strip().partition("\n")
        self.isa = llama_isa(info)

    def measure(self, spec: dict[str, Any]) -> dict[str, Any]:
        p = subprocess.run([self.python, str(WORKER), "measure", str(self.path)], input=json.dumps(spec),
                           capture_output=True, text=True, timeout=1800, check=False, env=self.env)
        if p.returncode != 0:
            raise RuntimeError((p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1])
        return json.loads(p.stdout.strip().splitlines()[-1])


class _HF:
    """Hugging Face transformers, float32, on the same GGUF (prefill and batch-1 decode only)."""

    def __init__(self, path: Path, threads: int) -> None:
        self.model = load_hf(path, threads)
        if self.model is None:
            raise ImportError("transformers is not installed")

    def measure(self, spec: dict[str, Any]) -> dict[str, Any]:
        t1 = hf_times(self.model, spec["prefill_ids"], 1)[0]
        return {"prefill_tokens_per_s": len(spec["prefill_ids"]) / t1,
                "decode_tokens_per_s": hf_times(self.model, spec["decode_ids"], spec["gen_tokens"])[1],
                "context_decode": []}


def _whole_cmd(key: str, path: Path, threads: int, text: str, gen: int, llama_python: str | None,
               kv_cache_dtype: str = "auto") -> list[str]:
    if key == "llama_cpp":
        assert llama_python is not None
        return [llama_python, str(WORKER), "whole", str(path), str(threads), text, str(gen)]
    dtype, kv = ("auto", kv_cache_dtype) if key == "kvlm" else ("float32", "auto")
    return [sys.executable, "-m", "kvlm", "-q", "generate", str(path), text, "--max-tokens", str(gen),
            "--ignore-eos", "--threads", str(threads), "--dtype", dtype, "--kv-cache-dtype", kv]


def _best(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    if a is None:
        return b
    out = {k: max(a[k], b[k]) for k in ("prefill_tokens_per_s", "decode_tokens_per_s")}
    # the bandwidth timed next to the best decode (the ceiling of that decode)
    out["read_bandwidth_gb_per_s"] = (b if b["decode_tokens_per_s"] > a["decode_tokens_per_s"] else a)[
        "read_bandwidth_gb_per_s"]
    out["context_decode"] = [{"context": x["context"], "tokens_per_s": max(x["tokens_per_s"], y["tokens_per_s"])}
                             for x, y in zip(a["context_decode"], b["context_decode"])]
    return out


class _Lineup:
    """The engines of one run and their result columns, in the order the table lists them. A peer that is
    absent or fails is skipped (its column says why) and the run goes on; kvlm failing is an error."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.engines: dict[str, Any] = {}
        self.results: dict[str, dict[str, Any]] = {}
        self.log = log

    def add(self, key: str, engine: Any, **info: Any) -> None:
        self.engines[key] = engine
        self.results[key] = {"name": NAMES[key], "status": "ok", **info}

    def skip(self, key: str, reason: str) -> None:
        self.engines.pop(key, None)
        self.results[key] = {"name": NAMES[key], "status": "skipped", "reason": reason}
        self.log(f"  {NAMES[key]}: skipped: {reason}")


def _lineup(model: str, path: Path, threads: int, max_len: int, kv_cache_dtype: str, llama_python: str | None,
            llama_cpp: bool, hf: bool, log: Callable[[str], None], reference: bool = True,
            llama_lib: str | None = None) -> _Lineup:
    """kvlm (auto and float32) in this process, then each peer that is asked for and can run."""
    line = _Lineup(log)
    line.add("kvlm", _Kvlm(model, threads, max_len, "auto", kv_cache_dtype))
    if reference:
        line.add("kvlm_float32", _Kvlm(model, threads, max_len, "float32"))
    if kv_cache_dtype != "auto":
        line.results["kvlm"]["name"] = f"kvlm (--dtype auto, KV {kv_cache_dtype})"
    if not llama_cpp:
        line.skip("llama_cpp", "disabled by flag")
    elif llama_python is None:
        line.skip("llama_cpp", "not installed (pip install llama-cpp-python, or pass --llama-python)")
    elif path.suffix != ".gguf":
        line.skip("llama_cpp", f"{path.name} is not a GGUF file")
    else:
        try:
            peer = _LlamaCpp(llama_python, path, llama_env(llama_lib))
            line.add("llama_cpp", peer, version=peer.version, isa=peer.isa)
            line.results["llama_cpp"]["name"] = f"llama.cpp (llama-cpp-python, {peer.isa})"
        except (ImportError, OSError, subprocess.SubprocessError) as e:
            line.skip("llama_cpp", f"{type(e).__name__}: {e}")
    if hf:
        try:
            line.add("hf", _HF(path, threads))
        except Exception as e:  # noqa: BLE001 (a peer that cannot read this file is a skipped column)
            line.skip("hf", f"{type(e).__name__}: {e}")
    return line


def _measure_rounds(line: _Lineup, spec: dict[str, Any], repeats: int, threads: int) -> None:
    """Prefill, decode and decode-vs-context of every engine, round-robin, best per engine kept, each with
    the read bandwidth timed next to it; then the in-process models are freed, before the whole-process
    runs. Each kvlm engine's result also gets the bytes its decode step reads."""
    import torch

    from kvlm.bench.latency import engine_weight_bytes, read_bandwidth

    for key in [k for k in ("kvlm", "kvlm_float32") if k in line.engines]:  # warm-up: pools, first allocations
        line.engines[key].llm.generate([{"prompt_token_ids": spec["decode_ids"][:8]}], use_tqdm=False)
        line.results[key]["decode_weight_bytes"] = engine_weight_bytes(line.engines[key].llm.llm_engine.model)
    best: dict[str, dict[str, Any] | None] = {k: None for k in line.engines}
    for r in range(repeats):
        for key in list(line.engines):
            torch.set_num_threads(threads)  # a peer may have changed the process-wide setting
            try:
                before = read_bandwidth(repeats=3)
                time.sleep(SETTLE_S)
                res = line.engines[key].measure(spec)
                torch.set_num_threads(threads)
                time.sleep(SETTLE_S)
                res["read_bandwidth_gb_per_s"] = max(before, read_bandwidth(repeats=3)) / 1e9
                best[key] = _best(best[key], res)
            except Exception as e:
                if key.startswith("kvlm"):
                    raise
                line.skip(key, f"{type(e).__name__}: {e}")
        line.log(f"  round {r + 1}/{repeats}: " + ", ".join(
            f"{k} prefill {v['prefill_tokens_per_s']:.0f}, decode {v['decode_tokens_per_s']:.1f} tok/s"
            for k, v in best.items() if v is not None and k in line.engines))
    for key in line.engines:
        line.results[key].update(best[key] or {})
    line.engines.pop("hf", None)
    for key in [k for k in ("kvlm", "kvlm_float32") if k in line.engines]:
        line.engines[key] = None  # freed before timing whole processes; the keys stay: those runs time them
    gc.collect()


def _whole_rounds(line: _Lineup, path: Path, threads: int, chat_text: str, gen_tokens: int,
                  llama_python: str | None, kv_cache_dtype: str, repeats: int, llama_lib: str | None = None) -> None:
    """Each engine as a cold process (load + chat prompt + gen_tokens + exit): min wall time, max peak RSS."""
    whole = ("kvlm", "kvlm_float32", "llama_cpp")
    results = line.results
    for r in range(repeats):
        for key in [k for k in whole if k in line.engines]:
            try:
                env = llama_env(llama_lib) if key == "llama_cpp" else None
                wall, rss = run_timed(_whole_cmd(key, path, threads, chat_text, gen_tokens, llama_python,
                                                 kv_cache_dtype), env=env)
            except (RuntimeError, OSError) as e:
                if key.startswith("kvlm"):
                    raise
                line.skip(key, f"whole process: {e}")
                continue
            res = results[key]
            res["whole_process_s"] = min(res.get("whole_process_s", wall), wall)
            res["peak_rss_bytes"] = max(res.get("peak_rss_bytes", 0), rss)
        line.log(f"  whole process {r + 1}/{repeats}: " + ", ".join(
            f"{k} {results[k]['whole_process_s']:.2f} s {results[k]['peak_rss_bytes'] / 2**20:.0f} MiB"
            for k in whole if "whole_process_s" in results.get(k, {})))


def run(model: str = DEFAULT_MODEL, threads: int = 2, prompt_len: int = 512, decode_prompt_len: int = 32,
        gen_tokens: int = 128, contexts: tuple[int, ...] = (128, 512, 1024, 2048), context_gen: int = 32,
        repeats: int = 2, llama_python: str | None = None, llama_cpp: bool = True, hf: bool = False,
        whole: bool = True, log: Callable[[str], None] = log, kv_cache_dtype: str = "auto",
        reference: bool = True, llama_lib: str | None = None) -> dict[str, Any]:
    import torch

    from kvlm.loader import resolve_model

    torch.set_num_threads(threads)
    path = resolve_model(model, quiet=True)
    max_len = max(prompt_len + 1, decode_prompt_len + gen_tokens, max(contexts, default=0) + context_gen) + 8
    llama_python = llama_python or default_llama_python()
    line = _lineup(model, path, threads, max_len, kv_cache_dtype, llama_python, llama_cpp, hf, log, reference,
                   llama_lib)
    vocab = line.engines["kvlm"].llm.llm_engine.model_config.vocab_size
    spec = {"threads": threads, "n_ctx": max_len, "gen_tokens": gen_tokens,
            "prefill_ids": prompt_ids(vocab, prompt_len), "decode_ids": prompt_ids(vocab, decode_prompt_len, seed=1),
            "contexts": [[prompt_ids(vocab, c, seed=c), context_gen] for c in contexts],
            "kv_type": LLAMA_KV_TYPES.get(kv_cache_dtype)}  # llama.cpp's K/V of the same size (None: its f16)
    chat_text = line.engines["kvlm"].llm.tokenizer.apply_chat_template(CHAT)
    _measure_rounds(line, spec, repeats, threads)
    ceiling = add_ceiling(line.results, file_decode_bytes(path))
    if whole:
        _whole_rounds(line, path, threads, chat_text, gen_tokens, llama_python, kv_cache_dtype, repeats, llama_lib)

    _ratios(line.results)
    doc = run_header("compare", model, threads)
    doc.update({"model_file": path.name, "prompt_len": prompt_len, "decode_prompt_len": decode_prompt_len,
                "gen_tokens": gen_tokens, "contexts": list(contexts), "context_gen": context_gen,
                "kv_cache_dtype": kv_cache_dtype,
                "repeats": repeats, **ceiling, "engines": line.results})
    return doc


def _ratios(results: dict[str, dict[str, Any]]) -> None:
    """kvlm over each other engine: speeds (>1 = kvlm faster), time and RSS (<1 = kvlm lighter)."""
    k = results["kvlm"]
    for key, r in results.items():
        if key == "kvlm" or r.get("status") != "ok":
            continue
        ratios: dict[str, float] = {}
        for f in ("prefill_tokens_per_s", "decode_tokens_per_s", "whole_process_s", "peak_rss_bytes"):
            if r.get(f) and k.get(f):
                ratios[f] = k[f] / r[f]
        for x, y in zip(k.get("context_decode", []), r.get("context_decode", [])):
            ratios[f"decode_at_{x['context']}"] = x["tokens_per_s"] / y["tokens_per_s"]
        r["kvlm_over_this"] = ratios


def plot(d: dict[str, Any], path: str) -> str | None:
    """Decode tokens/s against context length, one line per engine that measured it (one file only)."""
    if "files" in d:
        return None
    fig, ax = new_figure(width=6.0, height=3.6)
    for r in d["engines"].values():
        pts = r.get("context_decode") or []
        if r["status"] == "ok" and pts:
            ax.plot([p["context"] for p in pts], [p["tokens_per_s"] for p in pts], marker="o", label=r["name"])
    ax.set(xlabel="context (tokens)", ylabel="decode tokens/s (batch 1)",
           title=f"{d['model_file']}, {d['threads']} threads")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def print_table(d: dict[str, Any]) -> None:
    if "files" in d:  # --gguf FILE...
        return print_files(d, print_table)
    print(f"{d['model']} ({d['model_file']}), {d['threads']} threads, CPU {d['cpu']}, best of {d['repeats']}: "
          f"prefill {d['prompt_len']} tokens; decode {d['gen_tokens']} tokens after {d['decode_prompt_len']}; "
          f"decode {d['context_gen']} tokens after each context; whole process = load + chat prompt + "
          f"{d['gen_tokens']} tokens")
    ctx = d["contexts"]
    head = (f"{'engine':34s} {'prefill':>8s} {'decode':>7s} " + " ".join(f"{'@' + str(c):>7s}" for c in ctx)
            + f" {'whole s':>8s} {'peak RSS':>9s}")
    print(head)
    for r in d["engines"].values():
        if r["status"] != "ok":
            print(f"{r['name']:34s} skipped: {r['reason']}")
            continue
        cd = {x["context"]: x["tokens_per_s"] for x in r.get("context_decode", [])}
        whole = f"{r['whole_process_s']:8.2f}" if "whole_process_s" in r else f"{'-':>8s}"
        rss = f"{r['peak_rss_bytes'] / 2**20:6.0f} MiB" if "peak_rss_bytes" in r else f"{'-':>9s}"
        print(f"{r['name']:34s} {r['prefill_tokens_per_s']:8.1f} {r['decode_tokens_per_s']:7.1f} "
              + " ".join(f"{cd[c]:7.1f}" if c in cd else f"{'-':>7s}" for c in ctx) + f" {whole} {rss}")
    print("(tokens/s, higher is better; whole-process seconds and peak RSS, lower is better)")
    for line in ceiling_lines(d):
        print(line)
    for r in d["engines"].values():
        if "kvlm_over_this" in r:
            rat = r["kvlm_over_this"]
            print(f"kvlm / {r['name']}: " + ", ".join(f"{k.removesuffix('_tokens_per_s')} {v:.2f}x"
                                                     for k, v in rat.items()))


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode-prompt-len", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--contexts", type=int, nargs="*", default=[128, 512, 1024, 2048])
    p.add_argument("--context-gen", type=int, default=32, help="decode tokens timed after each context")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--llama-python", default=None,
                   help="interpreter with llama-cpp-python installed (default: this one, if it has it)")
    p.add_argument("--llama-lib", metavar="DIR", default=None,
                   help="llama.cpp libraries to load instead of llama-cpp-python's own (libllama.so and its "
                        "ggml libraries, e.g. an AVX2 build from scripts/build_llama_cpp.sh)")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")
    p.add_argument("--hf", action="store_true", help="also run Hugging Face transformers (float32)")
    p.add_argument("--no-whole-process", action="store_true", help="skip the whole-process runs")
    p.add_argument("--no-reference", action="store_true", help="skip kvlm's --dtype float32 column")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="kvlm's K/V type (llama.cpp stores float16 by default; kvlm's auto is float32 on CPU)")
    p.add_argument("--plot", metavar="FILE", help="PNG of decode tokens/s vs context")
    p.add_argument("--gguf", nargs="+", metavar="FILE", help="run on each of these files instead of MODEL, "
                   "one after the other, then a summary line per file")


def run_args(a: argparse.Namespace) -> dict[str, Any]:
    if a.llama_python is not None and not Path(a.llama_python).exists():
        raise ValueError(f"--llama-python: no such file {a.llama_python}")
    if a.llama_lib is not None and not (Path(a.llama_lib) / "libllama.so").exists():
        raise ValueError(f"--llama-lib: no libllama.so in {a.llama_lib}")
    kw = dict(threads=a.threads, prompt_len=a.prompt_len, decode_prompt_len=a.decode_prompt_len,
              gen_tokens=a.gen_tokens, contexts=tuple(a.contexts), context_gen=a.context_gen, repeats=a.repeats,
              llama_python=a.llama_python, llama_cpp=not a.no_llama_cpp, hf=a.hf, whole=not a.no_whole_process,
              kv_cache_dtype=a.kv_cache_dtype, reference=not a.no_reference, llama_lib=a.llama_lib)
    return run_files(a.gguf, run, **kw) if a.gguf else run(a.model, **kw)


BENCH = Bench("compare", "kvlm vs llama.cpp (and the float32 reference path) on the same GGUF", add_args, run_args,
              print_table, plot)

if __name__ == "__main__":
    standalone(BENCH)
