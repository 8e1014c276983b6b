"""llama.cpp's side of `kvlm bench compare`, run as a separate process by the peer's own interpreter.

llama-cpp-python usually lives in another virtual environment (it compiles llama.cpp for ~15 min), so
this file imports only the standard library and `llama_cpp`, never kvlm or torch. It is run by path:

    PYTHON kvlm/bench/llama_cpp_worker.py measure MODEL.gguf < SPEC_JSON  -> one JSON line on stdout
    PYTHON kvlm/bench/llama_cpp_worker.py whole MODEL.gguf THREADS TEXT N  -> N greedy tokens after TEXT
    PYTHON kvlm/bench/llama_cpp_worker.py lora MODEL.gguf LORA.gguf < SPEC_JSON  -> one JSON line on stdout

`measure` (SPEC: threads, n_ctx, prefill_ids, decode_ids, gen_tokens, contexts: [[ids, gen], ...], and
optionally kv_type, the ggml type of K and V, f16 by default): prefill = eval(prompt) on a fresh context +
sampling the first token; decode = eval([token]) + greedy sample per token, tokens/s over the steps after the
first token (kvlm's definition). `whole`: load, tokenize TEXT (special tokens parsed, as kvlm does for a
rendered chat), N greedy tokens, exit: the caller times the process and reads its peak RSS. `lora` (SPEC:
threads, n_ctx, decode_ids, gen_tokens, repeats): decode at batch 1 without and with a GGUF LoRA adapter
(llama.cpp applies it beside the base matmuls, unmerged, as kvlm does), alternating base, adapter, base, ...:
tokens/s of every run. Flash attention is on (llama.cpp's fastest CPU setting here) and n_threads =
n_threads_batch = the same threads as kvlm.
"""

from __future__ import annotations

import json
import sys
import time


def _load(path: str, threads: int, n_ctx: int, kv_type: int | None = None, lora_path: str | None = None):
    from llama_cpp import Llama

    kv = {} if kv_type is None else {"type_k": kv_type, "type_v": kv_type}  # ggml type ids (8: q8_0, 2: q4_0)
    return Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                 n_batch=min(n_ctx, 2048), flash_attn=True, verbose=False, lora_path=lora_path, **kv)


def _greedy(llm) -> int:
    return int(llm.sample(top_k=1, temp=0.0))


def _decode_tps(llm, ids: list[int], gen: int) -> float:
    llm.reset()  # a fresh context: eval() drops the cached entries past n_tokens = 0
    llm.eval(ids)
    tok = _greedy(llm)
    t = time.perf_counter()
    for _ in range(gen - 1):
        llm.eval([tok])
        tok = _greedy(llm)
    return (gen - 1) / (time.perf_counter() - t)


def measure(path: str, spec: dict) -> dict:
    import llama_cpp

    llm = _load(path, spec["threads"], spec["n_ctx"], spec.get("kv_type"))
    _decode_tps(llm, spec["decode_ids"][:8], 3)  # warm-up: thread pool, first-call allocations
    llm.reset()
    t = time.perf_counter()
    llm.eval(spec["prefill_ids"])
    _greedy(llm)
    prefill_s = time.perf_counter() - t
    out = {"version": getattr(llama_cpp, "__version__", "?"), "prefill_s": prefill_s,
           "prefill_tokens_per_s": len(spec["prefill_ids"]) / prefill_s,
           "decode_tokens_per_s": _decode_tps(llm, spec["decode_ids"], spec["gen_tokens"]),
           "context_decode": [{"context": len(ids), "tokens_per_s": _decode_tps(llm, ids, gen)}
                              for ids, gen in spec["contexts"]]}
    return out


def measure_lora(path: str, lora_path: str, spec: dict) -> dict:
    import llama_cpp

    llms = {"base": _load(path, spec["threads"], spec["n_ctx"]),
            "lora": _load(path, spec["threads"], spec["n_ctx"], lora_path=lora_path)}
    for llm in llms.values():
        _decode_tps(llm, spec["decode_ids"][:8], 3)  # warm-up
    rates: dict[str, list[float]] = {"base": [], "lora": []}
    for _ in range(spec["repeats"]):
        for which, llm in llms.items():
            rates[which].append(_decode_tps(llm, spec["decode_ids"], spec["gen_tokens"]))
    return {"version": getattr(llama_cpp, "__version__", "?"), "runs": rates}


def whole(path: str, threads: int, text: str, n: int) -> None:
    llm = _load(path, threads, 1024)
    ids = llm.tokenize(text.encode(), add_bos=False, special=True)
    llm.eval(ids)
    pieces = []
    for _ in range(n):
        tok = _greedy(llm)
        pieces.append(tok)
        llm.eval([tok])
    sys.stdout.write(llm.detokenize(pieces).decode("utf-8", "replace") + "\n")


if __name__ == "__main__":
    mode, model = sys.argv[1], sys.argv[2]
    if mode == "measure":
        print(json.dumps(measure(model, json.loads(sys.stdin.read()))))
    elif mode == "lora":
        print(json.dumps(measure_lora(model, sys.argv[3], json.loads(sys.stdin.read()))))
    else:
        whole(model, int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
