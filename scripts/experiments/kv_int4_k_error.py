#!/usr/bin/env python3
"""Where int4 K/V loses quality on a model, and what centering K would buy (docs/kv_quant.md records a run).

`kvlm bench quality` (its windows, its scoring, --dtype float32 by default) on variants the engine does
not offer, made by replacing the paged cache's write (`PagedKVCache.write`) in this process:

* `int4-K`: K stored at int4 precision, V at int8: an int8 cache whose K codes are int4's (same scale,
  levels, integers the int8 layout holds exactly); `int4-V` the other way round. Which of K or V costs.
* `int4-centered-K`: an int4 cache storing K - mu[layer, kv head], mu the mean K row (post-RoPE) over
  `--calibration-tokens` tokens of a different stretch of the text (from character 2,000,000). Attention
  is unchanged by a constant added to every key (q . (k - mu) = q . k - q . mu, the same for every key
  of a row, and softmax ignores it), so mu changes nothing but what the codes must carry.

    python scripts/experiments/kv_int4_k_error.py [--chunks 6] [--dtype float32]

Its recorded run (docs/results/kv_int4_k_error.txt) is from the tree before the engine centered K itself
(`kvlm/kv_cache/k_center.py`); on a tree with it, the `int4` row is the centered engine's, and
`scripts/experiments/kv_k_center_calibration.py` compares calibration inputs instead.

The last line is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from kvlm.bench import quality
from kvlm.kernels import kv_quant
from kvlm.kv_cache import storage
from kvlm.paths import kvlm_home

p = argparse.ArgumentParser()
p.add_argument("--chunks", type=int, default=6)
p.add_argument("--dtype", default="float32", choices=["auto", "float32"])
p.add_argument("--calibration-tokens", type=int, default=2048)
a = p.parse_args()

original_write = storage.PagedKVCache.write


def int4_as_int8(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) -> int8-layout codes holding int4's values exactly (int4's scale, its levels as int8 codes)."""
    raw = kv_quant.quantize(x, kv_quant.INT4)
    *lead, n = raw.shape
    g = raw.reshape(*lead, n // 18, 18)
    b = g[..., 2:]
    levels = torch.tensor(kv_quant.Q4_LEVELS, dtype=torch.int8)
    c = levels[torch.cat([b & 15, b >> 4], -1).long()].view(torch.uint8)
    return torch.cat([g[..., :2], c], -1).reshape(*lead, n // 18 * 34)


calls = [0]


def patched_write(enc_k, enc_v, floats=False):  # noqa: ANN001, ANN202 (an experiment's monkeypatch)
    """A write storing enc_k(layer, k) and enc_v(layer, v); into quantized caches only, unless `floats`."""
    def write(self, layer, k, v, meta):  # noqa: ANN001, ANN202
        if isinstance(self.element, kv_quant.KVQuantFormat) == floats:
            return original_write(self, layer, k, v, meta)
        calls[0] += 1
        kc, vc = self.k[layer], self.v[layer]
        kvh, row = kc.shape[2], kc.shape[3]
        kc.view(-1, kvh, row).index_copy_(0, meta.slot_mapping, enc_k(layer, k))
        vc.view(-1, kvh, row).index_copy_(0, meta.slot_mapping, enc_v(layer, v))
    return write


def score(kv: str, **kw: object) -> dict:
    doc = quality.run(chunks=a.chunks, kv_cache_dtypes=(kv,), dtypes=(a.dtype,), **kw)
    row = next(r for r in doc["rows"] if r["against"] is not None)
    return {k: row[k] for k in ("ppl", "ppl_delta", "mean_kld", "p99_kld", "top1_agreement")}


results: dict[str, dict] = {}
int8 = lambda layer, x: kv_quant.quantize(x, kv_quant.INT8)  # noqa: E731
int4 = lambda layer, x: int4_as_int8(x)  # noqa: E731
results["int4"] = score("int4")
storage.PagedKVCache.write = patched_write(int4, int8)
results["int4-K"] = score("int8")
storage.PagedKVCache.write = patched_write(int8, int4)
results["int4-V"] = score("int8")

# calibration: the mean K row per layer and kv head over another stretch of the text, float32 cache
sums: dict[int, list[torch.Tensor]] = {}


def record(layer, k):  # noqa: ANN001, ANN202
    sums.setdefault(layer, []).append(k.detach().clone())
    return k


storage.PagedKVCache.write = original_write
text, _ = quality.kjv_text(kvlm_home())
with tempfile.TemporaryDirectory() as tmp:
    cal = Path(tmp) / "calibration.txt"
    cal.write_text(text.read_text(encoding="utf-8")[2_000_000:2_000_000 + a.calibration_tokens * 8], encoding="utf-8")
    storage.PagedKVCache.write = patched_write(record, lambda layer, v: v, floats=True)  # the float32 cache
    quality.run(chunks=a.calibration_tokens // 1024, kv_cache_dtypes=("float32",), dtypes=(a.dtype,), text=str(cal))
mu = {layer: torch.cat(ks).mean(0) for layer, ks in sums.items()}  # (kv_heads, D) per layer
storage.PagedKVCache.write = patched_write(lambda layer, k: kv_quant.quantize(k - mu[layer], kv_quant.INT4),
                                           lambda layer, v: kv_quant.quantize(v, kv_quant.INT4))
results["int4-centered-K"] = score("int4")
storage.PagedKVCache.write = original_write
assert calls[0] > 0 and len(mu) > 0, "the paged cache's write was not used"

for name, r in results.items():
    print(f"{name:16} ppl {r['ppl']:.4f} ({r['ppl_delta']:+.3%})  mean KLD {r['mean_kld']:.2e}  "
          f"p99 KLD {r['p99_kld']:.2e}  top-1 {r['top1_agreement']:.2%}")
print(json.dumps({"dtype": a.dtype, "chunks": a.chunks, "calibration_tokens": a.calibration_tokens, **results}))
