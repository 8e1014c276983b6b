#!/usr/bin/env python3
"""How far float32 matmuls are from float64 on the shapes of Gemma 3 270M and SmolLM2-135M: PyTorch's
BLAS over the (out, in) layout (`F.linear`, what transformers runs), BLAS over the input-major layout
(`x @ W_t`, kvlm's `--dtype float32` path before 2026-12-02) and the native row kernel on F32 blocks
(what `--dtype float32` runs on a CPU now, `loader/build.py`). Weights N(0, 0.05), x N(0, 3), seeded.
Also whether each one's rows are the same alone and in the batch.

    python scripts/experiments/dense_rows_error.py [--rows 7] [--threads 2]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from kvlm.kernels import native
from kvlm.kernels.quant import qmatmul
from kvlm.loader import f32_blocks

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--rows", type=int, default=7)
ap.add_argument("--threads", type=int, default=2)
a = ap.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(0)
print(f"# {a.rows} rows, {a.threads} threads, kernels {native.active_isa()}, torch {torch.__version__}")
print(f"{'K x N':>12} {'path':<28} {'max rel error':>14} {'rows invariant':>15}")
for K, N in ((640, 4096), (2048, 640), (576, 1536), (1536, 576)):
    x = torch.randn(a.rows, K, dtype=torch.float64) * 3
    w = (torch.randn(N, K, dtype=torch.float64) * 0.05).float()
    ref = x @ w.double().T
    scale = ref.abs().max()
    xf, wt, blocks = x.float(), w.T.contiguous(), f32_blocks(w)
    paths = {"F.linear (out, in)": lambda v: F.linear(v, w), "x @ W_t (input-major)": lambda v: v @ wt,
             "row kernel (F32 blocks)": lambda v: qmatmul(v, blocks)}
    for name, f in paths.items():
        out = f(xf)
        alone = torch.cat([f(xf[i : i + 1]) for i in range(a.rows)])
        err = ((out.double() - ref).abs().max() / scale).item()
        print(f"{f'{K} x {N}':>12} {name:<28} {err:>14.2e} {str(torch.equal(out, alone)):>15}")
