"""Hugging Face model folders (config.json + *.safetensors) -> (`ModelConfig`, state dict).

Only safetensors are read: there is no pickle / `torch.load` path, by design (a pickle can run code).
Sharded checkpoints are found through `model.safetensors.index.json`.

`in_width=True` (the CPU `--dtype auto` path) keeps each 2-D BF16, F16 or F32 matrix in its stored width, as
a `kernels.QuantTensor` viewing the memory-mapped shard (no float32 copy): the native row kernel widens each
value as it reads it (exact), then sums as it does float32 blocks, so the logits have the bits of the widened
copy while decode reads half the bytes of a bf16 model. Everything else (norms, biases, stacked 3-D experts)
comes back as float32.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from kvlm.config import ModelConfig
from kvlm.errors import ModelLoadError

# Mixtral checkpoints: `block_sparse_moe.{gate,experts.E.w1/w3/w2}` = `mlp.{gate,experts.E.gate/up/down_proj}`
_MIXTRAL_PARTS = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
_MIXTRAL_NAMES = re.compile("|".join(re.escape(k) for k in _MIXTRAL_PARTS))


def load_hf_dir(path: str | os.PathLike, in_width: bool = False) -> tuple[ModelConfig, dict[str, Any]]:
    """Load config.json and every safetensors shard of a folder; tensors come back as float32, or (in_width)
    2-D BF16/F16/F32 matrices as `QuantTensor` views of the mapped shards."""
    from safetensors import SafetensorError, safe_open

    root = Path(path)
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{root}: no config.json (not a Hugging Face model folder)")
    try:
        config = ModelConfig.from_hf_dict(json.loads(cfg_path.read_text()))
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise ModelLoadError(f"{cfg_path}: invalid config ({type(e).__name__}: {e})") from None

    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: invalid index ({e})") from None
        shards = sorted({root / f for f in weight_map.values()})
    else:
        shards = sorted(root.glob("*.safetensors"))
    if not shards:
        if list(root.glob("*.bin")) or list(root.glob("*.pt")):
            raise ModelLoadError(f"{root}: only pickle weights (*.bin/*.pt) found; kvlm reads safetensors only")
        raise ModelLoadError(f"{root}: no *.safetensors files")

    state: dict[str, Any] = {}
    for shard in shards:
        if not shard.is_file():
            raise ModelLoadError(f"{shard}: shard listed in the index is missing")
        try:
            with safe_open(shard, framework="pt") as f:  # checks the header: offsets, sizes, dtypes
                mapped = _mapped_matrices(shard) if in_width else {}
                state.update(mapped)
                state.update({k: f.get_tensor(k).float() for k in f.keys() if k not in mapped})  # noqa: SIM118
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{shard}: corrupt safetensors file ({e})") from None
    if config.model_type == "mixtral":  # its MoE block's names, as the Qwen3-MoE / OLMoE ones the model takes
        state = {_MIXTRAL_NAMES.sub(lambda m: _MIXTRAL_PARTS[m.group(0)], k): v for k, v in state.items()}
    if config.model_type == "gemma3_text":
        # HF's Gemma norms multiply by (1 + w) and store w; the model (like GGUF files) takes 1 + w.
        state = {k: v + 1.0 if k.endswith("norm.weight") else v for k, v in state.items()}
    return config, state


_IN_WIDTH = {"BF16": "BF16", "F16": "F16", "F32": "F32"}  # safetensors dtype -> the kernels' dense format


def _mapped_matrices(shard: Path) -> dict[str, Any]:
    """Each 2-D BF16/F16/F32 tensor of a shard as a QuantTensor over the read-only mapped file: nothing read
    or converted. Called after `safe_open` accepted the header, whose offsets are re-checked here anyway."""
    import warnings

    import numpy as np

    from kvlm.kernels.ggml_types import GGMLQuantizationType
    from kvlm.kernels.quant_tensor import QuantTensor

    size = shard.stat().st_size
    with open(shard, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if not 0 < n <= size - 8:
            raise ValueError(f"header length {n} does not fit the file's {size} bytes")
        header = json.loads(fh.read(n))
    with warnings.catch_warnings():  # torch warns that the map is read-only; weights are only read
        warnings.simplefilter("ignore", UserWarning)
        mapped = torch.from_numpy(np.memmap(shard, dtype=np.uint8, mode="r"))
    out: dict[str, Any] = {}
    for name, info in header.items():
        if name == "__metadata__" or info.get("dtype") not in _IN_WIDTH or len(info.get("shape", ())) != 2:
            continue
        rows, cols = (int(d) for d in info["shape"])
        start, end = (8 + n + int(o) for o in info["data_offsets"])
        width = 4 if info["dtype"] == "F32" else 2
        if rows * cols == 0 or end - start != rows * cols * width or end > size:
            raise ValueError(f"tensor {name}: offsets do not match its shape {info['shape']}")
        qtype = GGMLQuantizationType[_IN_WIDTH[info["dtype"]]]
        out[name] = QuantTensor(mapped[start:end].view(rows, cols * width), qtype, (rows, cols))
    return out
