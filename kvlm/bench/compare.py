"""`kvlm bench compare`: one prefill and one decode workload, side by side in one invocation, on kvlm
and on whichever peers are installed:

* Hugging Face transformers: the same GGUF dequantized to float32 (`decode._load_hf`), same threads,
  greedy `generate` (`decode._hf_times`).
* llama.cpp through llama-cpp-python (`llama_cpp.Llama`): the same GGUF file run on its stored
  (quantized) weights, n_threads and n_threads_batch = the same threads. Prefill: `eval(prompt)` on a
  fresh context (`reset()`: llama.cpp drops the KV entries past n_tokens on the next eval) plus
  sampling the first token; decode: `eval([token])` + greedy `sample(top_k=1, temp=0)` per token.

Workload: a random prompt of `--prompt-len` tokens for prefill (tokens/s = prompt / time to first
token) and a `--decode-prompt-len` prompt followed by `--gen-tokens` greedy tokens for decode
(tokens/s = (gen - 1) / time after the first token, kvlm's own definition). Each figure is the best of
`--repeats`, measured round-robin so every engine sees the same machine load. An absent or failing
peer is reported as skipped with its reason, never as an error.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvlm.bench.plotting import run_header


class _LlamaCppPeer:
    """llama.cpp through llama-cpp-python on the same GGUF file."""

    def __init__(self, path: Path, threads: int, n_ctx: int) -> None:
        from llama_cpp import Llama  # ImportError -> reported as skipped by the caller

        # n_threads_batch defaults to every core; prefill would then not run on the same threads.
        self.llm = Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                         n_batch=n_ctx, verbose=False)

    def _next(self) -> int:
        return int(self.llm.sample(top_k=1, temp=0.0))  # greedy

    def prefill_s(self, ids: list[int]) -> float:
        self.llm.reset()  # fresh context: eval() first drops cached entries past n_tokens = 0
        t = time.perf_counter()
        self.llm.eval(ids)
        self._next()
        return time.perf_counter() - t

    def decode_tps(self, ids: list[int], gen: int) -> float:
        self.llm.reset()
        self.llm.eval(ids)
        tok = self._next()
        t = time.perf_counter()
        for _ in range(gen - 1):
            self.llm.eval([tok])
            tok = self._next()
        return (gen - 1) / (time.perf_counter() - t)


class _HFPeer:
    """Hugging Face transformers, float32, on the same GGUF (dequantized by transformers)."""

    def __init__(self, path: Path, threads: int) -> None:
        from kvlm.bench.decode import _load_hf

        self.model = _load_hf(path, threads)
        if self.model is None:
            raise ImportError("transformers is not installed")

    def prefill_s(self, ids: list[int]) -> float:
        import torch

        with torch.inference_mode():
            t = time.perf_counter()
            self.model.generate(torch.tensor([ids]), max_new_tokens=1, min_new_tokens=1, do_sample=False,
                                pad_token_id=0)
            return time.perf_counter() - t

    def decode_tps(self, ids: list[int], gen: int) -> float:
        from kvlm.bench.decode import _hf_times

        return _hf_times(self.model, ids, gen)[1]


class _KvlmEngine:
    def __init__(self, model: str, threads: int, max_len: int) -> None:
        from kvlm.llm import LLM

        self.llm = LLM(model, num_threads=threads, max_num_seqs=1, kv_cache_layout="contiguous", max_model_len=max_len)

    def prefill_s(self, ids: list[int]) -> float:
        from kvlm.bench.decode import _kvlm_run

        return _kvlm_run(self.llm, ids, 1)[0]

    def decode_tps(self, ids: list[int], gen: int) -> float:
        from kvlm.bench.decode import _kvlm_run

        return _kvlm_run(self.llm, ids, gen)[1] or 0.0


PEERS = {"hf": "HF transformers (float32)", "llama_cpp": "llama.cpp (GGUF weights as stored)"}


def run(model: str = "smollm2-135m", threads: int = 2, prompt_len: int = 256, decode_prompt_len: int = 32,
        gen_tokens: int = 64, repeats: int = 2, peers: tuple[str, ...] = ("hf", "llama_cpp"),
        log: Any = print) -> dict[str, Any]:
    import torch

    from kvlm.bench.decode import _prompt_ids

    torch.set_num_threads(threads)
    max_len = max(prompt_len, decode_prompt_len + gen_tokens) + 8
    engines: dict[str, Any] = {"kvlm": _KvlmEngine(model, threads, max_len)}
    path = engines["kvlm"].llm.llm_engine.model_path
    vocab = engines["kvlm"].llm.llm_engine.model_config.vocab_size
    long_ids, short_ids = _prompt_ids(vocab, prompt_len), _prompt_ids(vocab, decode_prompt_len, seed=1)

    results: dict[str, dict[str, Any]] = {"kvlm": {"name": "kvlm (float32)", "status": "ok"}}
    for key in PEERS:
        if key not in peers:
            results[key] = {"name": PEERS[key], "status": "skipped", "reason": "disabled by flag"}
            continue
        try:
            if key == "llama_cpp":
                if path.suffix != ".gguf":
                    raise ValueError(f"{path.name} is not a GGUF file")
                engines[key] = _LlamaCppPeer(path, threads, max_len + 8)
            else:
                engines[key] = _HFPeer(path, threads)
            results[key] = {"name": PEERS[key], "status": "ok"}
        except ImportError as e:
            results[key] = {"name": PEERS[key], "status": "skipped", "reason": f"not installed ({e})"}
        except Exception as e:  # a peer that cannot read this file is a skipped column, not a failed bench
            results[key] = {"name": PEERS[key], "status": "skipped", "reason": f"{type(e).__name__}: {e}"}
        if results[key]["status"] == "skipped":
            log(f"  {PEERS[key]}: skipped: {results[key]['reason']}")

    for key in list(engines):  # warm-up (first-call allocations, thread pools); a peer failing here is skipped
        try:
            engines[key].decode_tps(short_ids[:8], 3)
        except Exception as e:
            if key == "kvlm":
                raise
            del engines[key]
            results[key] = {"name": PEERS[key], "status": "skipped", "reason": f"{type(e).__name__}: {e}"}
            log(f"  {PEERS[key]}: skipped: {results[key]['reason']}")
    best: dict[str, dict[str, float]] = {k: {"prefill": 0.0, "decode": 0.0} for k in engines}
    for r in range(repeats):
        for key, eng in engines.items():
            torch.set_num_threads(threads)  # a peer may have changed the process-wide setting
            best[key]["prefill"] = max(best[key]["prefill"], prompt_len / eng.prefill_s(long_ids))
            best[key]["decode"] = max(best[key]["decode"], eng.decode_tps(short_ids, gen_tokens))
        log(f"  round {r + 1}/{repeats}: " + ", ".join(f"{k} decode {v['decode']:.1f} tok/s" for k, v in best.items()))

    k = best["kvlm"]
    for key, b in best.items():
        results[key].update({"prefill_tokens_per_s": b["prefill"], "decode_tokens_per_s": b["decode"]})
        if key != "kvlm":
            results[key].update({"kvlm_over_peer_prefill": k["prefill"] / b["prefill"],
                                 "kvlm_over_peer_decode": k["decode"] / b["decode"]})
    engines.clear()
    gc.collect()
    doc = run_header("compare", model, threads)
    doc.update({"model_file": path.name, "prompt_len": prompt_len, "decode_prompt_len": decode_prompt_len,
                "gen_tokens": gen_tokens, "repeats": repeats, "engines": results})
    return doc


def print_table(d: dict[str, Any]) -> None:
    print(f"{d['model']}, {d['threads']} threads: prefill of {d['prompt_len']} tokens; decode of "
          f"{d['gen_tokens']} tokens after {d['decode_prompt_len']}; best of {d['repeats']}")
    print(f"{'engine':36s} {'prefill tok/s':>13s} {'decode tok/s':>12s} {'kvlm/peer prefill':>17s} {'decode':>7s}")
    for key, r in d["engines"].items():
        if r["status"] != "ok":
            print(f"{r['name']:36s} skipped: {r['reason']}")
            continue
        ratios = ("", "") if key == "kvlm" else (f"{r['kvlm_over_peer_prefill']:.2f}x", f"{r['kvlm_over_peer_decode']:.2f}x")
        print(f"{r['name']:36s} {r['prefill_tokens_per_s']:13.1f} {r['decode_tokens_per_s']:12.1f} "
              f"{ratios[0]:>17s} {ratios[1]:>7s}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="the same prefill/decode workload on kvlm, HF transformers and llama.cpp")
    _add_args(p)
    p.set_defaults(func=main_args)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--decode-prompt-len", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-hf", action="store_true", help="skip Hugging Face transformers")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")


def main_args(a: argparse.Namespace) -> int:
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    peers = tuple(p for p, off in (("hf", a.no_hf), ("llama_cpp", a.no_llama_cpp)) if not off)
    d = run(a.model, a.threads, a.prompt_len, a.decode_prompt_len, a.gen_tokens, a.repeats, peers, log=log)
    print_table(d)
    print(json.dumps(d))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m kvlm.bench.compare")
    _add_args(parser)
    raise SystemExit(main_args(parser.parse_args()))
