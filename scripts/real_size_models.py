#!/usr/bin/env python3
"""Random-weight models at named real configurations, as GGUF files, for benchmarks at real sizes.

Speed does not depend on what the weights learned: a matmul, attention and the memory they stream cost
the same for random weights of the same shapes and formats. For each `--config`:
1. an F16 GGUF (llama architecture) with random weights (normal, std 0.02; norms 1.0) at that model's
   shapes, the tokenizer and its 49,152-token vocabulary copied from the default model's GGUF
   (SmolLM2), so prompts tokenize and `kvlm` / llama.cpp both load it;
2. that file requantized by llama.cpp's own `llama_model_quantize` (llama-cpp-python, run by
   `--llama-python`) to each `--types` recipe (Q4_K_M and Q4_0 by default).
Files go to $KVLM_HOME/real-size/ (`<config>.<type>.gguf`); files that exist are kept (`--force` remakes
them); the F16 file is deleted after quantizing unless `--keep-f16`. Prints each file's path, size and
tensor types.
Dense configurations: Llama-3.2-1B/3B and Llama-3.1-8B (`llama`), Qwen2.5-1.5B/7B (`qwen2`, q/k/v bias) and
Phi-4-mini (`phi3`: q/k/v and gate/up stored fused, RoPE on 3/4 of each head; without LongRoPE's factor
tensors, which change no shape or cost).
Mixture-of-experts configurations (`olmoe-1b-7b`: OLMoE-1B-7B's shapes, hidden 2048, 16 layers, 64 experts,
top 8, expert ffn 1024) write llama.cpp's `olmoe` architecture: q/k norms over the whole projection, the
router `ffn_gate_inp` (F32, as llama-quantize keeps it) and the experts stacked in 3-D `ffn_*_exps`. Tensors
are written one at a time (the 7B file never sits in memory). Without `--llama-python`, Q8_0 and Q4_0 files
(and BF16, F16) are written directly with gguf's own quantizer (llama.cpp's recipes such as Q4_K_M need llama.cpp);
`--layers N` writes only the first N layers (same shapes: a quick, smaller file for per-layer speed).
`--safetensors` writes instead a Hugging Face folder `<config>.bf16/` (config.json, bf16 model.safetensors,
tokenizer.json and tokenizer_config.json from the default model's GGUF) for dense configurations: what a
user downloads from a hub, for the in-width bf16 path against GGUF files.
Usage:
  PYTHONPATH=. python scripts/real_size_models.py --config llama-3.2-1b --llama-python PATH/TO/llama-venv/bin/python
  PYTHONPATH=. python scripts/real_size_models.py --config olmoe-1b-7b --types Q4_0
  PYTHONPATH=. python scripts/real_size_models.py --config llama-3.2-1b --safetensors
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from make_quant_fixtures import _QUANTIZE, FTYPES, tensor_types  # scripts/ is on sys.path when run as a script

from kvlm.paths import kvlm_home


@dataclass(frozen=True)
class Config:
    """The shapes of a llama-architecture model (the vocabulary is always SmolLM2's 49,152 tokens)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool  # lm_head shares the embedding matrix
    rope_theta: float = 500000.0
    experts: int = 0  # mixture of experts: `experts` of ffn `ffn` each, the top `experts_used` per token
    experts_used: int = 0
    arch: str = "llama"  # GGUF architecture: llama, qwen2 (q/k/v bias), phi3 (fused qkv and gate_up), olmoe
    rotary: float = 1.0  # the fraction of each head RoPE rotates (Phi-4-mini: 3/4)


CONFIGS = {
    "llama-3.2-1b": Config(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, tied=True),
    "llama-3.2-3b": Config(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, tied=True),
    "llama-3.1-8b": Config(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, tied=False),
    "qwen2.5-1.5b": Config(hidden=1536, layers=28, heads=12, kv_heads=2, ffn=8960, tied=True, rope_theta=1e6,
                           arch="qwen2"),
    "qwen2.5-7b": Config(hidden=3584, layers=28, heads=28, kv_heads=4, ffn=18944, tied=False, rope_theta=1e6,
                         arch="qwen2"),
    "phi-4-mini": Config(hidden=3072, layers=32, heads=24, kv_heads=8, ffn=8192, tied=True, rope_theta=10000.0,
                         arch="phi3", rotary=0.75),
    "olmoe-1b-7b": Config(hidden=2048, layers=16, heads=16, kv_heads=16, ffn=1024, tied=False, rope_theta=10000.0,
                          experts=64, experts_used=8, arch="olmoe"),
}
DIRECT = {"Q8_0", "Q4_0", "BF16", "F16"}  # formats written without llama.cpp (BF16, F16: what its converter keeps)
CONTEXT = 8192  # the files' context length: enough for decode at 2,048 of context and long prompts


def out_dir() -> Path:
    return kvlm_home() / "real-size"


def write_f16(cfg: Config, name: str, vocab_src: Path, dst: Path, seed: int = 0, layers: int | None = None,
              qtype: str = "F16") -> None:
    """The random-weight GGUF of `cfg` (F16, or `qtype` blocks from gguf's quantizer), with `vocab_src`'s
    tokenizer metadata; `layers`: only the first that many."""
    import gguf

    reader = gguf.GGUFReader(vocab_src)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    writer = gguf.GGUFWriter(dst, cfg.arch)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    head_dim = cfg.hidden // cfg.heads
    writer.add_name(f"{name} (random weights)")
    n_layers = layers or cfg.layers
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(cfg.hidden)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(cfg.ffn)
    writer.add_head_count(cfg.heads)
    writer.add_head_count_kv(cfg.kv_heads)
    writer.add_rope_dimension_count(int(head_dim * cfg.rotary))
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if qtype == "F16" else gguf.LlamaFileType[f"MOSTLY_{qtype}"])
    if cfg.experts:
        writer.add_expert_count(cfg.experts)
        writer.add_expert_used_count(cfg.experts_used)
    rng = np.random.default_rng(seed)
    qt = gguf.GGMLQuantizationType[qtype]

    def rand(*shape: int) -> np.ndarray:  # (..., rows, row length) as GGUF stores (out, in)
        a = rng.standard_normal(shape, dtype=np.float32) * 0.02
        return a.astype(np.float16) if qtype == "F16" else gguf.quants.quantize(a, qt)

    def ones(n: int) -> Callable[[], np.ndarray]:
        return lambda: np.ones(n, dtype=np.float32)

    kv = cfg.kv_heads * head_dim
    # (name, shape (out first), how to make it): made one at a time as the file is written
    plan: list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]] = [
        ("token_embd.weight", (vocab, cfg.hidden), lambda: rand(vocab, cfg.hidden))]
    for i in range(n_layers):
        if cfg.arch == "phi3":  # q/k/v stacked in one tensor, gate and up in `ffn_up` (llama.cpp's phi3 names)
            mats = [("attn_qkv", (cfg.hidden + 2 * kv, cfg.hidden)), ("attn_output", (cfg.hidden, cfg.hidden))]
        else:
            mats = [("attn_q", (cfg.hidden, cfg.hidden)), ("attn_k", (kv, cfg.hidden)),
                    ("attn_v", (kv, cfg.hidden)), ("attn_output", (cfg.hidden, cfg.hidden))]
        if cfg.arch == "qwen2":
            plan += [(f"blk.{i}.attn_{n}.bias", (rows,), lambda rows=rows: rng.standard_normal(
                rows, dtype=np.float32) * 0.02) for n, rows in (("q", cfg.hidden), ("k", kv), ("v", kv))]
        if cfg.arch == "phi3":
            mats += [("ffn_up", (2 * cfg.ffn, cfg.hidden)), ("ffn_down", (cfg.hidden, cfg.ffn))]
        elif cfg.experts:
            mats += [("ffn_gate_exps", (cfg.experts, cfg.ffn, cfg.hidden)),
                     ("ffn_up_exps", (cfg.experts, cfg.ffn, cfg.hidden)),
                     ("ffn_down_exps", (cfg.experts, cfg.hidden, cfg.ffn))]
            plan += [(f"blk.{i}.attn_q_norm.weight", (cfg.hidden,), ones(cfg.hidden)),
                     (f"blk.{i}.attn_k_norm.weight", (kv,), ones(kv)),
                     (f"blk.{i}.ffn_gate_inp.weight", (cfg.experts, cfg.hidden),
                      lambda: rng.standard_normal((cfg.experts, cfg.hidden), dtype=np.float32))]
        else:
            mats += [("ffn_gate", (cfg.ffn, cfg.hidden)), ("ffn_up", (cfg.ffn, cfg.hidden)),
                     ("ffn_down", (cfg.hidden, cfg.ffn))]
        plan += [(f"blk.{i}.{n}.weight", (cfg.hidden,), ones(cfg.hidden)) for n in ("attn_norm", "ffn_norm")]
        plan += [(f"blk.{i}.{n}.weight", shape, lambda shape=shape: rand(*shape)) for n, shape in mats]
    plan.append(("output_norm.weight", (cfg.hidden,), ones(cfg.hidden)))
    if not cfg.tied:
        plan.append(("output.weight", (vocab, cfg.hidden), lambda: rand(vocab, cfg.hidden)))
    for tname, shape, _ in plan:  # the tensor table first, then each tensor's data as it is made
        dense = len(shape) == 1 or ".ffn_gate_inp." in tname
        t = gguf.GGMLQuantizationType.F32 if dense else gguf.GGMLQuantizationType.F16 if qtype == "F16" else qt
        elems, nbytes = gguf.GGML_QUANT_SIZES[t]
        dtype = np.dtype(np.float32 if dense else np.float16 if qtype == "F16" else np.uint8)
        stored = shape if dtype != np.uint8 else (*shape[:-1], shape[-1] // elems * nbytes)  # blocks: bytes per row
        writer.add_tensor_info(tname, stored, dtype, int(np.prod(shape)) // elems * nbytes, raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, _, make in plan:
        writer.write_tensor_data(make())
    writer.close()


def write_bf16_folder(cfg: Config, name: str, vocab_src: Path, dst: Path, seed: int = 0) -> None:
    """The random-weight model of dense `cfg` as an HF folder in bf16 (LlamaForCausalLM's names), with the
    default model's tokenizer and chat template. Written to a temporary folder, then renamed."""
    import json
    import shutil

    import torch
    from safetensors.torch import save_file

    from kvlm.loader.gguf import read_gguf
    from kvlm.tokenizer.cache import gguf_tokenizer

    if cfg.experts:
        sys.exit(f"{name}: --safetensors writes dense configurations only")
    _, fields = read_gguf(vocab_src)
    tok = gguf_tokenizer(vocab_src, fields)
    vocab, head_dim, kv = tok.vocab_size, cfg.hidden // cfg.heads, cfg.kv_heads * cfg.hidden // cfg.heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * 0.02).bfloat16()

    state = {"model.embed_tokens.weight": rand(vocab, cfg.hidden),
             "model.norm.weight": torch.ones(cfg.hidden, dtype=torch.bfloat16)}
    if cfg.arch == "phi3":  # Phi3ForCausalLM's fused q/k/v and gate/up
        mats = [("self_attn.qkv_proj", (cfg.hidden + 2 * kv, cfg.hidden)),
                ("mlp.gate_up_proj", (2 * cfg.ffn, cfg.hidden))]
    else:
        mats = [("self_attn.q_proj", (cfg.hidden, cfg.hidden)), ("self_attn.k_proj", (kv, cfg.hidden)),
                ("self_attn.v_proj", (kv, cfg.hidden)), ("mlp.gate_proj", (cfg.ffn, cfg.hidden)),
                ("mlp.up_proj", (cfg.ffn, cfg.hidden))]
    mats += [("self_attn.o_proj", (cfg.hidden, cfg.hidden)), ("mlp.down_proj", (cfg.hidden, cfg.ffn))]
    for i in range(cfg.layers):
        pre = f"model.layers.{i}."
        for n, shape in mats:
            state[pre + n + ".weight"] = rand(*shape)
        if cfg.arch == "qwen2":  # Qwen2ForCausalLM: q/k/v with bias
            for n, rows in (("q", cfg.hidden), ("k", kv), ("v", kv)):
                state[pre + f"self_attn.{n}_proj.bias"] = rand(rows)
        for n in ("input_layernorm", "post_attention_layernorm"):
            state[pre + n + ".weight"] = torch.ones(cfg.hidden, dtype=torch.bfloat16)
    if not cfg.tied:
        state["lm_head.weight"] = rand(vocab, cfg.hidden)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    del state
    model_type, arch_name = {"qwen2": ("qwen2", "Qwen2ForCausalLM"), "phi3": ("phi3", "Phi3ForCausalLM")}.get(
        cfg.arch, ("llama", "LlamaForCausalLM"))
    extra = {"partial_rotary_factor": cfg.rotary} if cfg.rotary != 1.0 else {}
    (tmp / "config.json").write_text(json.dumps({
        "model_type": model_type, "architectures": [arch_name], "vocab_size": vocab, **extra,
        "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn, "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": head_dim,
        "max_position_embeddings": CONTEXT, "rms_norm_eps": 1e-5, "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tied, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        "torch_dtype": "bfloat16"}, indent=1))
    tok._backend.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "add_bos_token": tok.add_bos_token,
         "chat_template": tok.chat_template}))
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", nargs="+", default=["llama-3.2-1b"], choices=sorted(CONFIGS))
    p.add_argument("--llama-python", help="an interpreter that can import llama_cpp (without it: Q8_0 / Q4_0 "
                   "written directly by gguf's quantizer)")
    p.add_argument("--types", nargs="+", default=["Q4_K_M", "Q4_0"], choices=sorted([*FTYPES, *DIRECT]))
    p.add_argument("--layers", type=int, help="write only the first N layers (default: all)")
    p.add_argument("--force", action="store_true", help="remake files that exist")
    p.add_argument("--keep-f16", action="store_true", help="keep the F16 file after quantizing")
    p.add_argument("--safetensors", action="store_true", help="write a bf16 Hugging Face folder instead of GGUF")
    a = p.parse_args()
    from kvlm.bench.common import DEFAULT_MODEL
    from kvlm.loader import resolve_model

    src = resolve_model(DEFAULT_MODEL, quiet=True)
    out = out_dir()
    out.mkdir(parents=True, exist_ok=True)
    for cname in a.config:
        name = cname if a.layers is None else f"{cname}-{a.layers}L"
        if a.safetensors:
            cfg = CONFIGS[cname] if a.layers is None else replace(CONFIGS[cname], layers=a.layers)
            dst = out / f"{name}.bf16"
            if a.force or not (dst / "model.safetensors").exists():
                write_bf16_folder(cfg, name, src, dst)
            print(f"{dst}: {(dst / 'model.safetensors').stat().st_size / 2**20:.0f} MiB, bf16 safetensors")
            continue
        f16 = out / f"{name}.F16.gguf"
        todo = [t for t in a.types if a.force or not (out / f"{name}.{t}.gguf").exists()]
        if not a.llama_python or set(a.types) <= DIRECT:
            if set(a.types) - DIRECT:
                sys.exit(f"without --llama-python only {', '.join(sorted(DIRECT))} can be written (gguf's quantizer)")
            for t in todo:
                write_f16(CONFIGS[cname], name, src, out / f"{name}.{t}.gguf", layers=a.layers, qtype=t)
            for t in a.types:
                dst = out / f"{name}.{t}.gguf"
                print(f"{dst}: {dst.stat().st_size / 2**20:.0f} MiB, {tensor_types(dst)}")
            continue
        if todo and (a.force or not f16.exists()):
            write_f16(CONFIGS[cname], name, src, f16, layers=a.layers)
        for t in a.types:
            dst = out / f"{name}.{t}.gguf"
            if t in todo:
                r = subprocess.run([a.llama_python, "-c", _QUANTIZE, str(f16), str(dst), str(FTYPES[t])],
                                   capture_output=True, text=True, check=False)
                if r.returncode != 0:
                    sys.exit(f"llama_model_quantize {t} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
            print(f"{dst}: {dst.stat().st_size / 2**20:.0f} MiB, {tensor_types(dst)}")
        if f16.exists() and not a.keep_f16:
            f16.unlink()


if __name__ == "__main__":
    main()
