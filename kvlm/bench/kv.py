"""`kvlm bench kv`: decode tokens/s by KV cache format, side by side in one process.

One engine per `--kv-cache-dtypes` format, default flags otherwise (`--dtype auto`, paged, the fused decode
step), one sequence at a time, no prefix cache, fixed threads; rounds alternate the formats, so all see the
same machine load, and each figure is the best of `--repeats` rounds. Per context C: `--context-gen` greedy
tokens timed after a prompt of C - context-gen seeded random ids (the last token attends to C); "short":
`--gen-tokens` tokens after a 32-token prompt (batch 1, short context). Also each format's KV bytes per
token. Until f97df0a this was `scripts/experiments/kv_decode_ab.py` (the same measurement, other random
prompts), which docs/kv_quant.md's earlier tables cite. Usage: `kvlm bench kv [MODEL]` or
`python -m kvlm.bench.kv`.
"""

from __future__ import annotations

import argparse
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

SHORT_PROMPT = 32


def run(model: str = DEFAULT_MODEL, threads: int = 2, kv_cache_dtypes: tuple[str, ...] = ("float32", "float16",
        "int8", "int4"), contexts: tuple[int, ...] = (512, 2048, 8192), context_gen: int = 16, gen_tokens: int = 128,
        repeats: int = 3) -> dict[str, Any]:
    from kvlm.llm import LLM

    max_len = max((*contexts, SHORT_PROMPT + gen_tokens))
    llms = {kv: LLM(model, num_threads=threads, kv_cache_dtype=kv, max_num_seqs=1, max_model_len=max_len,
                    enable_prefix_caching=False, adaptive_threads=False) for kv in kv_cache_dtypes}
    vocab = next(iter(llms.values())).llm_engine.model_config.vocab_size
    work = {"short": (prompt_ids(vocab, SHORT_PROMPT), gen_tokens),
            **{str(c): (prompt_ids(vocab, c - context_gen, seed=c), context_gen) for c in contexts}}
    best: dict[str, dict[str, float]] = {kv: {} for kv in kv_cache_dtypes}
    for r in range(repeats):
        for key, (ids, gen) in work.items():
            for kv, llm in llms.items():
                tps = kvlm_times(llm, ids, gen)[1] or 0.0
                best[kv][key] = max(best[kv].get(key, 0.0), tps)
                log(f"  round {r + 1}/{repeats} {key} {kv}: {tps:.1f} tok/s")
    doc = run_header("kv", model, threads)
    doc.update({"kv_cache_dtypes": list(kv_cache_dtypes), "contexts": list(contexts), "context_gen": context_gen,
                "gen_tokens": gen_tokens, "short_prompt": SHORT_PROMPT, "repeats": repeats,
                "kv_bytes_per_token": {kv: llm.llm_engine.kv_bytes_per_token for kv, llm in llms.items()},
                "decode_tokens_per_s": best})
    return doc


def print_table(d: dict[str, Any]) -> None:
    kvs = d["kv_cache_dtypes"]
    print(f"{d['model']}, {d['threads']} threads, CPU {d['cpu']}, best of {d['repeats']}: decode tokens/s; "
          f"short = {d['gen_tokens']} tokens after {d['short_prompt']}, C = {d['context_gen']} tokens ending at C")
    print(f"{'context':>8s} " + " ".join(f"{kv:>9s}" for kv in kvs))
    for key in ["short", *map(str, d["contexts"])]:
        print(f"{key:>8s} " + " ".join(f"{d['decode_tokens_per_s'][kv][key]:9.1f}" for kv in kvs))
    print(f"{'B/token':>8s} " + " ".join(f"{d['kv_bytes_per_token'][kv]:9d}" for kv in kvs))


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--kv-cache-dtypes", nargs="+", default=["float32", "float16", "int8", "int4"],
                   choices=KV_CACHE_DTYPES, help="the formats compared (default: float32 float16 int8 int4)")
    p.add_argument("--contexts", type=int, nargs="*", default=[512, 2048, 8192],
                   help="decode at these contexts (default: 512 2048 8192)")
    p.add_argument("--context-gen", type=int, default=16, help="decode tokens timed at each --contexts")
    p.add_argument("--gen-tokens", type=int, default=128, help="decode tokens timed after a 32-token prompt")
    p.add_argument("--repeats", type=int, default=3, help="rounds; each figure is the best")


def run_args(a: argparse.Namespace) -> dict[str, Any]:
    if a.context_gen < 2 or a.gen_tokens < 2 or a.repeats < 1:
        raise ValueError("--context-gen and --gen-tokens must be at least 2, --repeats at least 1")
    if any(c <= a.context_gen for c in a.contexts):
        raise ValueError("each of --contexts must be larger than --context-gen")
    if len(set(a.kv_cache_dtypes)) != len(a.kv_cache_dtypes):
        raise ValueError("--kv-cache-dtypes lists a format twice")
    return run(a.model, threads=a.threads, kv_cache_dtypes=tuple(a.kv_cache_dtypes), contexts=tuple(a.contexts),
               context_gen=a.context_gen, gen_tokens=a.gen_tokens, repeats=a.repeats)


BENCH = Bench("kv", "decode tokens/s by KV cache format (float32 / float16 / int8 / int4), side by side",
              add_args, run_args, print_table)

if __name__ == "__main__":
    standalone(BENCH)
