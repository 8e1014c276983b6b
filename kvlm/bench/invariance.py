"""`kvlm bench invariance`: why the K/V of past tokens never change, so caching them is exact.

Two experiments on the same random prompt of P tokens and the same prompt extended by E tokens:

1. Causal (the real engine): run the prompt as one request and read its K/V for all P positions from
   the engine's contiguous cache (`engine.kv_cache.k[layer][row, :P]`, row 0 = the only row of a
   one-sequence cache, read right after the request finishes, before anything overwrites it); then run
   prompt + extension as a fresh request and read the same P positions again. Under the causal mask position p sees only
   positions <= p, so appending tokens cannot change anything at p: the max abs difference per layer
   is 0 up to float noise (the longer pass may block its matmuls differently).
2. Non-causal (our own forward pass, not an engine mode): the same model with an `AttentionMetadata`
   whose mask is all True, so every position also attends to later ones, and a `CapturingCache` that
   records each layer's K/V. Layer 0's K/V still match (they are a projection of the token embedding
   at its position, before any attention), but layer 1's input already mixed in the extension's
   tokens, so from layer 1 on the history's K/V differ: a cache would be wrong without causality.
   The same forward with the causal mask is run as a control (it must match like experiment 1).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from kvlm.bench.common import DEFAULT_MODEL, Bench, add_model_args, prompt_ids, run_header, standalone
from kvlm.bench.plotting import new_figure, save_figure


class CapturingCache:
    """A `KVCache` for one sequence computed from position 0 in a single pass: stores nothing between
    calls, records each layer's new K/V (T, kv_heads, D) and returns them as the whole context
    (1, kv_heads, T, D), like `NoKVCache` does for a lone sequence."""

    block_size = 1 << 30
    num_blocks = 1 << 30
    nbytes = 0

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def update_and_fetch(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                         meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        assert meta.num_seqs == 1 and meta.query_lens == meta.seq_lens, "one sequence, whole context at once"
        self.k[layer], self.v[layer] = k.clone(), v.clone()
        return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)


def forward_kv(model: Any, ids: list[int], causal: bool) -> CapturingCache:
    """Run `model` over ids (positions 0..T-1) with the causal mask or with none; return the per-layer
    K/V it computed."""
    from kvlm.attention.metadata import AttentionMetadata, GatheredRows, StepKind

    dev = model.model.norm.weight.device  # (embed_tokens may be a QuantEmbedding, without .weight)
    T = len(ids)
    meta = AttentionMetadata(
        kind=StepKind.PREFILL,
        positions=torch.arange(T, device=dev),
        slots=(torch.arange(T, device=dev),),
        tables=(torch.zeros(1, 1, dtype=torch.long, device=dev),),
        query_lens=(T,), seq_lens=(T,),
        logits_indices=torch.tensor([T - 1], device=dev),
        # prefill attention treats a lone sequence without a mask as causal; an all-True mask lets every
        # query see every key, including later ones.
        attn=GatheredRows(None, None if causal else torch.ones(1, 1, T, T, dtype=torch.bool, device=dev)),
    )
    cache = CapturingCache()
    with torch.inference_mode():
        model(torch.tensor(ids, device=dev), meta.positions, cache, meta)
    return cache


def engine_kv(engine: Any, ids: list[int], n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prefill `ids` as a fresh request through the engine (one output token) and copy the cached K/V
    of positions 0..n-1 for every layer, each (kv_heads, n, D)."""
    from kvlm.sampling_params import SamplingParams

    req = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    assert engine.block_manager.num_blocks == 1, "a one-sequence contiguous cache: its only row holds the request"
    while not req.is_finished:
        engine.step()
    row = 0  # freed when the request finished, but nothing has overwritten it yet
    cache = engine.kv_cache
    # rows are (max_len, kv_heads, D): positions 0..n-1 as (kv_heads, n, D)
    ks = [cache.k[layer][row, :n].transpose(0, 1).clone() for layer in range(len(cache.k))]
    vs = [cache.v[layer][row, :n].transpose(0, 1).clone() for layer in range(len(cache.v))]
    return ks, vs


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def run(model: str = DEFAULT_MODEL, threads: int = 2, prompt_len: int = 32, extra_len: int = 32,
        seed: int = 0) -> dict[str, Any]:
    from kvlm.config import EngineConfig
    from kvlm.engine.engine import Engine

    torch.set_num_threads(threads)
    P, E = prompt_len, extra_len
    engine = Engine(model, EngineConfig(kv_cache_layout="contiguous", max_num_seqs=1, num_threads=threads,
                                        max_model_len=P + E + 1), quiet=True)
    cfg = engine.model_config
    long_ids = prompt_ids(cfg.vocab_size, P + E, seed=seed)
    short_ids = long_ids[:P]

    k1, v1 = engine_kv(engine, short_ids, P)
    k2, v2 = engine_kv(engine, long_ids, P)
    causal_own = (forward_kv(engine.model, short_ids, True), forward_kv(engine.model, long_ids, True))
    noncausal = (forward_kv(engine.model, short_ids, False), forward_kv(engine.model, long_ids, False))

    layers = []
    for L in range(cfg.num_hidden_layers):
        def own(pair: tuple[CapturingCache, CapturingCache], which: str) -> float:
            a, b = getattr(pair[0], which)[L], getattr(pair[1], which)[L][:P]
            return _maxdiff(a, b)

        layers.append({
            "layer": L,
            "cache_k_diff": _maxdiff(k1[L], k2[L]), "cache_v_diff": _maxdiff(v1[L], v2[L]),
            "causal_k_diff": own(causal_own, "k"), "causal_v_diff": own(causal_own, "v"),
            "noncausal_k_diff": own(noncausal, "k"), "noncausal_v_diff": own(noncausal, "v"),
            "k_scale": float(k1[L].abs().max()),  # to read the diffs against
        })
    causal_max = max(max(r["cache_k_diff"], r["cache_v_diff"], r["causal_k_diff"], r["causal_v_diff"]) for r in layers)
    doc = run_header("invariance", model, threads)
    doc.update({
        "prompt_len": P, "extra_len": E, "seed": seed, "num_layers": cfg.num_hidden_layers,
        "causal_max_diff": causal_max,
        "noncausal_layer0_max_diff": max(layers[0]["noncausal_k_diff"], layers[0]["noncausal_v_diff"]),
        "noncausal_min_diff_layers_1plus": min((max(r["noncausal_k_diff"], r["noncausal_v_diff"]) for r in layers[1:]),
                                               default=None),
        "layers": layers,
    })
    return doc


