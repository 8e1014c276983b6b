#!/usr/bin/env python3
"""Fit int4's 16 KV levels (`kernels/kv_quant.py` Q4_LEVELS): Lloyd-Max levels for groups of 32 values drawn
from a standard normal (Hadamard-rotated K/V rows are close to Gaussian), under int4's own scale search.

Lloyd's iteration from the uniform levels -8..7: quantize every group with the current levels (the best
of `Q4_CANDIDATES` by squared error: the plain rule maps the group's signed extreme to level 0, the others
refit the scale), then move each level to the mean of the values y = x / d that chose it, rescaled so
level 0 stays at -8. The fitted levels are scaled so level 0 is -127 and rounded to integers (so that
level x float16 scale is exact in float32). Prints the mean squared error per value, relative to the
group variance, for the uniform levels, the fitted ones and the integer table, then checks the table is
the engine's.

    python scripts/kv_int4_levels.py [--groups 200000] [--iters 30]
"""

from __future__ import annotations

import argparse

import torch

from kvlm.kernels import kv_quant


def quantize(g: torch.Tensor, levels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """g (N, 32), levels (16,) ascending, level 0 the extreme -> (squared error (N,), codes (N, 32), d (N, 1))."""
    hi, lo = g.amax(-1, keepdim=True), g.amin(-1, keepdim=True)
    m = torch.where(hi >= -lo, hi, lo)
    mids = (levels[1:] + levels[:-1]) / 2
    best = None
    for k, t in enumerate(kv_quant.Q4_CANDIDATES):
        d = (m / (levels[0] * t / 8)).half().float()
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        c = torch.bucketize(g * inv, mids)
        v = levels[c]
        if k > 0:
            vv = (v * v).sum(-1, keepdim=True)
            d = torch.where(vv > 0, (g * v).sum(-1, keepdim=True) / vv.clamp(min=1e-30), 0.0).half().float()
        e = ((g - v * d) ** 2).sum(-1)
        if best is None:
            best = (e, c, d)
        else:
            b = e < best[0]
            best = (torch.where(b, e, best[0]), torch.where(b[:, None], c, best[1]),
                    torch.where(b[:, None], d, best[2]))
    assert best is not None
    return best


def mse(g: torch.Tensor, levels: torch.Tensor) -> float:
    return float(quantize(g, levels)[0].sum() / g.numel())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--groups", type=int, default=200_000)
    p.add_argument("--iters", type=int, default=30)
    a = p.parse_args()
    torch.manual_seed(0)
    g = torch.randn(a.groups, 32)
    levels = torch.arange(-8, 8).float()
    print(f"uniform -8..7:   mse {mse(g, levels):.5f}")
    for _ in range(a.iters):
        _, c, d = quantize(g, levels)
        y = g / torch.where(d == 0, torch.ones_like(d), d)
        levels = torch.stack([y[c == i].mean() if (c == i).any() else levels[i] for i in range(16)])
        levels = (levels / -levels[0] * 8).sort().values
    print(f"fitted:          mse {mse(g, levels):.5f}  {[round(x, 3) for x in levels.tolist()]}")
    table = torch.round(levels / 8 * 127)
    print(f"integer table:   mse {mse(g, table):.5f}  {[int(x) for x in table.tolist()]}")
    same = tuple(int(x) for x in table.tolist()) == kv_quant.Q4_LEVELS
    print(f"the engine's Q4_LEVELS: {'the same' if same else 'DIFFERENT: ' + str(kv_quant.Q4_LEVELS)}")


if __name__ == "__main__":
    main()
