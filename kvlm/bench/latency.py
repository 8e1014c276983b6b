"""`kvlm bench latency`: time to first token vs prompt length and time per output token vs context,
placed against this machine's own ceilings (a roofline).

* Ceilings, measured by the command itself on the engine's device with the same thread count:
  memory bandwidth = 2 x bytes / time of `dst.copy_(src)` on a 256 MiB float32 tensor (read + write),
  best of 5; read bandwidth = bytes / time of `src.sum()` on a 1 GiB float32 tensor, best of 5 (a
  decode step only reads its weights, and a read-only pass is what bounds it: on a 2-core Zen 5 the copy
  figure read ~80 GB/s where a sum read ~50, and a one-off AVX-512 read loop 47-49); peak compute =
  2 n^3 / time of an n x n float32 matmul (n = 2048), best of 3.
* Prefill (TTFT, best of `--repeats`): FLOPs from `waste.forward_flops` (2 x params x P plus the
  causal attention term); bytes = weights read once + the P tokens' K/V written, a lower bound on the
  traffic (activations are ignored), so its arithmetic intensity is an upper bound. Prefill should sit
  near the compute ceiling: every weight fetched serves P tokens.
* Decode (median time of the `--decode-steps` steps after the first token of one request with a
  C-token prompt): bytes per
  token = every weight once + the K/V of the whole context (C x kv_bytes_per_token); achieved GB/s =
  bytes / time per token. Its intensity is ~0.5 FLOP/byte in float32 (2 FLOPs per 4-byte weight), far
  left on the roofline: decode is memory-bound, and the KV read grows with the context.

Weight bytes read per decode step: what the engine's linear layers hold (quantized blocks under
`--dtype auto`, parameters x 4 in float32), lm_head included; the input embedding is not counted (a
lookup reads one row, not the table).

Each decode row also carries the step's breakdown (`step_breakdown.py`): weights, attention, KV
write, other ops in the forward, sampling and host time, seconds per step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from kvlm.bench.common import (
    DEFAULT_MODEL,
    KV_CACHE_DTYPES,
    Bench,
    add_model_args,
    kvlm_times,
    log,
    prompt_ids,
    run_header,
    standalone,
)
from kvlm.bench.plotting import fmt_bytes, new_figure, save_figure
from kvlm.config import DTYPES


def _sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":  # kernels are asynchronous: time them to completion
        torch.cuda.synchronize(device)


def memory_bandwidth(mib: int = 256, repeats: int = 5, device: Any = "cpu") -> float:
    """Bytes/s of a tensor copy (each byte read once and written once), best of `repeats`, in the pages the
    weights have (`_buffer`)."""

    n = mib * 2**20 // 4
    src, dst = _buffer(n, device).fill_(1), _buffer(n, device)
    dst.copy_(src)  # touch every page first: page faults are not bandwidth
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n * 4 / best


READ_STREAMS = 16  # the native read pass's streams a thread (a decode step reads 16 weight rows side by side)


def read_bandwidth(mib: int = 1024, repeats: int = 5, device: Any = "cpu") -> float:
    """Bytes/s of a read-only pass (each byte read once, nothing written), best of `repeats`: the ceiling
    of a decode step, which reads every weight once. 1 GiB: far past any CPU's caches. On CPU the faster of
    two passes: `src.sum()` (one stream a thread) and, with the native extension, `read_pass` reading
    READ_STREAMS streams a thread side by side. Which is faster depends on the CPU: a 2-core Xeon (2026-12-05)
    read ~22-24 GB/s by the sum and ~25-26 by the native pass, and its BF16 decode (`avx512-amx`) had read its
    weights faster than the sum alone. In the pages the weights have (`_buffer`)."""
    import torch

    from kvlm.kernels import native

    src = _buffer(mib * 2**20 // 4, device).fill_(1)  # every page touched
    passes = [src.sum]
    if src.device.type == "cpu" and native.available():
        passes.append(lambda: torch.ops.kvlm_kernels.read_pass(src, READ_STREAMS))
    best = float("inf")
    for read in passes:
        read()
        for _ in range(repeats):
            _sync(device)
            t = time.perf_counter()
            read()
            _sync(device)
            best = min(best, time.perf_counter() - t)
    return src.numel() * 4 / best


def _buffer(n: int, device: Any) -> Any:
    """n float32 on device; on CPU in 2 MiB pages where the loader puts the weights there (loader/huge_pages.py),
    so the ceiling is measured in the pages a decode step reads: on a 2-core Xeon under KVM the read pass was
    14-15 GB/s in 4 KiB pages and 22-23 in 2 MiB ones in one hour (2026-12-06, docs/results/xeon_session27.txt)."""
    import torch

    from kvlm.loader import huge_pages

    if torch.device(device).type == "cpu" and huge_pages.worth(4 * n):
        return huge_pages.empty(4 * n).view(torch.float32)
    return torch.empty(n, dtype=torch.float32, device=device)


def peak_flops(n: int = 2048, repeats: int = 3, device: Any = "cpu") -> float:
    """FLOP/s of an n x n float32 matmul (2 n^3 FLOPs), best of `repeats`."""
    import torch

    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    out = a @ b  # warm-up: thread pool and buffers
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        torch.matmul(a, b, out=out)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def _decode_step_times(llm: Any, ids: list[int], steps: int) -> list[float]:
    """Seconds of each decode step (after the first token) of one greedy request."""
    from kvlm.sampling_params import SamplingParams

    eng = llm.llm_engine
    req = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    stamps = []
    while not req.is_finished:
        eng.step()
        stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:])]


def engine_weight_bytes(model: Any) -> int:
    """Bytes of weights one decode step reads: every linear layer's stored weight (blocks or dense)."""
    from torch import nn

    from kvlm.model.quant_layers import QuantLinear

    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            total += m.nbytes
        elif isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total


