"""llama.cpp's side of `kvlm bench quality`, run as a separate process by the peer's own interpreter.

Like `llama_cpp_worker.py` it imports only the standard library, numpy and `llama_cpp` (never kvlm or
torch), and is run by path:

    PYTHON kvlm/bench/llama_cpp_quality.py MODEL.gguf < SPEC_JSON  -> one JSON line on stdout

SPEC: threads, first (the first scored position), windows (lists of token ids, kvlm's tokenization of
the text, so both engines score the same tokens), types ({name: ggml type id} of K and V), baseline (the
name the others are compared with). Each window is evaluated from an empty context with logits for every
position (flash attention on, n_batch 512); the logits at positions first .. end - 2 are scored against
the next token, the same positions as kvlm's. Per type: perplexity and, against the baseline's, the mean
and 99th percentile KL divergence and top-1 agreement, in float64 `ROWS` rows at a time.
"""

from __future__ import annotations

import json
import math
import sys

ROWS = 64


def _log_softmax(x):
    import numpy as np

    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def main(path: str, spec: dict) -> dict:
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    wins, first, base = spec["windows"], spec["first"], spec["baseline"]
    n_ctx = len(wins[0])
    names = [base, *(t for t in spec["types"] if t != base)]
    llms = {name: Llama(model_path=path, n_threads=spec["threads"], n_threads_batch=spec["threads"], n_ctx=n_ctx,
                        n_batch=min(n_ctx, 512), flash_attn=True, logits_all=True, type_k=spec["types"][name],
                        type_v=spec["types"][name], verbose=False) for name in names}
    stats = {name: {"nll": 0.0, "n": 0, "agree": 0, "kld": [], "d": 0.0, "d2": 0.0} for name in names}
    for win in wins:
        target = np.array(win[first + 1 :])
        kept = None
        for name in names:
            llm = llms[name]
            llm.reset()
            llm.eval(win)
            scores = llm.scores[first : len(win) - 1]  # (n, vocab) float32 logits
            st, rows = stats[name], []
            for r in range(0, scores.shape[0], ROWS):
                lp = _log_softmax(scores[r : r + ROWS])
                t = target[r : r + ROWS]
                st["nll"] -= float(lp[np.arange(len(t)), t].sum())
                st["n"] += len(t)
                if name == base:
                    rows.append(lp.astype(np.float32))
                else:
                    b = kept[r : r + ROWS].astype(np.float64)
                    st["kld"].append((np.exp(b) * (b - lp)).sum(-1))
                    st["agree"] += int((b.argmax(-1) == lp.argmax(-1)).sum())
                    dn = (b - lp)[np.arange(len(t)), t]  # per-token NLL minus the baseline's (quality.py's _Score)
                    st["d"] += float(dn.sum())
                    st["d2"] += float((dn * dn).sum())
            if name == base:
                kept = np.concatenate(rows)
    out = []
    base_ppl = math.exp(stats[base]["nll"] / stats[base]["n"])
    for name in names:
        st = stats[name]
        row = {"type": name, "tokens": st["n"], "ppl": math.exp(st["nll"] / st["n"])}
        if st["kld"]:
            k = np.concatenate(st["kld"])
            var = max(st["d2"] / st["n"] - (st["d"] / st["n"]) ** 2, 0.0)
            row.update(mean_kld=float(k.mean()), p99_kld=float(np.quantile(k, 0.99)),
                       top1_agreement=st["agree"] / st["n"], ppl_delta=row["ppl"] / base_ppl - 1,
                       ppl_delta_se=math.sqrt(var / max(st["n"] - 1, 1)))
        out.append(row)
    return {"version": getattr(llama_cpp, "__version__", "?"), "baseline": base, "flash_attn": True, "types": out}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], json.loads(sys.stdin.read()))))
