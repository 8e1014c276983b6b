#!/usr/bin/env python3
"""The paged-attention kernel alone by KV cache format: one decode row (SmolLM2's shape: 9 query heads, 3
KV heads, head_dim 64) over 512, 2,048 and 8,192 cached tokens of one layer, the formats alternated 60
times, median per call (docs/kv_quant.md records a run).

    python scripts/experiments/kv_attention_ab.py
"""

from __future__ import annotations

import statistics
import time

import torch

from kvlm.kernels import kv_quant, paged_attention

torch.set_num_threads(2)
H, KVH, D, BS = 9, 3, 64, 16
res = {}
for L in (512, 2048, 8192):
    nb = L // BS
    g = torch.Generator().manual_seed(0)
    k = torch.randn(nb, BS, KVH, D, generator=g)
    v = torch.randn(nb, BS, KVH, D, generator=g)
    caches = {"float32": (k, v), "float16": (k.half(), v.half()),
              "int8": (kv_quant.quantize(k, kv_quant.INT8), kv_quant.quantize(v, kv_quant.INT8)),
              "int4": (kv_quant.quantize(k, kv_quant.INT4), kv_quant.quantize(v, kv_quant.INT4))}
    q = torch.randn(1, H, D, generator=g)
    bt = torch.arange(nb, dtype=torch.int32)[None]
    sid = torch.zeros(1, dtype=torch.int32)
    ctx = torch.tensor([L], dtype=torch.int32)
    times = {n: [] for n in caches}
    for _ in range(60):
        for n, (kc, vc) in caches.items():
            t = time.perf_counter()
            for _ in range(5):
                paged_attention(q, kc, vc, bt, sid, ctx, D**-0.5)
            times[n].append((time.perf_counter() - t) / 5)
    res[L] = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    print(L, {n: f"{t:.3f} ms" for n, t in res[L].items()}, "per layer, one decode row", flush=True)