def run(model: str = DEFAULT_MODEL, threads: int = 2, prompt_lens: tuple[int, ...] = (32, 64, 128, 256, 512),
        contexts: tuple[int, ...] = (64, 256, 512, 1024), decode_steps: int = 24, repeats: int = 2,
        copy_mib: int = 256, matmul_n: int = 2048, dtype: str = "auto", log: Callable[[str], None] = log,
        kv_cache_dtype: str = "auto") -> dict[str, Any]:
    import torch

    from kvlm.bench.step_breakdown import decode_breakdown
    from kvlm.bench.waste import forward_flops
    from kvlm.llm import LLM

    torch.set_num_threads(threads)
    max_len = max(max(prompt_lens) + 2, max(contexts) + decode_steps + 2) + 16  # + a block: the pool rounds down
    llm = LLM(model, num_threads=threads, max_num_seqs=1, max_model_len=max_len, dtype=dtype,
              kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)  # prompts computed, not reused
    eng = llm.llm_engine
    # The ceilings of the device the engine runs on (the CPU here; a GPU when the engine picked CUDA).
    bw = memory_bandwidth(copy_mib, device=eng.device)
    rbw = read_bandwidth(device=eng.device)
    peak = peak_flops(matmul_n, device=eng.device)
    log(f"  {eng.device}: copy {bw / 1e9:.1f} GB/s, read {rbw / 1e9:.1f} GB/s, matmul {peak / 1e9:.1f} GFLOP/s "
        f"({threads} threads)")
    cfg = eng.model_config
    kv_tok = eng.kv_bytes_per_token
    wbytes = engine_weight_bytes(eng.model)
    kvlm_times(llm, prompt_ids(cfg.vocab_size, 16), 4)  # warm-up

    prefill = []
    for P in prompt_lens:
        ids = prompt_ids(cfg.vocab_size, P, seed=P)
        ttft = min(kvlm_times(llm, ids, 1)[0] for _ in range(repeats))
        flops = forward_flops(cfg, P, P * (P + 1) // 2)
        nbytes = wbytes + P * kv_tok
        prefill.append({"prompt_len": P, "ttft_s": ttft, "tokens_per_s": P / ttft, "flops": flops,
                        "gflops_per_s": flops / ttft / 1e9, "bytes": nbytes, "intensity": flops / nbytes,
                        "fraction_of_peak": flops / ttft / peak})
        log(f"  prefill {P}: TTFT {ttft * 1e3:.1f} ms")

    decode = []
    for C in contexts:
        ids = prompt_ids(cfg.vocab_size, C, seed=C)
        tpt = statistics.median(_decode_step_times(llm, ids, decode_steps))  # robust to the odd slow step
        split = decode_breakdown(llm, ids, decode_steps)["parts_s"]
        ctx = C + (decode_steps + 1) / 2  # mean context of the timed steps: C+1 .. C+decode_steps
        flops = forward_flops(cfg, 1, round(ctx))
        nbytes = wbytes + ctx * kv_tok
        decode.append({"context": C, "mean_context": ctx, "time_per_token_s": tpt, "tokens_per_s": 1 / tpt,
                       "bytes_per_token": nbytes, "kv_bytes_per_token_read": ctx * kv_tok,
                       "gb_per_s": nbytes / tpt / 1e9, "fraction_of_bandwidth": nbytes / tpt / bw,
                       "fraction_of_read_bandwidth": nbytes / tpt / rbw,
                       "flops": flops, "gflops_per_s": flops / tpt / 1e9, "intensity": flops / nbytes,
                       "breakdown_s": split})
        log(f"  decode at {C}: {tpt * 1e3:.1f} ms/token")

    doc = run_header("latency", model, threads)
    doc.update({
        "device": str(eng.device), "dtype": str(eng.dtype).removeprefix("torch."), "config_dtype": dtype,
        "kv_cache_dtype": str(eng.kv_cache_dtype).removeprefix("torch."), "repeats": repeats,
        "decode_steps": decode_steps,
        "memory_bandwidth_gb_per_s": bw / 1e9, "copy_mib": copy_mib, "read_bandwidth_gb_per_s": rbw / 1e9,
        "peak_gflops_per_s": peak / 1e9, "matmul_n": matmul_n,
        "ridge_intensity": peak / bw,  # FLOP/byte where the two ceilings meet
        "parameters": cfg.num_parameters, "weight_bytes_read": wbytes, "kv_bytes_per_token": kv_tok,
        "prefill": prefill, "decode": decode,
    })
    return doc


def plot(d: dict[str, Any], path: str) -> str:
    fig, ax = new_figure(width=7.0, height=4.0)
    bw, peak = d["memory_bandwidth_gb_per_s"], d["peak_gflops_per_s"]
    xs = [r["intensity"] for r in d["prefill"] + d["decode"]]
    lo, hi = min(xs + [d["ridge_intensity"]]) / 4, max(xs + [d["ridge_intensity"]]) * 4
    ridge = d["ridge_intensity"]
    ax.plot([lo, ridge, hi], [bw * lo, peak, peak], "k-", lw=1.5, label="roofline (measured)")
    ax.plot([ridge, hi], [bw * ridge, bw * hi], "k:", lw=1, label=f"memory {bw:.1f} GB/s (copy)")
    ax.plot([lo, ridge], [peak, peak], "k--", lw=1, label=f"compute {peak:.0f} GFLOP/s (matmul)")
    ax.scatter([r["intensity"] for r in d["prefill"]], [r["gflops_per_s"] for r in d["prefill"]],
               marker="o", label="prefill (prompt length)", zorder=3)
    for r in d["prefill"]:
        ax.annotate(str(r["prompt_len"]), (r["intensity"], r["gflops_per_s"]), fontsize=7,
                    xytext=(3, -9), textcoords="offset points")
    ax.scatter([r["intensity"] for r in d["decode"]], [r["gflops_per_s"] for r in d["decode"]],
               marker="s", label="decode (context)", zorder=3)
    for i, r in enumerate(d["decode"]):  # all decode points share ~0.5 FLOP/byte: stagger their labels
        ax.annotate(f"ctx {r['context']}", (r["intensity"], r["gflops_per_s"]), fontsize=7,
                    xytext=(8, 9 * (i - len(d["decode"]) / 2)), textcoords="offset points",
                    arrowprops={"arrowstyle": "-", "lw": 0.5})
    ys = [r["gflops_per_s"] for r in d["prefill"] + d["decode"]]
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(min(ys + [bw * lo]) / 3, peak * 3),
           xlabel="arithmetic intensity (FLOP/byte)",
           ylabel="GFLOP/s", title=f"{d['model']}: prefill vs decode, {d['threads']} threads")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    return save_figure(fig, path)


