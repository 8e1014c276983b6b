"""`kvlm pull`, `kvlm info` and `kvlm kv-size`: fetch a model, describe it, size its KV cache (no torch, but
for `kvlm info`'s backend and default KV pool lines)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from kvlm.errors import KvlmError
from kvlm.kv_cache.sizing import DTYPE_BYTES, describe_dtype, engine_kv_dtype, known_summary, kv_size


def add_pull_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("pull", help="fetch a named model into $KVLM_HOME")
    s.add_argument("model", nargs="?", default="smollm2-135m", help="model alias (default: %(default)s)")
    s.add_argument("--force", action="store_true", help="download again even if present")
    s.set_defaults(func=cmd_pull)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """`info` and `kv-size`."""
    s = sub.add_parser("info", help="architecture, parameters, context length, KV bytes per token")
    s.add_argument("model", nargs="?", default="smollm2-135m",
                   help="model alias, .gguf file or HF folder (default: %(default)s)")
    s.add_argument("--json", action="store_true", help="print one JSON document")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("kv-size", help="KV cache memory for a model, context and batch")
    s.add_argument("model", nargs="?", help="model alias, .gguf file or HF folder (default: none; give it or --config)")
    s.add_argument("--config", help="a Hugging Face config.json instead of a model (default: none)")
    s.add_argument("--context", type=int, default=4096, help="tokens per sequence")
    s.add_argument("--batch", type=int, default=1, help="sequences")
    s.add_argument("--dtype", default=engine_kv_dtype(), choices=sorted(DTYPE_BYTES),
                   help="K/V element type to size (default %(default)s: what the engine stores by default, "
                        "--kv-cache-dtype auto; float16 is llama.cpp's default)")
    s.add_argument("--json", action="store_true", help="print one JSON document")
    s.add_argument("--plot", metavar="FILE", help="write a PNG: KV memory vs context (MHA/GQA/MQA, dtypes, crossover "
                   "with the weights); the text output then ends with the JSON line (default: none)")
    s.add_argument("--compare-known", action="store_true",
                   help="also show the shipped reference models (Llama-3-8B/70B, Qwen2.5-7B, Mistral-7B, SmolLM2-135M)")
    s.set_defaults(func=cmd_kv_size)


def cmd_pull(a: argparse.Namespace) -> int:
    from kvlm.loader.registry import pull

    print(pull(a.model, force=a.force))
    return 0


def cmd_info(a: argparse.Namespace) -> int:
    from kvlm.loader import load_config, resolve_model

    path = resolve_model(a.model)
    c = load_config(path)
    info = {"model": str(path), "architecture": c.architecture, "parameters": c.num_parameters,
            "layers": c.num_hidden_layers, "hidden_size": c.hidden_size, "attention_heads": c.num_attention_heads,
            "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "vocab_size": c.vocab_size,
            "context_length": c.max_position_embeddings, "kv_bytes_per_token_fp32": int(c.kv_bytes_per_token(4)),
            "kv_bytes_per_token_fp16": int(c.kv_bytes_per_token(2)),
            "cpu_cores": os.cpu_count() or 1,
            "threading": "torch's thread count (--threads), adaptive: fewer while other processes keep cores "
                         "busy, re-checked every 0.5 s (--no-adaptive-threads to fix it)"}
    info["backend"] = _backend(c.head_dim)
    info["kv_pool_bytes"] = _default_pool_bytes(c.max_position_embeddings, info["kv_bytes_per_token_fp32"])
    if c.num_experts:  # mixture of experts: what a token computes with and reads
        info["experts"] = (f"top {c.num_experts_per_tok} of {c.num_experts} per token, expert ffn "
                           f"{c.moe_intermediate_size}, {'renormalised' if c.norm_topk_prob else 'softmax'} weights")
        info["active_parameters"] = c.num_active_parameters
        info["weight_bytes_per_token"] = _bytes_per_token(path, c)
    formats = _weight_formats(path)
    if formats:
        info["weight_formats"] = formats
    if a.json:
        print(json.dumps(info))
    else:
        for k, v in info.items():
            if k == "backend":
                print(f"{'backend':26s} {v['device']}/{v['isa']}: attention {v['attention']}, "
                      f"elementwise {v['elementwise']}, sampler {v['sampler']}")
                for why in v["reasons"]:
                    print(f"{'':26s} - {why}")
            elif k == "kv_pool_bytes":  # the line `-v` shows when an engine starts, for the default flags
                print(f"{'kv_pool':26s} {v / 2**20:.1f} MiB reserved with the default flags, "
                      f"{v // info['kv_bytes_per_token_fp32']:,} tokens of float32 K/V (--max-num-seqs sequences "
                      "at full context, at most a quarter of available memory and 1 GiB on CPU; --kv-cache-memory "
                      "sets it); resident only as tokens are written")
            elif k != "weight_formats":
                print(f"{k:26s} {v:,}" if isinstance(v, int) else f"{k:26s} {v}")
        for name, f in formats.items():  # which kernel computes on each stored format (--dtype auto)
            print(f"{'weights ' + name:26s} {f['tensors']} tensors, {f['bytes'] / 2**20:.1f} MiB -> {f['kernel']}")
    return 0


def _backend(head_dim: int) -> dict[str, Any]:
    """The kernels `kvlm generate` would run this model on here (`--dtype auto`, CPU), and why. (This
    imports torch and loads the native kernels: the one part of `info` that does.)"""
    import torch

    from kvlm.kernels.backend import select_backend

    return select_backend(torch.device("cpu"), torch.float32, head_dim).as_dict()
def _default_pool_bytes(context_length: int, kv_bytes_per_token: int) -> int:
    """The KV pool an engine with the default flags reserves on CPU (`kv_cache.pool.kv_pool_budget`; imports
    torch, which `kvlm info` otherwise never needs)."""
    import torch

    from kvlm.config import EngineConfig
    from kvlm.kv_cache.pool import kv_pool_budget

    cfg = EngineConfig()
    max_model_len = min(context_length, 4096)  # EngineConfig.max_model_len None: the model's, at most 4096
    return kv_pool_budget(cfg, max_model_len, kv_bytes_per_token, torch.device("cpu"))


def _bytes_per_token(path: Path, c: Any) -> int:
    """Weight bytes a decode token reads: from the GGUF file's tensors (loader.gguf.bytes_per_token), or for an
    HF folder its active parameters bar the embedding table as float32 (`--dtype auto` computes in it)."""
    if path.suffix == ".gguf" and path.is_file():
        from kvlm.loader.gguf import bytes_per_token, read_gguf

        return bytes_per_token(read_gguf(path)[0], c)
    emb = c.vocab_size * c.hidden_size if not c.tie_word_embeddings else 0
    return 4 * (c.num_active_parameters - emb + c.hidden_size)


def _weight_formats(path: Path) -> dict[str, Any]:
    """GGUF only: per tensor type, the count, bytes and kernel path (loader.gguf.weight_formats)."""
    if path.suffix != ".gguf" or not path.is_file():
        return {}
    from kvlm.loader.gguf import read_gguf, weight_formats

    return weight_formats(read_gguf(path)[0])


def cmd_kv_size(a: argparse.Namespace) -> int:
    from kvlm.config import ModelConfig
    from kvlm.loader import load_config, resolve_model

    if a.config:
        try:
            c = ModelConfig.from_hf_dict(json.loads(Path(a.config).read_text()))
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise KvlmError(f"{a.config}: cannot read config ({e})") from None
    elif a.model:
        c = load_config(resolve_model(a.model))
    else:
        raise ValueError("give MODEL or --config FILE")
    b = DTYPE_BYTES[a.dtype]
    doc = kv_size(c, a.dtype, a.context, a.batch)
    per_tok, mha, total, total_mha = (doc[k] for k in ("bytes_per_token", "mha_bytes_per_token", "total_bytes",
                                                       "mha_total_bytes"))
    weights, cross = doc["weight_bytes"], doc["crossover_context"]
    if a.compare_known:
        doc["known"] = known_summary(a.context, b, a.batch)
    if a.plot:
        from kvlm.bench import kv_size_plot

        name = a.model or Path(a.config).stem
        doc["plot"] = kv_size_plot.plot(c, name, a.dtype, b, a.plot, a.batch, a.compare_known)
    if a.json:
        print(json.dumps(doc))
        return 0
    print(f"KV cache = 2 x {c.num_hidden_layers} layers x {c.num_key_value_heads} kv heads x {c.head_dim} dims "
          f"x {b:g} B")
    print(f"  dtype:            {describe_dtype(a.dtype)}")
    print(f"  per token:        {per_tok:,.0f} B ({per_tok / 1024:.1f} KiB)")
    print(f"  {a.batch} x {a.context} tokens: {total:,.0f} B ({total / 2**20:.1f} MiB)")
    if doc["windowed_total_bytes"] is not None:
        w = doc["windowed_total_bytes"]
        print(f"  with its sliding layers at their window (what the engine's pools hold): {w:,.0f} B "
              f"({w / 2**20:.1f} MiB)")
    print(f"  MHA equivalent ({c.num_attention_heads} kv heads): {mha:,.0f} B/token, {total_mha / 2**20:.1f} MiB "
          f"-> GQA saves {100 * (1 - per_tok / mha):.0f}%")
    print(f"  outgrows the weights ({c.num_parameters:,} params x {b:g} B = {weights / 2**20:,.1f} MiB) "
          f"at {cross:,} tokens{' per sequence' if a.batch > 1 else ''} (in any dtype shared by both)")
    if a.compare_known:
        print(f"known models ({a.dtype}, {a.batch} x {a.context} tokens):")
        print(f"  {'model':16s} {'layers':>6s} {'heads':>5s} {'kv':>3s} {'dim':>4s} {'params':>8s} {'KV B/token':>11s} "
              f"{'KV total':>10s} {'weights':>10s} {'KV > weights at':>15s}")
        for k in doc["known"]:
            print(f"  {k['name']:16s} {k['layers']:6d} {k['attention_heads']:5d} {k['kv_heads']:3d} {k['head_dim']:4d} "
                  f"{k['parameters'] / 1e9:7.2f}B {k['bytes_per_token']:11,.0f} {k['total_bytes'] / 2**30:6.2f} GiB "
                  f"{k['weight_bytes'] / 2**30:6.2f} GiB {k['crossover_context']:15,d}"
                  + (f"  (sliding window {k['sliding_window']:,})" if k["sliding_window"] else ""))
    if a.plot:
        print(f"plot: {doc['plot']}")
    if a.plot or a.compare_known:  # bench-style use: end with the JSON document, like `kvlm bench ...`
        print(json.dumps(doc))
    return 0
