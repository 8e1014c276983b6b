"""Benchmarks: commands whose last line of output is one JSON document (`kvlm bench ...`)."""

from __future__ import annotations

import argparse

BENCH_HELP = "benchmarks (each ends with one JSON line)"


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from kvlm.bench import compare, decode, invariance, latency, prefix, serve, throughput, waste

    p = sub.add_parser("bench", help=BENCH_HELP)
    bsub = p.add_subparsers(dest="bench", required=True)
    for module in (decode, throughput, waste, invariance, latency, compare, prefix, serve):
        module.add_parser(bsub)
    from kvlm.bench import kernels as kernels_bench  # `kvlm bench kernels`

    kernels_bench.add_parser(bsub)
