#!/usr/bin/env python3
"""Causal prefill attention over the paged KV cache, three ways side by side in one process.

One sequence of N tokens already in a paged cache (block size 16 by default, blocks in random order),
all N causal query rows (row p attends tokens 0..p), the default model's attention shape (SmolLM2:
H = 9 query heads, 3 kv heads, D = 64, float32 cache):

- tiled:   `paged_attention(q, k, v, tables, seq_ids = 0, ctx_lens = 1..N)`, the kernel under test
           (rows of one sequence tiled against each 16-token K/V group);
- untiled: the one-row decode kernel with N rows, row p a "sequence" of length p + 1 with the same
           block table (`paged_decode_attention`, T = N): the per-row baseline, same bits as tiled;
- sdpa:    `torch.nn.functional.scaled_dot_product_attention(is_causal=True)` on K/V already gathered
           into contiguous (1, H, N, D) tensors (the gather, and the repeat of each kv head for its query
           heads, are not timed), torch's own CPU flash-attention kernel.

The three are timed round-robin (`--reps` rounds, each call once per round) so that load from other
work on the machine hits them alike; prints min and median ms per call and the ratios of medians, then
one JSON line.

    PYTHONPATH=. python scripts/experiments/paged_attention_ab.py --threads 2 --tokens 512 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from kvlm.kernels import native, paged_attention, paged_decode_attention


def case(n: int, heads: int, kv_heads: int, d: int, block_size: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    nb = (n + block_size - 1) // block_size
    k_cache = torch.randn(nb + 3, block_size, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(nb + 3, block_size, kv_heads, d, generator=g).to(dtype)
    table = torch.randperm(nb + 3, generator=g)[:nb].to(torch.int32)
    q = torch.randn(n, heads, d, generator=g)
    return q, k_cache, v_cache, table


def measure(n: int, args: argparse.Namespace) -> dict[str, float]:
    heads, kv_heads, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    dtype = getattr(torch, args.dtype)
    q, kc, vc, table = case(n, heads, kv_heads, d, bs, dtype)
    scale = d ** -0.5
    tables = table[None].contiguous()  # (1, blocks): one sequence
    seq_ids = torch.zeros(n, dtype=torch.int32)
    ctx_lens = torch.arange(1, n + 1, dtype=torch.int32)
    rows_tables = table.expand(n, -1).contiguous()  # (N, blocks): N one-row "sequences" of lengths 1..N
    out_t, out_u = torch.empty_like(q), torch.empty_like(q)
    group = heads // kv_heads
    blocks = table.long()
    k = kc[blocks].float().reshape(-1, kv_heads, d)[:n].transpose(0, 1).repeat_interleave(group, 0)[None].contiguous()
    v = vc[blocks].float().reshape(-1, kv_heads, d)[:n].transpose(0, 1).repeat_interleave(group, 0)[None].contiguous()
    qs = q.transpose(0, 1)[None].contiguous()  # (1, H, N, D)
    calls = {
        "tiled": lambda: paged_attention(q, kc, vc, tables, seq_ids, ctx_lens, scale, out=out_t),
        "untiled": lambda: paged_decode_attention(q, kc, vc, rows_tables, ctx_lens, scale, out=out_u),
        "sdpa": lambda: F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for f in calls.values():  # warm up: thread pool, buffers
        f(), f()
    for _ in range(args.reps):
        for name, f in calls.items():
            t = time.perf_counter()
            f()
            times[name].append((time.perf_counter() - t) * 1e3)
    assert torch.equal(out_t, out_u), "tiled and untiled rows differ"
    sd = calls["sdpa"]()[0].transpose(0, 1)
    err = (out_t - sd).abs().max().item()
    res = {f"{name} min ms": min(ts) for name, ts in times.items()}
    res.update({f"{name} median ms": statistics.median(ts) for name, ts in times.items()})
    res["untiled/tiled"] = res["untiled median ms"] / res["tiled median ms"]
    res["tiled/sdpa"] = res["tiled median ms"] / res["sdpa median ms"]
    res["max |tiled - sdpa|"] = err
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = {"isa": native.active_isa(), "threads": args.threads}
    with torch.inference_mode():
        for n in args.tokens:
            r = measure(n, args)
            print(f"N={n}: " + "  ".join(f"{name} {r[f'{name} median ms']:.2f} ms (min {r[f'{name} min ms']:.2f})"
                                         for name in ("tiled", "untiled", "sdpa"))
                  + f"  untiled/tiled {r['untiled/tiled']:.2f}x  tiled/sdpa {r['tiled/sdpa']:.2f}x"
                  + f"  max|tiled-sdpa| {r['max |tiled - sdpa|']:.1e}")
            out.update({f"N={n} {key}": val for key, val in r.items()})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
