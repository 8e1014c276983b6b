"""`kvlm bench compare --gguf FILE...`: the side-by-side run of `compare.py` on several files in one
invocation (e.g. the default model requantized to each format: scripts/make_quant_fixtures.py).

Each file gets its own full run (kvlm auto, the float32 reference path, llama.cpp: round-robin, best of
`--repeats`), one after the other, so compare ratios within a file; its table is printed, then one summary
line per file: kvlm's and llama.cpp's prefill, decode at batch 1 and decode at the longest context, with
kvlm / llama.cpp for each.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvlm.bench.common import log, run_header


def run_files(files: list[str], run_one: Callable[..., dict[str, Any]], **kw: Any) -> dict[str, Any]:
    """`run_one(file, **kw)` (compare.run) for each file; a missing file is a readable error up front."""
    for f in files:
        if not Path(f).is_file():
            raise ValueError(f"--gguf: no such file {f}")
    docs = []
    for i, f in enumerate(files):
        log(f"== file {i + 1}/{len(files)}: {f}")
        docs.append(run_one(f, **kw))
    doc = run_header("compare", ",".join(Path(f).name for f in files), kw.get("threads", 2))
    doc["files"] = docs
    return doc


def summary_rows(d: dict[str, Any]) -> list[dict[str, Any]]:
    """Per file: kvlm's and llama.cpp's prefill / decode / decode at the longest context (None: not run)."""
    rows = []
    for doc in d["files"]:
        k, p = doc["engines"]["kvlm"], doc["engines"].get("llama_cpp", {})
        row: dict[str, Any] = {"file": doc["model_file"]}
        for who, r in (("kvlm", k), ("llama_cpp", p)):
            ok = r.get("status") == "ok"
            ctx = (r.get("context_decode") or [None])[-1] if ok else None
            row[who] = {"prefill": r.get("prefill_tokens_per_s") if ok else None,
                        "decode": r.get("decode_tokens_per_s") if ok else None,
                        "context": ctx["tokens_per_s"] if ctx else None}
        row["context_len"] = doc["contexts"][-1] if doc["contexts"] else None
        rows.append(row)
    return rows


def print_files(d: dict[str, Any], print_one: Callable[[dict[str, Any]], None]) -> None:
    for doc in d["files"]:
        print_one(doc)
        print()
    rows = summary_rows(d)
    ctx = rows[0]["context_len"] if rows else None
    print(f"summary, {d['threads']} threads, CPU {d['cpu']}, {d['date']}: tokens/s kvlm / llama.cpp (ratio)")
    print(f"{'file':44s} {'prefill':>22s} {'decode':>20s} {'decode @' + str(ctx):>20s}")

    def cell(row: dict[str, Any], f: str) -> str:
        a, b = row["kvlm"][f], row["llama_cpp"][f]
        if a is None:
            return f"{'-':>20s}"
        if b is None:
            return f"{a:8.1f} / {'-':>6s}      "
        return f"{a:7.1f} / {b:6.1f} ({a / b:.2f}x)"

    for row in rows:
        print(f"{row['file']:44s} {cell(row, 'prefill'):>22s} {cell(row, 'decode'):>20s} {cell(row, 'context'):>20s}")