def print_table(d: dict[str, Any]) -> None:
    kv = d.get("kv_cache_dtype", d["dtype"])
    print(f"{d['model']} (--dtype {d.get('config_dtype', d['dtype'])}: {d['dtype']} activations, {kv} KV cache) "
          f"on {d['device']}, "
          f"{d['threads']} threads, CPU {d['cpu']}")
    print(f"machine ceilings: memory {d['memory_bandwidth_gb_per_s']:.1f} GB/s (copy of {d['copy_mib']} MiB), "
          f"{d['read_bandwidth_gb_per_s']:.1f} GB/s (read of 1 GiB), "
          f"compute {d['peak_gflops_per_s']:.1f} GFLOP/s ({d['matmul_n']}^2 matmul), "
          f"ridge at {d['ridge_intensity']:.1f} FLOP/byte")
    print()
    print("prefill (time to first token; compute-bound)")
    print(f"{'prompt':>7s} {'TTFT ms':>9s} {'tok/s':>8s} {'GFLOP':>7s} {'GFLOP/s':>8s} {'% peak':>7s} {'FLOP/B':>7s}")
    for r in d["prefill"]:
        print(f"{r['prompt_len']:7d} {r['ttft_s'] * 1e3:9.1f} {r['tokens_per_s']:8.1f} {r['flops'] / 1e9:7.3g} "
              f"{r['gflops_per_s']:8.1f} {100 * r['fraction_of_peak']:6.0f}% {r['intensity']:7.1f}")
    print()
    print(f"decode (median time per output token; memory-bound: weights {fmt_bytes(d['weight_bytes_read'])} "
          f"+ KV {d['kv_bytes_per_token']:,} B x context per token)")
    print(f"{'context':>7s} {'ms/token':>9s} {'tok/s':>8s} {'KV read':>10s} {'MB read':>8s} {'GB/s':>6s} "
          f"{'% copy':>7s} {'% read':>7s} {'FLOP/B':>7s}")
    for r in d["decode"]:
        print(f"{r['context']:7d} {r['time_per_token_s'] * 1e3:9.2f} {r['tokens_per_s']:8.1f} "
              f"{fmt_bytes(r['kv_bytes_per_token_read']):>10s} {r['bytes_per_token'] / 1e6:8.1f} "
              f"{r['gb_per_s']:6.1f} {100 * r['fraction_of_bandwidth']:6.0f}% "
              f"{100 * r['fraction_of_read_bandwidth']:6.0f}% {r['intensity']:7.2f}")
    from kvlm.bench.step_breakdown import PARTS

    print()
    print("decode step breakdown (ms per step; host = scheduling, metadata, detokenizing, timing hooks)")
    print(f"{'context':>7s} " + " ".join(f"{p:>9s}" for p in PARTS))
    for r in d["decode"]:
        b = r["breakdown_s"]
        print(f"{r['context']:7d} " + " ".join(f"{b[p] * 1e3:9.2f}" for p in PARTS))


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 512, 1024])
    p.add_argument("--decode-steps", type=int, default=24, help="timed decode steps per context (median)")
    p.add_argument("--repeats", type=int, default=2, help="prefill runs per prompt length (best kept)")
    p.add_argument("--copy-mib", type=int, default=256, help="tensor size of the bandwidth test")
    p.add_argument("--matmul-n", type=int, default=2048, help="matrix size of the compute test")
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--plot", metavar="FILE", help="write a roofline PNG")


def run_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(a.model, threads=a.threads, prompt_lens=tuple(a.prompt_lens), contexts=tuple(a.contexts),
               decode_steps=a.decode_steps, repeats=a.repeats, copy_mib=a.copy_mib, matmul_n=a.matmul_n,
               dtype=a.dtype, kv_cache_dtype=a.kv_cache_dtype)


BENCH = Bench("latency", "TTFT vs prompt length, time per token vs context, on a measured roofline", add_args,
              run_args, print_table, plot)

if __name__ == "__main__":
    standalone(BENCH)
