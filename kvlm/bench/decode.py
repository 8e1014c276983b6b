"""`kvlm bench decode`: prefill tokens/s, decode tokens/s with and without the KV cache, peak memory,
and, when transformers is installed, Hugging Face's decode on the same GGUF side by side in one run.
`--kv-cache-dtype` picks the K/V format (int8 / int4 too); `--contexts 512 2048 8192` adds decode tokens/s
at those contexts (`--context-gen` tokens timed, ending at the context).

Each figure is the best of `--repeats` runs, measured alternately for kvlm and the peer so that both
see the same machine load. Usage: `python -m kvlm.bench.decode` or `kvlm bench decode [MODEL]`.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable
from typing import Any

import torch

from kvlm.bench.common import (
    DEFAULT_MODEL,
    KV_CACHE_DTYPES,
    Bench,
    add_model_args,
    background_load,
    dtype_choices,
    hf_times,
    kvlm_times,
    load_hf,
    log,
    peak_rss_mib,
    prompt_ids,
    run_header,
    standalone,
)

# decode has always offered the dense float32 path (the dtype of its HF peer) and bfloat16.
DECODE_DTYPES = dtype_choices("float32", "bfloat16")


def run(model: str = DEFAULT_MODEL, threads: int = 2, prompt_len: int = 512, decode_prompt_len: int = 32,
        gen_tokens: int = 128, no_cache_tokens: int = 32, repeats: int = 3, dtype: str = "float32",
        compare_hf: bool = True, log: Callable[[str], None] = log, adaptive_threads: bool = True,
        kv_cache_dtype: str = "auto", contexts: tuple[int, ...] = (), context_gen: int = 16) -> dict[str, Any]:
    from kvlm.llm import LLM

    torch.set_num_threads(threads)
    if any(c <= context_gen for c in contexts):
        raise ValueError(f"--contexts must each be more than --context-gen ({context_gen})")
    max_len = {"max_model_len": max(contexts) + 1} if contexts else {}
    llm = LLM(model, dtype=dtype, num_threads=threads, max_num_seqs=1, kv_cache_layout="contiguous",
              adaptive_threads=adaptive_threads, kv_cache_dtype=kv_cache_dtype, **max_len)
    vocab = llm.llm_engine.model_config.vocab_size
    long_ids, short_ids = prompt_ids(vocab, prompt_len), prompt_ids(vocab, decode_prompt_len, seed=1)
    kvlm_times(llm, short_ids, 4)  # warm-up

    hf = None
    if compare_hf:
        hf = load_hf(llm.llm_engine.model_path, threads)
        if hf is None:
            log("transformers (with gguf support) not installed: skipping the Hugging Face comparison")

    res: dict[str, list[float]] = {k: [] for k in ("prefill", "decode", "hf_prefill", "hf_decode")}
    for r in range(repeats):
        ttft, _ = kvlm_times(llm, long_ids, 1)
        res["prefill"].append(prompt_len / ttft)
        _, dec = kvlm_times(llm, short_ids, gen_tokens)
        res["decode"].append(dec or 0.0)
        if hf is not None:
            t1, hdec = hf_times(hf, short_ids, gen_tokens)
            res["hf_decode"].append(hdec)
            h1, _ = hf_times(hf, long_ids, 2)
            res["hf_prefill"].append(prompt_len / h1)
        log(f"  round {r + 1}/{repeats}: kvlm decode {res['decode'][-1]:.1f} tok/s"
            + (f", HF decode {res['hf_decode'][-1]:.1f} tok/s" if hf is not None else ""))
    context_decode = []
    for c in contexts:  # context_gen tokens timed after a prompt of c - context_gen: the last one at c
        ids = prompt_ids(vocab, c - context_gen, seed=c)
        tps = max(kvlm_times(llm, ids, context_gen)[1] or 0.0 for _ in range(repeats))
        context_decode.append({"context": c, "tokens_per_s": tps})
        log(f"  decode at {c} context: {tps:.1f} tok/s")
    peak_kvlm = peak_rss_mib() if hf is None else None
    kv_bytes = llm.llm_engine.kv_bytes_per_token
    del llm
    gc.collect()

    nc = LLM(model, dtype=dtype, num_threads=threads, max_num_seqs=1, enable_kv_cache=False,
             adaptive_threads=adaptive_threads, kv_cache_dtype=kv_cache_dtype)
    nocache = max(kvlm_times(nc, short_ids, no_cache_tokens)[1] or 0.0 for _ in range(repeats))
    del nc

    best = {k: max(v) if v else None for k, v in res.items()}
    doc = run_header("decode", model, threads)
    doc.update({
        "dtype": dtype, "kv_cache_dtype": kv_cache_dtype, "kv_bytes_per_token": kv_bytes,
        "context_decode": context_decode, "context_gen": context_gen,
        "prompt_len": prompt_len, "decode_prompt_len": decode_prompt_len,
        "gen_tokens": gen_tokens, "repeats": repeats,
        "prefill_tokens_per_s": best["prefill"], "decode_tokens_per_s": best["decode"],
        "decode_no_cache_tokens_per_s": nocache, "no_cache_tokens": no_cache_tokens,
        "cache_speedup": best["decode"] / nocache if nocache else None,
        "hf_prefill_tokens_per_s": best["hf_prefill"], "hf_decode_tokens_per_s": best["hf_decode"],
        "decode_vs_hf": best["decode"] / best["hf_decode"] if best["hf_decode"] else None,
        "peak_rss_mib": round(peak_rss_mib(), 1), "peak_rss_kvlm_only_mib": peak_kvlm,
        "adaptive_threads": adaptive_threads,
    })
    return doc


def print_table(d: dict[str, Any]) -> None:
    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.1f}"

    print(f"{'':28s} {'kvlm':>10s} {'HF transformers':>16s}")
    prefill = f"prefill tok/s ({d['prompt_len']} tokens)"
    print(f"{prefill:28s} {f(d['prefill_tokens_per_s']):>10s} {f(d['hf_prefill_tokens_per_s']):>16s}")
    print(f"{'decode tok/s (KV cache)':28s} {f(d['decode_tokens_per_s']):>10s} {f(d['hf_decode_tokens_per_s']):>16s}")
    print(f"{'decode tok/s (no cache)':28s} {f(d['decode_no_cache_tokens_per_s']):>10s}")
    for c in d.get("context_decode", []):
        print(f"{'decode tok/s at ' + str(c['context']) + ' context':28s} {f(c['tokens_per_s']):>10s}")
    if d["decode_vs_hf"]:
        print(f"kvlm / HF decode: {d['decode_vs_hf']:.2f}x   cache speed-up: {f(d['cache_speedup'])}x   "
              f"peak RSS {d['peak_rss_mib']:.0f} MiB")


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--no-cache-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=DECODE_DTYPES)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="K/V element type (int8 / int4: quantized codes, kvlm/kernels/kv_quant.py)")
    p.add_argument("--contexts", type=int, nargs="*", default=[],
                   help="also decode tokens/s at these contexts (e.g. 512 2048 8192)")
    p.add_argument("--context-gen", type=int, default=16, help="decode tokens timed at each --contexts")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face comparison")
    p.add_argument("--background-load", type=int, default=0, metavar="N",
                   help="run N CPU-bound processes beside the benchmark (a shared machine), stopped afterwards")
    p.add_argument("--no-adaptive-threads", action="store_true",
                   help="keep --threads threads even while other processes hold cores")


def run_args(a: argparse.Namespace) -> dict[str, Any]:
    # No --decode-prompt-len here (compare has one): decode always times its tokens after `run`'s
    # default 32-token prompt.
    if a.background_load < 0:
        raise ValueError("--background-load must be >= 0")
    with background_load(a.background_load):
        doc = run(a.model, threads=a.threads, prompt_len=a.prompt_len, gen_tokens=a.gen_tokens,
                  no_cache_tokens=a.no_cache_tokens, repeats=a.repeats, dtype=a.dtype, compare_hf=not a.no_hf,
                  adaptive_threads=not a.no_adaptive_threads, kv_cache_dtype=a.kv_cache_dtype,
                  contexts=tuple(a.contexts), context_gen=a.context_gen)
    doc["background_load"] = a.background_load
    return doc


BENCH = Bench("decode", "prefill/decode tokens/s with and without the KV cache, vs HF transformers",
              add_args, run_args, print_table)

if __name__ == "__main__":
    standalone(BENCH)
