"""`kvlm bench throughput`: offline throughput of continuous batching vs one request at a time, and vs
Hugging Face transformers' padded batched `generate`, on the same seeded random workload in one run.

Workload: N prompts of random token ids, prompt lengths uniform in [in_min, in_max], output lengths
uniform in [out_min, out_max], greedy, ignore_eos (every request produces exactly its output length).
Reports output tokens/s, total tokens/s, peak KV blocks and paging waste; the last line is JSON.
`--speculative METHOD` runs kvlm with speculative decoding (its drafts and acceptance are in the JSON's
kvlm_batched.speculative); the same command without it is the run to compare with.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from typing import Any

import torch

from kvlm.args import speculative_method
from kvlm.bench.common import (
    DEFAULT_MODEL,
    KV_CACHE_DTYPES,
    Bench,
    add_model_args,
    dtype_choices,
    load_hf,
    log,
    peak_rss_mib,
    run_header,
    standalone,
)
from kvlm.config import parse_bytes

# The compute dtypes throughput has always offered: auto (quantized GGUF weights) and the two dense paths
# it compares them with.
THROUGHPUT_DTYPES = dtype_choices("auto", "float32", "bfloat16")


def make_workload(n: int, vocab: int, in_range: tuple[int, int], out_range: tuple[int, int],
                  seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, min(vocab, 20000)) for _ in range(rng.randint(*in_range))] for _ in range(n)]
    return prompts, [rng.randint(*out_range) for _ in range(n)]


def _rates(seconds: float, n_out: int, prompts: list[list[int]]) -> dict[str, float]:
    """Wall time, output tokens/s and (prompt + output) tokens/s of one run over `prompts`."""
    return {"seconds": seconds, "output_tokens_per_s": n_out / seconds,
            "total_tokens_per_s": (n_out + sum(map(len, prompts))) / seconds}


def run_kvlm_batched(llm: Any, prompts: list[list[int]], outs: list[int]) -> dict[str, Any]:
    """All requests at once through the engine; tracks peak blocks and paging waste per step."""
    from kvlm.sampling_params import SamplingParams

    eng = llm.llm_engine
    bm, bpt = eng.block_manager, eng.kv_bytes_per_token
    t0 = time.perf_counter()
    reqs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=o, ignore_eos=True))
            for p, o in zip(prompts, outs)]
    peak_blocks = peak_running = 0
    max_waste_per_req = 0.0
    while eng.has_unfinished:
        eng.step()
        running = eng.scheduler.running
        peak_blocks = max(peak_blocks, bm.num_used_blocks)
        peak_running = max(peak_running, len(running))
        for r in running:  # allocated minus filled slots, in blocks
            waste = (len(r.block_table) * bm.block_size - r.num_computed_tokens) / bm.block_size
            max_waste_per_req = max(max_waste_per_req, waste)
    dt = time.perf_counter() - t0
    n_out = sum(r.num_output_tokens for r in reqs)
    assert n_out == sum(outs)
    return {**_rates(dt, n_out, prompts), "peak_kv_blocks": peak_blocks,
            "peak_kv_bytes": peak_blocks * bm.block_size * bpt, "peak_running": peak_running,
            "peak_kv_tokens": peak_blocks * bm.block_size, "kv_pool_tokens": bm.num_blocks * bm.block_size,
            "kv_bytes_per_token": bpt,
            "max_waste_blocks_per_request": max_waste_per_req,
            "preemptions": sum(r.metrics.num_preemptions for r in reqs),
            "kv_pool_bytes": eng.kv_cache.nbytes, "steps": eng.num_steps}


def run_kvlm_sequential(llm: Any, prompts: list[list[int]], outs: list[int]) -> dict[str, Any]:
    from kvlm.sampling_params import SamplingParams

    t0 = time.perf_counter()
    n_out = 0
    for p, o in zip(prompts, outs):
        params = SamplingParams(temperature=0, max_tokens=o, ignore_eos=True)
        r = llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)
        n_out += len(r[0].outputs[0].token_ids)
    return _rates(time.perf_counter() - t0, n_out, prompts)


def run_hf_padded(model_path: Any, prompts: list[list[int]], outs: list[int],
                  batch_size: int) -> dict[str, Any] | None:
    """HF generate on left-padded batches; every row runs to the batch's longest output, only each
    request's own output tokens count as useful."""
    try:
        model = load_hf(model_path, torch.get_num_threads())
    except Exception as e:  # transformers without gguf support, etc.
        log(f"skipping Hugging Face comparison: {e}")
        return None
    if model is None:
        return None
    t0 = time.perf_counter()
    for s in range(0, len(prompts), batch_size):
        ps, os_ = prompts[s : s + batch_size], outs[s : s + batch_size]
        L = max(map(len, ps))
        ids = torch.zeros(len(ps), L, dtype=torch.long)
        mask = torch.zeros(len(ps), L, dtype=torch.long)
        for i, p in enumerate(ps):
            ids[i, L - len(p):] = torch.tensor(p)
            mask[i, L - len(p):] = 1
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(os_), min_new_tokens=max(os_),
                           do_sample=False, pad_token_id=0)
    return _rates(time.perf_counter() - t0, sum(outs), prompts)


