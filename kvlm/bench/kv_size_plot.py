"""`kvlm kv-size --plot / --compare-known`: KV cache memory against context length, and where the cache
outgrows the model's weights.

Owns the shipped reference shapes (`kvlm/configs/*.json`: published Hugging Face config.json values of
Llama-3-8B/70B, Qwen2.5-7B, Mistral-7B-v0.1 and SmolLM2-135M), the crossover arithmetic and the plot;
`cli.cmd_kv_size` prints the numbers.

Crossover: a sequence of C tokens holds C x 2 x layers x kv_heads x head_dim x b bytes of K/V, the
weights params x b bytes. With cache and weights in the same dtype b cancels, so the crossover context
params / (2 x layers x kv_heads x head_dim) is the same for fp32, fp16, int8 and int4: quantizing both
moves both curves by the same factor. GQA/MQA move it to the right by heads / kv_heads.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from typing import Any

from kvlm.config import ModelConfig

DTYPES: dict[str, float] = {"fp32": 4.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5}
CONTEXTS: list[int] = [2**i for i in range(9, 18)]  # 512 .. 131072
KNOWN_CONTEXTS: list[int] = [2**i for i in range(9, 20)]  # to 524288: Llama-3-70B crosses over at ~430k


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


def plot(cfg: ModelConfig, name: str, dtype_name: str, dtype_bytes: float, path: str, batch: int = 1,
         compare_known: bool = False) -> str:
    """Two panels (three with compare_known): attention variants at `dtype`, the four dtypes, known models."""
    from kvlm.bench.plotting import new_figure, save_figure

    gib = 2**30
    ncols = 3 if compare_known else 2
    fig, axes = new_figure(ncols=ncols, width=4.2 * ncols, height=3.6)
    xs = CONTEXTS

    def curve(c: ModelConfig, b: float, kv: int | None = None, xs: list[int] = xs) -> list[float]:
        return [c.kv_bytes_per_token(b, kv_heads=kv) * x * batch / gib for x in xs]

    def mark(ax: Any, x: int, color: str) -> None:
        if xs[0] <= x <= xs[-1]:
            ax.axvline(x, color=color, ls=":", lw=1)

    # 1) MHA vs GQA (the model's own kv heads) vs MQA, in the chosen dtype.
    ax = axes[0]
    h, kvh = cfg.num_attention_heads, cfg.num_key_value_heads
    variants = [(f"MHA ({h} kv heads)", h), (f"actual ({kvh} kv heads)", kvh), ("MQA (1 kv head)", 1)]
    for label, kv in variants:
        if kv == kvh and kv in (h, 1) and label.startswith("actual"):
            continue  # the model is MHA or MQA itself: that line is already drawn
        cross = crossover_context(cfg, kv, batch)
        line = ax.plot(xs, curve(cfg, dtype_bytes, kv), label=f"{label}: > weights at {cross:,}")[0]
        mark(ax, cross, line.get_color())
    ax.axhline(cfg.num_parameters * dtype_bytes / gib, color="k", ls="--", lw=1, label=f"weights ({dtype_name})")
    ax.set_title(f"{name}: attention variants, {dtype_name}", fontsize=9)

    # 2) the model's own cache in each dtype, with the weights in the same dtype.
    ax = axes[1]
    cross = crossover_context(cfg, batch=batch)
    for dn, b in DTYPES.items():
        line = ax.plot(xs, curve(cfg, b), label=f"KV {dn}")[0]
        ax.axhline(cfg.num_parameters * b / gib, color=line.get_color(), ls="--", lw=0.8)
    ax.axvline(cross, color="k", ls=":", lw=1, label=f"> weights at {cross:,} (any dtype)")
    ax.set_title(f"{name}: dtypes (dashed: weights)", fontsize=9)

    # 3) the shipped reference models in the chosen dtype, each marked at its own crossover.
    if compare_known:
        ax = axes[2]
        for kn, c in known_configs().items():
            cross = crossover_context(c, batch=batch)
            kx = KNOWN_CONTEXTS
            line = ax.plot(kx, curve(c, dtype_bytes, xs=kx), label=f"{kn}: > weights at {cross:,}")[0]
            if kx[0] <= cross <= kx[-1]:
                ax.plot([cross], [c.kv_bytes_per_token(dtype_bytes) * cross * batch / gib], "o",
                        color=line.get_color())
        ax.set_title(f"known models, {dtype_name} (dot: cache = weights)", fontsize=9)

    for ax in axes:
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)" + (f" x batch {batch}" if batch > 1 else ""),
               ylabel="GiB")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6.5, loc="upper left")
    return save_figure(fig, path)
