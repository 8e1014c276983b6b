#!/usr/bin/env python3
"""Write docs/benchmarks.md from the outputs scripts/bench_all.sh saved under docs/results/.

Each docs/results/<name>.txt holds "$ <command line>", then the command's printed table, then one JSON
line. For every benchmark the page shows the command, the date / CPU / threads read from that JSON, the
table verbatim and the plot named by the command's --plot. Rule: every number on the page is copied from
those files; the fixed prose here contains no figures, so results and text cannot drift apart.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

# (file stem, section title, what the benchmark answers): prose only, no numbers.
SECTIONS: list[tuple[str, str, str]] = [
    ("decode", "Decode and prefill speed",
     "Prefill and decode tokens per second with and without the KV cache, next to Hugging Face transformers."),
    ("throughput", "Offline throughput",
     "Continuous batching against one request at a time and against padded batches in transformers; "
     "with `--baseline-dtype`, the same batched run on another weight path (the float32 reference) in "
     "the same process, for a ratio."),
    ("waste", "What decoding without a cache wastes",
     "Tokens processed, estimated FLOPs and measured seconds per output length, with and without the KV "
     "cache; whether both produce the same tokens; where the cache does not pay (a single output token) "
     "and what it costs in memory next to the weights."),
    ("invariance", "Why past keys and values never change",
     "The cached K/V of a prompt against the same positions recomputed with more tokens appended: equal "
     "under the causal mask, different from the second layer on without it."),
    ("latency", "Latency on this machine's roofline",
     "Time to first token against prompt length (compute-bound) and time per output token against context "
     "length (memory-bound), against the machine's measured copy bandwidth and matmul throughput."),
    ("kv_size", "KV cache memory against context length",
     "Bytes of K/V for MHA, GQA and MQA and for each storage dtype, and the context at which the cache "
     "outgrows the model's weights; the shipped reference models for comparison."),
    ("compare", "Side by side with llama.cpp",
     "kvlm with `--dtype auto` (weights computed on in their GGUF block formats) against llama.cpp on the "
     "same GGUF file and thread count, and against kvlm's own float32 reference path (`--dtype float32`, "
     "every weight dequantized at load), in one run: prefill, decode at batch 1, decode against context "
     "length, and whole processes (load, a chat prompt, greedy tokens, exit) with their peak RSS. "
     "llama.cpp runs in its own process with flash attention on, through llama-cpp-python, which "
     "`pip install llama-cpp-python` builds from source (it compiles llama.cpp: expect a quarter of an "
     "hour); install it in the same environment, or in another one and pass that interpreter with "
     "`--llama-python`. An absent peer is listed as skipped. The machine is shared with other "
     "developers' jobs: read the ratios of one run, not absolute speeds.\n\n"
     "**The AVX2 path against an AVX2 llama.cpp, on an AVX-512 machine.** llama-cpp-python's build targets "
     "the CPU it was built on. `scripts/build_llama_cpp.sh avx2 SDIST OUT` builds the llama.cpp that "
     "llama-cpp-python vendors (from its sdist, `pip download --no-deps --no-binary :all: "
     "llama-cpp-python==VERSION`) for AVX2 + FMA + F16C without AVX-512, into `OUT/lib`, and its "
     "`llama-batched-bench` into `OUT/bin`; `--llama-lib OUT/lib` makes the peer load those libraries "
     "(LLAMA_CPP_LIB_PATH). The peer's column names the ISA its build reports:\n\n"
     "```console\n"
     "$ KVLM_KERNEL_ISA=avx2 kvlm bench compare MODEL.gguf --threads 2 --llama-python "
     "PATH/TO/llama-venv/bin/python --llama-lib OUT/lib\n"
     "...\n"
     "llama.cpp (llama-cpp-python, avx2)     ...\n"
     "```"),
    ("compare_kv16", "Side by side with llama.cpp, float16 K/V",
     "The same comparison with kvlm's `--kv-cache-dtype float16`, the type llama.cpp stores K/V in by "
     "default: half the bytes per cached token, so attention at long context reads half as much."),
    ("compare_formats", "Side by side with llama.cpp, per weight format",
     "The default model requantized by llama.cpp's own `llama_model_quantize` from a float32 export "
     "(`scripts/make_quant_fixtures.py`) to the formats people download, Q4_K_M, Q5_K_M, Q6_K and Q8_0, "
     "next to the default Q4_1 file: `kvlm bench compare --gguf FILE...` runs the comparison on each file "
     "in turn (kvlm's int8-activation kernels against llama.cpp, same threads; prefill, decode at batch 1, "
     "decode at a long context), then prints one summary line per file. `$KVLM_HOME` stands for the "
     "directory the files were made in. Read the ratios within a file: the files ran one after the "
     "other on a shared machine."),
    ("compare_gemma3", "Side by side with llama.cpp, Gemma 3",
     "The second architecture on its PyPI file (README, Gemma 3: a Q8_0 embedding and head, Q5_0, "
     "Q4_K and Q6_K layers, five sliding-window layers to one full one): the same comparison, every "
     "tensor on kvlm's int8-activation kernels."),
    ("throughput_kv16", "Offline throughput, float16 K/V",
     "The batched throughput run with `--kv-cache-dtype float16` against the float32 reference path in "
     "the same process: the KV pool holds twice the tokens per byte."),
    ("prefix", "Prefix cache",
     "(a) Requests sharing a long system prompt, submitted together, with prefix caching off and on; (b) a "
     "multi-turn greedy chat with and without reuse, per turn; (c) a long prefix's K/V loaded from a "
     "snapshot file against recomputing it. Each checks that the tokens are the same. The recorded run "
     "shared the machine with other heavy jobs whose load changed while it ran: absolute seconds are "
     "inflated and noisy, token counts are exact, ratios are measured side by side."),
]


def parse_result(text: str) -> dict[str, Any]:
    """Split a results file into its command line, table lines and JSON document (None if absent)."""
    lines = text.rstrip("\n").splitlines()
    command = lines[0][2:] if lines and lines[0].startswith("$ ") else None
    body = lines[1:] if command is not None else lines
    doc = None
    if body:
        try:
            doc = json.loads(body[-1])
            body = body[:-1]
        except json.JSONDecodeError:
            pass
    return {"command": command, "table": body, "json": doc}


def plot_path(command: str | None) -> str | None:
    if not command:
        return None
    args = shlex.split(command)
    return args[args.index("--plot") + 1] if "--plot" in args and args.index("--plot") + 1 < len(args) else None


def section(stem: str, title: str, blurb: str, results: Path, out: Path) -> list[str]:
    md = [f"## {title}", "", blurb, ""]
    f = results / f"{stem}.txt"
    if not f.is_file():
        return md + [f"_Not run: `{f.name}` is missing from the results._", ""]
    r = parse_result(f.read_text())
    if r["command"]:
        md += ["```console", f"$ {r['command']}", "```", ""]
    doc = r["json"] or {}
    facts = [f"{label}: {doc[key]}" for label, key in (("date", "date"), ("CPU", "cpu"), ("threads", "threads"))
             if key in doc]
    if facts:
        md += ["; ".join(facts), ""]
    elif doc:
        md += ["Computed from the model's shape: no measurement, so no date, CPU or threads.", ""]
    else:
        md += ["_The output has no JSON line (the command may have failed)._", ""]
    if r["table"]:
        md += ["```text", *r["table"], "```", ""]
    img = plot_path(r["command"])
    if img:
        target = (Path.cwd() / img).resolve()
        try:  # link relative to the page, so it renders on GitHub and locally
            rel = target.relative_to(out.parent.resolve())
            link = rel.as_posix()
        except ValueError:
            link = target.as_posix()
        md += [f"![{title}]({link})" if target.is_file() else f"_Plot `{img}` is missing._", ""]
    return md


def build(results: Path, out: Path) -> str:
    md = ["# Benchmarks", "",
          "Generated by `scripts/make_benchmarks_md.py` from the outputs `scripts/bench_all.sh` saved in "
          "`docs/results/`; every number below is copied from those files. Do not edit by hand: run "
          "`scripts/bench_all.sh` again.", ""]
    for stem, title, blurb in SECTIONS:
        md += section(stem, title, blurb, results, out)
    return "\n".join(md).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=Path("docs/results"))
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    a = p.parse_args(argv)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(build(a.results, a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
