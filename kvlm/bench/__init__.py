"""Benchmarks: commands whose last line of output is one JSON document (`kvlm bench ...`).

Each command is a module of this package ending with `BENCH = Bench(...)` (`common.py`: its flags, run,
table and plot); this file only lists them. The modules are imported when the `bench` subcommands are
built, which `kvlm.cli.main` does only for a `kvlm bench ...` command line: several import torch.
"""

from __future__ import annotations

import argparse
import importlib

BENCH_HELP = "benchmarks (each ends with one JSON line)"
# In the order `kvlm bench --help` lists them.
COMMANDS = ("decode", "throughput", "waste", "invariance", "latency", "compare", "quality", "prefix", "serve",
            "kernels", "structured", "long", "kv", "spec", "tier", "lora", "moe")


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from kvlm.bench.common import register

    p = sub.add_parser("bench", help=BENCH_HELP)
    bsub = p.add_subparsers(dest="bench", required=True)
    for name in COMMANDS:
        register(bsub, importlib.import_module(f"kvlm.bench.{name}").BENCH)
