"""`kvlm bench lora`: what serving a LoRA adapter costs: its load time, and decode at batch 1 with the adapter
against the base, side by side in one run.

The adapter is `--lora NAME=PATH[:SCALE]` (a PEFT folder or a GGUF LoRA file), or, by default, a random one
this command writes as a PEFT folder (rank `--rank` on every projection, seeded): load time depends on its
size, not its values. One engine serves both: greedy requests of `--max-tokens` tokens on the same chat prompt
alternate base, adapter, base, ... (`--repeats` each, median decode tok/s, first token to last), so a shared
machine's changing load hits them alike; the prefix cache is off so each run prefills alike. Decode-only
steps run the fused native step with and without the adapter (docs/lora.md). The last line is the JSON
document.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from kvlm.bench.common import DEFAULT_MODEL, Bench, add_model_args, log, run_header, standalone
from kvlm.lora import parse_lora_spec

PROMPT = "Tell me a short story about a fox who learns to play the violin."


def write_random_adapter(folder: Path, config: Any, rank: int, seed: int = 0, dtype: str = "float32") -> Path:
    """A PEFT folder with a random rank-`rank` adapter on every projection of the base `config`, its tensors
    saved in `dtype` ("float32" or "bfloat16", as adapters trained in bfloat16 are saved)."""
    import json

    import torch
    from safetensors.torch import save_file

    from kvlm.lora.adapter import module_shapes

    g = torch.Generator().manual_seed(seed)
    kind = getattr(torch, dtype)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (out, inp) in module_shapes(config).items():
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            pre = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{pre}.lora_A.weight"] = (torch.randn(rank, inp, generator=g) / inp ** 0.5).to(kind)
            tensors[f"{pre}.lora_B.weight"] = (torch.randn(out, rank, generator=g) * 0.01).to(kind)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}))
    return folder


def run(model: str = DEFAULT_MODEL, threads: int = 2, lora: str | None = None, rank: int = 16,
        max_tokens: int = 128, repeats: int = 5, loads: int = 3, adapter_dtype: str = "float32") -> dict[str, Any]:
    from statistics import median

    from kvlm import LLM, SamplingParams

    doc = run_header("lora", model, threads)
    llm = LLM(model, num_threads=threads, enable_prefix_caching=False, adaptive_threads=False)
    eng = llm.llm_engine
    with tempfile.TemporaryDirectory() as tmp:
        if lora is None:
            name, path, scale = "random", str(write_random_adapter(Path(tmp) / "adapter", eng.model_config, rank,
                                                                dtype=adapter_dtype)), 1.0
        else:
            name, path, scale = parse_lora_spec(lora)
        load_s = []
        for i in range(loads):  # the first load reads the file from disk, later ones from the page cache
            t0 = time.perf_counter()
            eng.load_lora(f"{name}-{i}", path, scale)
            load_s.append(time.perf_counter() - t0)
    adapter = eng.loras.get(f"{name}-0")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = llm.render_chat([{"role": "user", "content": PROMPT}])
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm up
    rates: dict[str, list[float]] = {"base": [], "lora": []}
    for _ in range(repeats):  # base, lora, base, ...
        for which in ("base", "lora"):
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False,
                               lora=None if which == "base" else adapter.name)
            rates[which].append(out[0].metrics.decode_tokens_per_s or 0.0)
            log(f"{which:5s} {rates[which][-1]:.1f} tok/s")
    base, with_lora = median(rates["base"]), median(rates["lora"])
    doc.update(adapter=path if lora else f"random rank {rank}, all projections, {adapter_dtype}", rank=adapter.rank,
               targets=list(adapter.targets), load_s=load_s, batch=1, max_tokens=max_tokens, repeats=repeats,
               base_decode_path=eng.backend.decode, base_tokens_per_s=base, lora_tokens_per_s=with_lora,
               ratio=with_lora / base if base else None, runs=rates)
    return doc


def print_table(d: dict[str, Any]) -> None:
    print(f"adapter: {d['adapter']} (rank {d['rank']}); load {', '.join(f'{s * 1e3:.0f} ms' for s in d['load_s'])}")
    print(f"batch 1, greedy, {d['max_tokens']} tokens, {d['threads']} threads, {d['cpu']}, median of "
          f"{d['repeats']} interleaved runs")
    print(f"base ({d['base_decode_path']} decode) {d['base_tokens_per_s']:.1f} tok/s   with the adapter "
          f"{d['lora_tokens_per_s']:.1f} tok/s   ratio {d['ratio']:.2f}x")


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--lora", metavar="NAME=PATH[:SCALE]", default=None,
                   help="the adapter to measure (default: a random PEFT adapter written to a temporary folder)")
    p.add_argument("--rank", type=int, default=16, help="rank of the random adapter")
    p.add_argument("--adapter-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the random adapter's tensor type (a bfloat16 one is kept in bfloat16: half the bytes a "
                        "decode step reads)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5, help="runs with and without the adapter, interleaved (median)")


def run_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(a.model, threads=a.threads, lora=a.lora, rank=a.rank, max_tokens=a.max_tokens, repeats=a.repeats,
               adapter_dtype=a.adapter_dtype)


BENCH = Bench("lora", "a LoRA adapter's load time, and decode at batch 1 with it vs the base, side by side",
              add_args, run_args, print_table)

if __name__ == "__main__":
    standalone(BENCH)