def run(model: str = DEFAULT_MODEL, num_prompts: int = 32, in_range: tuple[int, int] = (64, 512),
        out_range: tuple[int, int] = (64, 256), seed: int = 0, threads: int = 2, max_num_seqs: int = 32,
        max_num_batched_tokens: int = 2048, sequential: bool = True, compare_hf: bool = True,
        dtype: str = "auto", baseline_dtype: str | None = None, kv_cache_dtype: str = "auto",
        kv_cache_memory: int | float | None = None, speculative: str | None = None,
        num_speculative_tokens: int = 5) -> dict[str, Any]:
    from kvlm.args import speculative_config
    from kvlm.llm import LLM

    torch.set_num_threads(threads)
    llm = LLM(model, dtype=dtype, num_threads=threads, max_num_seqs=max_num_seqs, kv_cache_dtype=kv_cache_dtype,
              max_num_batched_tokens=max_num_batched_tokens, max_model_len=in_range[1] + out_range[1],
              kv_cache_memory=kv_cache_memory,
              speculative_config=speculative_config(speculative, num_speculative_tokens))
    prompts, outs = make_workload(num_prompts, llm.llm_engine.model_config.vocab_size, in_range, out_range, seed)
    llm.generate({"prompt_token_ids": prompts[0][:16]}, use_tqdm=False)  # warm-up
    spec = llm.llm_engine.speculator
    if spec is not None:
        spec.stats = type(spec.stats)(accepted_per_pos=[0] * spec.k_max)  # not the warm-up's drafts
    batched = run_kvlm_batched(llm, prompts, outs)
    if spec is not None:
        batched["speculative"] = {"method": speculative, "num_speculative_tokens": num_speculative_tokens,
                                  **spec.stats.as_dict()}
    seq = run_kvlm_sequential(llm, prompts, outs) if sequential else None
    peak_rss = peak_rss_mib()  # before any second model loads
    base = None
    if baseline_dtype:  # the same continuous-batching run on another dtype (e.g. the float32 path), same process
        del llm
        gc.collect()
        llm = LLM(model, dtype=baseline_dtype, num_threads=threads, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens, max_model_len=in_range[1] + out_range[1])
        llm.generate({"prompt_token_ids": prompts[0][:16]}, use_tqdm=False)
        base = run_kvlm_batched(llm, prompts, outs)
        base["dtype"] = baseline_dtype
    hf = run_hf_padded(llm.llm_engine.model_path, prompts, outs, max_num_seqs) if compare_hf else None
    doc = run_header("throughput", model, threads)
    doc.update({
        "dtype": dtype, "kv_cache_dtype": kv_cache_dtype, "device": str(llm.llm_engine.device),
        "num_prompts": num_prompts, "prompt_len_range": list(in_range), "output_len_range": list(out_range),
        "seed": seed, "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(outs),
        "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
        "kvlm_batched": batched, "kvlm_sequential": seq, "hf_padded_batched": hf, "kvlm_batched_baseline": base,
        "vs_baseline": batched["output_tokens_per_s"] / base["output_tokens_per_s"] if base else None,
        "batching_speedup": batched["output_tokens_per_s"] / seq["output_tokens_per_s"] if seq else None,
        "vs_hf": batched["output_tokens_per_s"] / hf["output_tokens_per_s"] if hf else None,
        "peak_rss_mib": round(peak_rss, 1),  # of the main run (before the baseline or HF load)
    })
    return doc


