"""Benchmarks: commands whose last line of output is one JSON document (`kvlm bench ...`)."""

from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from kvlm.bench import decode, throughput

    p = sub.add_parser("bench", help="benchmarks (each ends with one JSON line)")
    bsub = p.add_subparsers(dest="bench", required=True)
    decode.add_parser(bsub)
    throughput.add_parser(bsub)
