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
Usage:
  PYTHONPATH=. python scripts/real_size_models.py --config llama-3.2-1b --llama-python PATH/TO/llama-venv/bin/python
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
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


CONFIGS = {
    "llama-3.2-1b": Config(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, tied=True),
    "llama-3.2-3b": Config(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, tied=True),
    "llama-3.1-8b": Config(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, tied=False),
}
CONTEXT = 8192  # the files' context length: enough for decode at 2,048 of context and long prompts


def out_dir() -> Path:
    return kvlm_home() / "real-size"


def write_f16(cfg: Config, name: str, vocab_src: Path, dst: Path, seed: int = 0) -> None:
    """The random-weight F16 GGUF of `cfg`, with `vocab_src`'s tokenizer metadata."""
    import gguf

    reader = gguf.GGUFReader(vocab_src)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    writer = gguf.GGUFWriter(dst, "llama")
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    head_dim = cfg.hidden // cfg.heads
    writer.add_name(f"{name} (random weights)")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(cfg.hidden)
    writer.add_block_count(cfg.layers)
    writer.add_feed_forward_length(cfg.ffn)
    writer.add_head_count(cfg.heads)
    writer.add_head_count_kv(cfg.kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    rng = np.random.default_rng(seed)

    def rand(rows: int, cols: int) -> np.ndarray:  # (rows, row length) as GGUF stores (out, in)
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    ones = np.ones(cfg.hidden, dtype=np.float32)
    kv = cfg.kv_heads * head_dim
    writer.add_tensor("token_embd.weight", rand(vocab, cfg.hidden))
    for i in range(cfg.layers):
        for t, arr in (("attn_norm", ones), ("attn_q", rand(cfg.hidden, cfg.hidden)), ("attn_k", rand(kv, cfg.hidden)),
                       ("attn_v", rand(kv, cfg.hidden)), ("attn_output", rand(cfg.hidden, cfg.hidden)),
                       ("ffn_norm", ones), ("ffn_gate", rand(cfg.ffn, cfg.hidden)),
                       ("ffn_up", rand(cfg.ffn, cfg.hidden)), ("ffn_down", rand(cfg.hidden, cfg.ffn))):
            writer.add_tensor(f"blk.{i}.{t}.weight", arr)
    writer.add_tensor("output_norm.weight", ones)
    if not cfg.tied:
        writer.add_tensor("output.weight", rand(vocab, cfg.hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", nargs="+", default=["llama-3.2-1b"], choices=sorted(CONFIGS))
    p.add_argument("--llama-python", required=True, help="an interpreter that can import llama_cpp")
    p.add_argument("--types", nargs="+", default=["Q4_K_M", "Q4_0"], choices=sorted(FTYPES))
    p.add_argument("--force", action="store_true", help="remake files that exist")
    p.add_argument("--keep-f16", action="store_true", help="keep the F16 file after quantizing")
    a = p.parse_args()
    from kvlm.bench.common import DEFAULT_MODEL
    from kvlm.loader import resolve_model

    src = resolve_model(DEFAULT_MODEL, quiet=True)
    out = out_dir()
    out.mkdir(parents=True, exist_ok=True)
    for name in a.config:
        f16 = out / f"{name}.F16.gguf"
        todo = [t for t in a.types if a.force or not (out / f"{name}.{t}.gguf").exists()]
        if todo and (a.force or not f16.exists()):
            write_f16(CONFIGS[name], name, src, f16)
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