def print_table(d: dict[str, Any]) -> None:
    print(f"{d['num_prompts']} prompts, {d['prompt_tokens']} prompt + {d['output_tokens']} output tokens, "
          f"{d['threads']} threads, {d['device']}")
    print(f"{'':40s} {'output tok/s':>12s} {'total tok/s':>12s} {'seconds':>9s}")
    base = d.get("kvlm_batched_baseline")
    kv = f", KV {d['kv_cache_dtype']}" if d.get("kv_cache_dtype", "auto") != "auto" else ""
    for name, key in ((f"kvlm continuous batching ({d['dtype']}{kv})", "kvlm_batched"),
                      ("kvlm one request at a time", "kvlm_sequential"),
                      (f"kvlm continuous batching ({base['dtype'] if base else ''})", "kvlm_batched_baseline"),
                      ("HF transformers padded batches", "hf_padded_batched")):
        r = d.get(key)
        if r:
            print(f"{name:40s} {r['output_tokens_per_s']:12.1f} {r['total_tokens_per_s']:12.1f} {r['seconds']:9.1f}")
    b = d["kvlm_batched"]
    if b.get("speculative"):
        s = b["speculative"]
        rate = "-" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.0%}"
        print(f"continuous batching with --speculative {s['method']} (k = {s['num_speculative_tokens']}): "
              f"{s['num_draft_tokens']} drafts in {s['num_drafts']} verifications, acceptance {rate}")
    print(f"peak KV: {b['peak_kv_blocks']} blocks = {b['peak_kv_tokens']} tokens of a {b['kv_pool_tokens']}-token "
          f"pool ({b['peak_kv_bytes'] / 2**20:.1f} MiB at {b['kv_bytes_per_token']} B/token), "
          f"peak running {b['peak_running']}, max paging waste {b['max_waste_blocks_per_request']:.2f} block/request, "
          f"preemptions {b['preemptions']}")
    if d["batching_speedup"]:
        print(f"continuous batching vs one at a time: {d['batching_speedup']:.2f}x")
    if d.get("vs_baseline"):
        print(f"continuous batching, {d['dtype']} vs {base['dtype']}: {d['vs_baseline']:.2f}x output tok/s")
    print(f"peak RSS of the {d['dtype']} run: {d['peak_rss_mib']:.0f} MiB")
    if d["vs_hf"]:
        print(f"continuous batching vs HF padded batching: {d['vs_hf']:.2f}x")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, nargs=2, default=[64, 512], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    add_model_args(p)  # MODEL and --threads: here, so that --help keeps listing --threads after --seed
    p.add_argument("--max-num-seqs", type=int, default=32, help="also the HF batch size")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--dtype", default="auto", choices=THROUGHPUT_DTYPES)
    p.add_argument("--baseline-dtype", default=None, choices=THROUGHPUT_DTYPES,
                   help="also run continuous batching with this dtype (e.g. float32) and report the ratio")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="K/V element type of the main run (the baseline keeps its dtype's)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV pool budget of the main run (e.g. 64MiB, 30%%): tokens held = budget / bytes per token")
    p.add_argument("--speculative", type=speculative_method, default=None, metavar="METHOD",
                   help="continuous batching with speculative decoding: ngram, suffix or draft:PATH (the "
                        "one-at-a-time run too)")
    p.add_argument("--num-speculative-tokens", type=int, default=5, help="with --speculative: drafts per step at most")
    p.add_argument("--no-sequential", action="store_true", help="skip the one-request-at-a-time run")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face comparison")


def run_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(a.model, num_prompts=a.num_prompts, in_range=tuple(a.input_len), out_range=tuple(a.output_len),
               seed=a.seed, threads=a.threads, max_num_seqs=a.max_num_seqs,
               max_num_batched_tokens=a.max_num_batched_tokens, sequential=not a.no_sequential,
               compare_hf=not a.no_hf, dtype=a.dtype, baseline_dtype=a.baseline_dtype,
               kv_cache_dtype=a.kv_cache_dtype,
               kv_cache_memory=None if a.kv_cache_memory is None else parse_bytes(a.kv_cache_memory),
               speculative=a.speculative, num_speculative_tokens=a.num_speculative_tokens)


BENCH = Bench("throughput", "continuous batching vs one at a time vs HF padded batching", add_args, run_args,
              print_table)

if __name__ == "__main__":
    standalone(BENCH)