def plot(d: dict[str, Any], path: str) -> str:
    floor = 1e-12  # exact zeros cannot sit on a log axis: draw them at the floor
    fig, ax = new_figure(width=8.0, height=3.2)
    rows = d["layers"]
    x = [r["layer"] for r in rows]
    causal = [max(floor, r["cache_k_diff"], r["cache_v_diff"]) for r in rows]
    nonc = [max(floor, r["noncausal_k_diff"], r["noncausal_v_diff"]) for r in rows]
    w = 0.4
    ax.bar([i - w / 2 for i in x], causal, w, label="causal (engine cache)")
    ax.bar([i + w / 2 for i in x], nonc, w, label="no causal mask")
    ax.axhline(floor, color="k", lw=0.8)
    ax.text(x[-1] + 0.5, floor * 3, "bars at this line: exactly 0", ha="right", va="bottom", fontsize=7,
            bbox={"fc": "white", "ec": "none", "alpha": 0.8})
    ax.set(yscale="log", ylim=(floor / 2, None), xlabel="layer",
           ylabel="max |K/V diff| of shared positions",
           title=f"history K/V: {d['prompt_len']} tokens vs {d['prompt_len']} + {d['extra_len']} tokens")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="center right")
    return save_figure(fig, path)


def print_table(d: dict[str, Any]) -> None:
    P, E = d["prompt_len"], d["extra_len"]
    print(f"{d['model']}: K/V of positions 0..{P - 1} computed from {P} tokens vs from {P} + {E} tokens "
          f"(max |difference| per layer)")
    print(f"{'layer':>5s} {'cache K':>10s} {'cache V':>10s} {'causal K':>10s} {'causal V':>10s} "
          f"{'no mask K':>10s} {'no mask V':>10s} {'max |K|':>8s}")
    for r in d["layers"]:
        print(f"{r['layer']:5d} {r['cache_k_diff']:10.2e} {r['cache_v_diff']:10.2e} {r['causal_k_diff']:10.2e} "
              f"{r['causal_v_diff']:10.2e} {r['noncausal_k_diff']:10.2e} {r['noncausal_v_diff']:10.2e} "
              f"{r['k_scale']:8.2f}")
    print("cache: the engine's cached K/V of two requests; causal / no mask: our own forward pass with the causal "
          "mask / an all-True mask")
    print(f"causal: history K/V unchanged by later tokens (max diff {d['causal_max_diff']:.2e}), "
          "so caching them is exact")
    nm = d["noncausal_min_diff_layers_1plus"]
    print(f"without the mask: layer 0 still matches ({d['noncausal_layer0_max_diff']:.2e}: it sees only the token "
          f"and its position), layers >= 1 change (smallest max diff {'-' if nm is None else format(nm, '.2e')}): "
          f"a cache would go stale")


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--extra-len", type=int, default=32, help="tokens appended for the second run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", metavar="FILE", help="write a PNG: bar chart per layer, log scale")


def run_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(a.model, threads=a.threads, prompt_len=a.prompt_len, extra_len=a.extra_len, seed=a.seed)


BENCH = Bench("invariance", "history K/V never change under the causal mask (and do without it)", add_args,
              run_args, print_table, plot)

if __name__ == "__main__":
    standalone(BENCH)
