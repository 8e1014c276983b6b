"""KV-cache size arithmetic: bytes per token, totals, and the context at which the cache outgrows the weights.

Plain arithmetic on `ModelConfig` (no torch), for `kvlm kv-size` and its plot. The shipped reference
shapes (`kvlm/configs/*.json`: published Hugging Face config.json values of Llama-3-8B/70B, Qwen2.5-7B,
Mistral-7B-v0.1 and SmolLM2-135M) are read from package data.

Per token the cache holds 2 (K and V) x layers x kv_heads x head_dim x b bytes. Crossover: a sequence
of C tokens holds C times that, the weights params x b bytes. With cache and weights in the same dtype b
cancels, so the crossover context params / (2 x layers x kv_heads x head_dim) is the same for fp32,
fp16, int8 and int4: quantizing both moves both curves by the same factor. GQA/MQA move it to the right
by heads / kv_heads.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from typing import Any

from kvlm.config import KV_DTYPES, KV_QUANT_BYTES_PER_VALUE, EngineConfig, ModelConfig
from kvlm.kv_cache.layer_groups import LayerGroups

# Bytes per element by the names `kvlm kv-size --dtype` accepts. int8 / int4 are the engine's quantized
# K/V formats, a float16 scale per 32 codes: 34 / 32 and 18 / 32 bytes per value (kernels/kv_quant.py).
DTYPE_BYTES: dict[str, float] = {"float32": 4.0, "fp32": 4.0, "float16": 2.0, "fp16": 2.0, "bfloat16": 2.0,
                                 "bf16": 2.0, **KV_QUANT_BYTES_PER_VALUE}
_SPELLINGS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def engine_kv_dtype() -> str:
    """The KV element type the engine stores with its default config (`--kv-cache-dtype auto`: the compute
    dtype, float32): `kvlm kv-size`'s default, so that its numbers are the pool the engine would make."""
    return EngineConfig().kv_cache_dtype_name


def describe_dtype(dtype: str) -> str:
    """What `kvlm kv-size` says about the dtype it sized with, relative to what the engine stores."""
    name, default = _SPELLINGS.get(dtype, dtype), engine_kv_dtype()
    if name == default:
        return f"{dtype}, the engine's default KV cache dtype (--kv-cache-dtype auto: the compute dtype)"
    if name in KV_DTYPES:
        return f"{dtype}, as --kv-cache-dtype {name} stores it (the engine's default is {default})"
    return f"{dtype}, a dtype the engine does not store K/V in (its default is {default})"


def known_configs() -> dict[str, ModelConfig]:
    """The shipped config.json files by model name (file stem), in name order."""
    folder = resources.files("kvlm") / "configs"  # package data, not a package: no __init__.py there
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".json")), key=lambda f: f.name)
    return {f.name.removesuffix(".json"): ModelConfig.from_hf_dict(json.loads(f.read_text())) for f in files}


def crossover_context(cfg: ModelConfig, kv_heads: int | None = None, batch: int = 1) -> int:
    """Smallest context (tokens per sequence, `batch` sequences) at which the KV cache is larger than the
    weights, both in the same dtype (so the dtype cancels)."""
    per_tok = cfg.kv_bytes_per_token(1.0, kv_heads=kv_heads) * batch
    return math.floor(cfg.num_parameters / per_tok) + 1


def known_summary(context: int, dtype_bytes: float, batch: int = 1) -> list[dict[str, Any]]:
    """One row per shipped reference model: its shape, KV bytes at `batch` x `context`, weights, crossover."""
    rows = []
    for name, c in known_configs().items():
        per_tok = c.kv_bytes_per_token(dtype_bytes)
        rows.append({"name": name, "layers": c.num_hidden_layers, "attention_heads": c.num_attention_heads,
                     "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "parameters": c.num_parameters,
                     "bytes_per_token": per_tok, "total_bytes": per_tok * context * batch,
                     "weight_bytes": c.num_parameters * dtype_bytes,
                     "crossover_context": crossover_context(c, batch=batch),
                     "max_position_embeddings": c.max_position_embeddings, "sliding_window": c.sliding_window})
    return rows


def kv_size(c: ModelConfig, dtype: str, context: int, batch: int) -> dict[str, Any]:
    """`kvlm kv-size`'s document: the model's KV bytes in `dtype` at `batch` x `context`, the MHA
    equivalent, and the weights in the same dtype."""
    b = DTYPE_BYTES[dtype]
    per_tok = c.kv_bytes_per_token(b)
    mha = c.kv_bytes_per_token(b, kv_heads=c.num_attention_heads)
    return {"layers": c.num_hidden_layers, "kv_heads": c.num_key_value_heads, "attention_heads": c.num_attention_heads,
            "head_dim": c.head_dim, "dtype": dtype, "engine_default_dtype": engine_kv_dtype(),
            "context": context, "batch": batch,
            "bytes_per_token": per_tok, "total_bytes": per_tok * context * batch, "mha_bytes_per_token": mha,
            "mha_total_bytes": mha * context * batch, "gqa_saving": 1 - per_tok / mha,
            "parameters": c.num_parameters, "weight_bytes": c.num_parameters * b,  # weights in the cache's dtype
            "crossover_context": crossover_context(c, batch=batch),  # same for every dtype: b cancels
            # what each layer's spec holds of the context (a sliding window: at most W tokens); None: all full
            "windowed_total_bytes": None if not c.layer_windows else
            held_tokens(c, context) * per_tok / c.num_hidden_layers * batch}


def held_tokens(c: ModelConfig, context: int) -> int:
    """Tokens of a `context`-token sequence whose K/V the cache holds, summed over the layers (each layer's
    spec, `kv_cache/spec.py`: a full layer all of them, a sliding(W) one at most W)."""
    groups = LayerGroups.of(c.layer_windows, c.num_hidden_layers)
    specs = groups.specs(EngineConfig().block_size)  # (the block size changes no spec's token count)
    return sum(specs[g].tokens_held(context) for g in groups.group_of)
