#!/usr/bin/env python3
"""Which calibration input the engine's K center needs: built-in text, seeded random ids, the scored text
(docs/kv_quant.md records the runs).

An int4 (or int8) engine stores k - mu, mu the mean post-RoPE key per layer and kv head from one prefill
at load (`kvlm/model/k_center.py`: `CALIBRATION_TEXT` repeated to 1,024 tokens). This scores, on `kvlm
bench quality`'s windows and scoring, engines whose mu came from other inputs, set on their cache after load:

* `none`: mu = 0 (k - 0 = k: the uncentered cache, bit for bit);
* `seeded-N`: N ids uniform over the vocabulary from `random.Random(0)`;
* `zipf-N`: N seeded ids drawn with weight 1 / rank of the id past the special tokens (BPE ids follow
  merge order, roughly text's token frequencies; no text);
* `builtin-N`: `CALIBRATION_TEXT` (a page of prose written for this, in `k_center.py`) tokenized,
  repeated to N tokens (the engine's own is builtin-1024);
* `text-N`: the first N tokens of the King James text from character 2,000,000 (not among the scored
  windows, which start at its beginning), tokenized by the model's tokenizer.

    python scripts/experiments/kv_k_center_calibration.py [--chunks 6] [--dtype float32] [--kv int4]

The last line is one JSON document.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time

import torch

from kvlm.bench import quality
from kvlm.engine.engine import Engine
from kvlm.kernels import native
from kvlm.model.k_center import CALIBRATION_TEXT, mean_keys

p = argparse.ArgumentParser()
p.add_argument("--chunks", type=int, default=6)
p.add_argument("--dtype", default="float32", choices=["auto", "float32"])
p.add_argument("--kv", default="int4", choices=["int8", "int4"])
p.add_argument("--variants", nargs="+", default=["none", "seeded-256", "seeded-512", "seeded-1024", "text-1024"])
a = p.parse_args()
torch.set_num_threads(2)
context, first = 1024, 512

engines = quality._engines(quality.DEFAULT_MODEL, 2, [a.dtype], [a.kv], context, 256)
base = engines[(a.dtype, "float32")]
tok, vocab = base.tokenizer, base.model_config.vocab_size
text_path, _ = quality.text_file(None)  # the bench's text (the King James Bible)
raw_bytes = text_path.read_bytes()
raw = raw_bytes.decode("utf-8", "ignore")
text_ids = tok.encode(raw[2_000_000 : 2_000_000 + 40_000], add_special_tokens=False)
builtin = tok.encode(CALIBRATION_TEXT, add_special_tokens=False)
in_place = native.active_isa() != "reference"


def seeded_ids(vocab_size: int, n: int) -> list[int]:
    """n ids uniform over the vocabulary, seeded (the engine's calibration before the built-in text)."""
    rng = random.Random(0)
    return [rng.randrange(vocab_size) for _ in range(n)]


def zipf_ids(vocab_size: int, n: int, first: int = 17) -> list[int]:
    """n seeded ids >= first (SmolLM2: past its special tokens) drawn with weight 1 / rank, rank = id - first
    + 1: BPE ids follow merge order, so this mimics text's unigram frequencies without any text."""
    rng = random.Random(0)
    return rng.choices(range(first, vocab_size), weights=[1 / (i + 1) for i in range(vocab_size - first)], k=n)


load_s: dict[str, float] = {}
variants: dict[tuple[str, str], object] = {(a.dtype, "float32"): base}
for name in a.variants:
    kind, _, n = name.partition("-")
    eng = engines[(a.dtype, a.kv)] if name == "builtin-1024" else Engine(quality.DEFAULT_MODEL, dataclasses.replace(
        engines[(a.dtype, a.kv)].config), quiet=True)
    t0 = time.perf_counter()
    if kind == "none":
        mu = torch.zeros_like(eng.k_center)
    else:
        ids = (seeded_ids(vocab, int(n)) if kind == "seeded" else text_ids[: int(n)] if kind == "text"
               else zipf_ids(vocab, int(n)) if kind == "zipf" else (builtin * (int(n) // len(builtin) + 1))[: int(n)])
        mu = mean_keys(eng.model, ids, in_place).contiguous()
    load_s[name] = time.perf_counter() - t0
    if name == "builtin-1024":
        assert torch.equal(mu, eng.k_center), "the engine's own center is builtin-1024"
    eng.kv_cache.k_center = mu
    variants[(a.dtype, name)] = eng

text_ids_all = tok.encode(raw_bytes[: a.chunks * context * 8].decode("utf-8", "ignore"), add_special_tokens=False)
wins = quality.windows(text_ids_all, context, a.chunks)
pairs = [((a.dtype, "float32"), None)] + [((a.dtype, n), (a.dtype, "float32")) for n in a.variants]
scores = {pair: quality._Score() for pair in pairs}
for w, win in enumerate(wins):
    quality.log(f"window {w + 1}/{len(wins)}")
    quality._score_window(variants, win, first, scores, pairs)
results = {key[1]: s.result() for (key, _), s in scores.items()}
b = results.pop("float32")
for name, r in results.items():
    r["ppl_delta"] = r["ppl"] / b["ppl"] - 1
    r["calibration_s"] = load_s[name]
    print(f"{name:12} ppl {r['ppl']:.4f} ({r['ppl_delta']:+.3%} ± {r['ppl_delta_se']:.3%})  mean KLD "
          f"{r['mean_kld']:.2e}  p99 KLD {r['p99_kld']:.2e}  top-1 {r['top1_agreement']:.2%}  "
          f"mu in {load_s[name]:.2f} s")
print(json.dumps({"dtype": a.dtype, "kv": a.kv, "chunks": a.chunks, "baseline_ppl": b["ppl"], **results}))
