#!/usr/bin/env python3
"""Prefill with int8 activations against float32 activations, side by side in one process.

Usage: python scripts/int8_prefill_ab.py THREADS [PROMPT_LEN] [REPEATS]

Three settings, interleaved, fresh random prompts each run (no prefix-cache hits): `f32`
(KVLM_KERNEL_ACT=f32: row kernel up to 8 rows, then dequantize a tile + BLAS), `int8-row` (the default:
the int8 row kernel for every M) and `int8+blas>64` (fake-quantize x, tile + BLAS above 64 rows).
Prints the best wall time and the best process CPU time per setting (CPU time is the steadier one on a
shared machine), then the weights of one layer alone at several M (thread CPU time, 1 thread).
"""

from __future__ import annotations

import os
import sys
import time

import torch
from gguf import GGMLQuantizationType as T

from kvlm.bench.decode import _kvlm_run, _prompt_ids
from kvlm.bench.plotting import cpu_name
from kvlm.kernels import native, quant
from kvlm.kernels.bench import random_weight
from kvlm.llm import LLM

NAMES = ["f32", "int8-row", "int8+blas>64"]


def setting(name: str) -> None:
    os.environ[native.ENV_ACT] = "f32" if name == "f32" else "int8"
    native.refresh()
    quant.INT8_ROW_MAX_ROWS = 64 if name == "int8+blas>64" else 1 << 20


def prefill(threads: int, p: int, repeats: int) -> None:
    torch.set_num_threads(threads)
    llm = LLM("smollm2-135m", num_threads=threads, max_num_seqs=1, max_model_len=p + 64)
    vocab = llm.llm_engine.model_config.vocab_size
    for n in NAMES:
        setting(n)
        _kvlm_run(llm, _prompt_ids(vocab, 16), 2)
    res: dict[str, list[tuple[float, float]]] = {n: [] for n in NAMES}
    for r in range(repeats):
        for n in NAMES:
            setting(n)
            ids = _prompt_ids(vocab, p, seed=1000 + 10 * r + NAMES.index(n))
            c = time.process_time()
            t = _kvlm_run(llm, ids, 1)[0]
            res[n].append((t, time.process_time() - c))
    for n in NAMES:
        wall, cpu = min(t for t, _ in res[n]), min(c for _, c in res[n])
        print(f"{n:14s} prefill {p}: best wall {wall * 1e3:7.1f} ms ({p / wall:5.0f} tok/s)  best cpu {cpu * 1e3:7.1f} ms")


def layer_weights(ms: list[int]) -> None:
    """One SmolLM2-135M layer's Q4_1 matmuls (q, o, k, v, gate, up, down), 1 thread, thread CPU time."""
    torch.set_num_threads(1)
    ops, isa = native.ops(), native.isa_id(native.best_isa())
    g = torch.Generator().manual_seed(0)
    layer = (((576, 576), 2), ((192, 576), 2), ((1536, 576), 2), ((576, 1536), 1))
    ws = {s: random_weight(T.Q4_1, *s, g) for s, _ in layer}

    def best(f, reps: int = 7) -> float:
        f()
        ts = []
        for _ in range(reps):
            t = time.thread_time()
            f()
            ts.append(time.thread_time() - t)
        return min(ts)

    for m in ms:
        tot = dict.fromkeys(("int8-row", "fq+tile+BLAS", "f32 tile+BLAS"), 0.0)
        for (n, k), cnt in layer:
            w, x, y = ws[(n, k)], torch.randn(m, k), torch.empty(m, n)

            def fq(x=x, w=w):
                xf = torch.empty_like(x)
                ops.fake_quantize_act(x, isa, xf)
                return quant._tiled_matmul(xf, w, ops, isa)
            tot["int8-row"] += cnt * best(lambda x=x, w=w, y=y, k=k: ops.qmatmul_i8(x, w.data, int(T.Q4_1), k, isa, y))
            tot["fq+tile+BLAS"] += cnt * best(fq)
            tot["f32 tile+BLAS"] += cnt * best(lambda x=x, w=w: quant._tiled_matmul(x, w, ops, isa))
        print(f"M={m:4d} one layer's weights, ms:", {k: round(v * 1e3, 3) for k, v in tot.items()})


if __name__ == "__main__":
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    print(f"# {cpu_name()}, path {native.best_isa()}, {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC")
    prefill(threads, int(sys.argv[2]) if len(sys.argv) > 2 else 512, int(sys.argv[3]) if len(sys.argv) > 3 else 3)
    layer_weights([1, 8, 32, 64, 512])
