#!/usr/bin/env python3
"""int4 K/V variants by fake quantization: what the position-0 key and non-uniform levels buy
(docs/kv_quant.md, "The position-0 key" and "Non-uniform int4 levels", record its runs).

`kvlm bench quality`'s windows and scoring (`--dtype float32`, 6 windows) on a float16 cache whose write is
replaced in this process: every key is stored as mu + dequantize(quantize(k - mu)) and every value as
dequantize(quantize(v)), int4 round trips in the model's basis (so attention reads what an int4 cache
would give back, to float16 rounding). mu is the engine's mean key (an int4 engine's K center). A variant
is `S:MODE:K:V`:

* S, MODE: what the first S positions of each window get: `float` (K and V kept in float), `Konly` /
  `Vonly` (only K or only V in float), `int8` (both at int8), `c0` / `c0k` (K, and for `c0` V too, centered
  on the mean position-0 key / value of 32 random 8-token prompts instead of mu, as an engine correcting
  the position-0 score would read it), `none` with S = 0 for the plain variant.
* K, V: `u` the engine's int4 quantizer, `l` the 16 levels of `kv_int4_levels.py`'s table under the same
  scale search (this script's own quantizer).

Recorded runs (docs/kv_quant.md) were made on the tree of commit e3569bd, where the engine's int4 is the
uniform one (on a later tree `u` is the engine's levels); WORKTREE is any new directory, KVLM this checkout:

    git worktree add WORKTREE e3569bd
    cd WORKTREE && PYTHONPATH=. python KVLM/scripts/experiments/kv_int4_fake_quant.py \\
        0:none:u:u 1:float:u:u 4:float:u:u 16:float:u:u 1:Konly:u:u 1:Vonly:u:u 1:c0k:u:u 1:c0k:l:u 1:c0k:l:l
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import time
from pathlib import Path

import torch

from kvlm import LLM, SamplingParams
from kvlm.bench import quality
from kvlm.kernels import kv_quant
from kvlm.kv_cache import storage

p = argparse.ArgumentParser()
p.add_argument("variants", nargs="+")
p.add_argument("--chunks", type=int, default=6)
a = p.parse_args()

spec = importlib.util.spec_from_file_location("kv_int4_levels", Path(__file__).with_name("kv_int4_levels.py"))
levels_mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
sys.argv = sys.argv[:1]
spec.loader.exec_module(levels_mod)  # type: ignore[union-attr]
TABLE = torch.tensor([-127, -102, -82, -66, -51, -38, -25, -12, 0, 13, 25, 39, 53, 69, 87, 111], dtype=torch.float32)
mode = {"k": "u", "v": "u"}


def fake(x: torch.Tensor, fmt: kv_quant.KVQuantFormat = kv_quant.INT4, which: str = "k") -> torch.Tensor:
    """x (..., D) -> its int4 (or `fmt`) round trip in the model's basis."""
    if fmt is kv_quant.INT4 and mode[which] == "l":
        *lead, D = x.shape
        g = kv_quant.hadamard(x.float().contiguous()).reshape(-1, 32)
        _, c, d = levels_mod.quantize(g, TABLE)
        return kv_quant.hadamard((TABLE[c] * d).reshape(*lead, D))
    raw = kv_quant.quantize(x.float().contiguous(), fmt)
    return kv_quant.unrotated(kv_quant.dequantize(raw, fmt, x.shape[-1]), fmt)


center = LLM("smollm2-135m", dtype="float32", kv_cache_dtype="int4", num_threads=2).llm_engine.k_center
mu = getattr(center, "mu", center).clone()  # (layers, kv_heads, D): a KeyCenter on later trees
sums: dict[int, list] = {}
original_write = storage.PagedKVCache.write


def record(self, layer, k, v, meta):  # noqa: ANN001, ANN202 (an experiment's monkeypatch)
    first = meta.positions == 0
    if bool(first.any()):
        s = sums.setdefault(layer, [0, 0.0, 0.0])
        s[0] += int(first.sum())
        s[1] = s[1] + k[first].double().sum(0)
        s[2] = s[2] + v[first].double().sum(0)
    return original_write(self, layer, k, v, meta)


storage.PagedKVCache.write = record
llm = LLM("smollm2-135m", dtype="float32", kv_cache_dtype="float32", num_threads=2)
V, rng = llm.llm_engine.model_config.vocab_size, random.Random(1)
llm.generate([{"prompt_token_ids": [rng.randrange(V) for _ in range(8)]} for _ in range(32)],
             SamplingParams(max_tokens=1, temperature=0))
del llm
c0 = {layer: (s[1] / s[0]).float() for layer, s in sums.items()}
cv0 = {layer: (s[2] / s[0]).float() for layer, s in sums.items()}
state = {"S": 0, "mode": "none"}


def write(self, layer, k, v, meta):  # noqa: ANN001, ANN202
    if self.element is not torch.float16:
        return original_write(self, layer, k, v, meta)
    kc, vc = self.k[layer], self.v[layer]
    kvh, D = kc.shape[2], kc.shape[3]
    slots = self._group(layer, meta)[0]
    kk = k.float() - mu[layer]
    kq, vq = fake(kk), fake(v, which="v")
    m = state["mode"]
    ks, vs = kk, v.float()  # float
    if m == "int8":
        ks, vs = fake(kk, kv_quant.INT8), fake(v, kv_quant.INT8)
    elif m in ("c0", "c0k"):
        ks = fake(k.float() - c0[layer]) + c0[layer] - mu[layer]
        vs = fake(v.float() - cv0[layer], which="v") + cv0[layer] if m == "c0" else vq
    elif m == "Konly":
        vs = vq
    elif m == "Vonly":
        ks = kq
    first = (meta.positions < state["S"])[:, None, None]
    kc.view(-1, kvh, D).index_copy_(0, slots, (torch.where(first, ks, kq) + mu[layer]).half())
    vc.view(-1, kvh, D).index_copy_(0, slots, torch.where(first, vs, vq).half())


storage.PagedKVCache.write = write
for var in a.variants:
    S, state["mode"], mode["k"], mode["v"] = var.split(":")
    state["S"] = int(S)
    t = time.time()
    doc = quality.run(chunks=a.chunks, kv_cache_dtypes=("float16",), dtypes=("float32",))
    row = next(r for r in doc["rows"] if r["against"] is not None)
    print(var, {k: round(row[k], 5) for k in ("ppl_delta", "ppl_delta_se", "mean_kld", "p99_kld", "top1_agreement")},
          f"{time.time() - t:.0f}s", flush=True)
