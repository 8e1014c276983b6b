"""`kvlm kv-size --plot`: KV cache memory against context length, and where the cache outgrows the weights.

The arithmetic (bytes per token, crossover, the shipped reference models) is `kv_cache/sizing.py`;
this module only draws it.
"""

from __future__ import annotations

from typing import Any

from kvlm.config import ModelConfig
from kvlm.kv_cache.sizing import crossover_context, known_configs

# bytes per element; int8 / int4 as the engine stores them (a float16 scale per 32 codes)
PLOTTED_DTYPES: dict[str, float] = {"fp32": 4.0, "fp16": 2.0, "int8": 34 / 32, "int4": 18 / 32}
CONTEXTS: list[int] = [2**i for i in range(9, 18)]  # 512 .. 131072
KNOWN_CONTEXTS: list[int] = [2**i for i in range(9, 20)]  # to 524288: Llama-3-70B crosses over at ~430k


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
    for dn, b in PLOTTED_DTYPES.items():
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
