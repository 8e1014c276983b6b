"""`kvlm bench decode`: prefill tokens/s, decode tokens/s with and without the KV cache, peak memory,
and, when transformers is installed, Hugging Face's decode on the same GGUF side by side in one run.

Each figure is the best of `--repeats` runs, measured alternately for kvlm and the peer so that both
see the same machine load. Usage: `python -m kvlm.bench.decode` or `kvlm bench decode [MODEL]`.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import time
from datetime import datetime, timezone
from typing import Any

import torch

from kvlm.bench.plotting import cpu_name


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _prompt_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 20000), (n,), generator=g).tolist()


def _kvlm_run(llm: Any, ids: list[int], max_tokens: int) -> tuple[float, float | None]:
    """(TTFT seconds, decode tokens/s) of one greedy request with exactly max_tokens outputs."""
    from kvlm.sampling_params import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                       use_tqdm=False)[0]
    return out.metrics.ttft or 0.0, out.metrics.decode_tokens_per_s


def _hf_times(model: Any, ids: list[int], max_tokens: int) -> tuple[float, float]:
    """HF: (prefill seconds, decode tokens/s) from generate() with 1 and with max_tokens new tokens."""
    x = torch.tensor([ids])
    kw = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(x, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kw)
        tn = time.perf_counter() - t
    return t1, (max_tokens - 1) / max(tn - t1, 1e-9)


def run(model: str = "smollm2-135m", threads: int = 2, prompt_len: int = 512, decode_prompt_len: int = 32,
        gen_tokens: int = 128, no_cache_tokens: int = 32, repeats: int = 3, dtype: str = "float32",
        compare_hf: bool = True, log: Any = print) -> dict[str, Any]:
    from kvlm.llm import LLM

    torch.set_num_threads(threads)
    llm = LLM(model, dtype=dtype, num_threads=threads, max_num_seqs=1, kv_cache_layout="contiguous")
    vocab = llm.llm_engine.model_config.vocab_size
    long_ids, short_ids = _prompt_ids(vocab, prompt_len), _prompt_ids(vocab, decode_prompt_len, seed=1)
    _kvlm_run(llm, short_ids, 4)  # warm-up

    hf = None
    if compare_hf:
        hf = _load_hf(llm.llm_engine.model_path, threads)
        if hf is None:
            log("transformers (with gguf support) not installed: skipping the Hugging Face comparison")

    res: dict[str, list[float]] = {k: [] for k in ("prefill", "decode", "hf_prefill", "hf_decode")}
    for r in range(repeats):
        ttft, _ = _kvlm_run(llm, long_ids, 1)
        res["prefill"].append(prompt_len / ttft)
        _, dec = _kvlm_run(llm, short_ids, gen_tokens)
        res["decode"].append(dec or 0.0)
        if hf is not None:
            t1, hdec = _hf_times(hf, short_ids, gen_tokens)
            res["hf_decode"].append(hdec)
            h1, _ = _hf_times(hf, long_ids, 2)
            res["hf_prefill"].append(prompt_len / h1)
        log(f"  round {r + 1}/{repeats}: kvlm decode {res['decode'][-1]:.1f} tok/s"
            + (f", HF decode {res['hf_decode'][-1]:.1f} tok/s" if hf is not None else ""))
    peak_kvlm = _peak_rss_mib() if hf is None else None
    del llm
    gc.collect()

    nc = LLM(model, dtype=dtype, num_threads=threads, max_num_seqs=1, enable_kv_cache=False)
    nocache = max(_kvlm_run(nc, short_ids, no_cache_tokens)[1] or 0.0 for _ in range(repeats))
    del nc

    best = {k: max(v) if v else None for k, v in res.items()}
    doc = {
        "bench": "decode", "model": model, "dtype": dtype, "threads": threads,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "cpu": cpu_name(),
        "torch": torch.__version__, "prompt_len": prompt_len, "decode_prompt_len": decode_prompt_len,
        "gen_tokens": gen_tokens, "repeats": repeats,
        "prefill_tokens_per_s": best["prefill"], "decode_tokens_per_s": best["decode"],
        "decode_no_cache_tokens_per_s": nocache, "no_cache_tokens": no_cache_tokens,
        "cache_speedup": best["decode"] / nocache if nocache else None,
        "hf_prefill_tokens_per_s": best["hf_prefill"], "hf_decode_tokens_per_s": best["hf_decode"],
        "decode_vs_hf": best["decode"] / best["hf_decode"] if best["hf_decode"] else None,
        "peak_rss_mib": round(_peak_rss_mib(), 1), "peak_rss_kvlm_only_mib": peak_kvlm,
    }
    return doc


def _load_hf(path: Any, threads: int) -> Any:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    from pathlib import Path

    p = Path(path)
    torch.set_num_threads(threads)
    if p.suffix == ".gguf":
        m = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    else:
        m = AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32)
    return m.eval()


def print_table(d: dict[str, Any]) -> None:
    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.1f}"

    print(f"{'':28s} {'kvlm':>10s} {'HF transformers':>16s}")
    print(f"{'prefill tok/s (' + str(d['prompt_len']) + ' tokens)':28s} {f(d['prefill_tokens_per_s']):>10s} {f(d['hf_prefill_tokens_per_s']):>16s}")
    print(f"{'decode tok/s (KV cache)':28s} {f(d['decode_tokens_per_s']):>10s} {f(d['hf_decode_tokens_per_s']):>16s}")
    print(f"{'decode tok/s (no cache)':28s} {f(d['decode_no_cache_tokens_per_s']):>10s}")
    if d["decode_vs_hf"]:
        print(f"kvlm / HF decode: {d['decode_vs_hf']:.2f}x   cache speed-up: {f(d['cache_speedup'])}x   peak RSS {d['peak_rss_mib']:.0f} MiB")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("decode", help="prefill/decode tokens/s with and without the KV cache, vs HF transformers")
    _add_args(p)
    p.set_defaults(func=main_args)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--no-cache-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face comparison")


def main_args(a: argparse.Namespace) -> int:
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    d = run(a.model, a.threads, a.prompt_len, 32, a.gen_tokens, a.no_cache_tokens, a.repeats, a.dtype,
            compare_hf=not a.no_hf, log=log)
    print_table(d)
    print(json.dumps(d))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m kvlm.bench.decode")
    _add_args(parser)
    raise SystemExit(main_args(parser.parse_args()))
