"""Hugging Face model folders (config.json + *.safetensors) -> (`ModelConfig`, state dict).

Only safetensors are read: there is no pickle / `torch.load` path, by design (a pickle can run code).
Sharded checkpoints are found through `model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from kvlm.config import ModelConfig
from kvlm.errors import ModelLoadError

# Mixtral checkpoints: `block_sparse_moe.{gate,experts.E.w1/w3/w2}` = `mlp.{gate,experts.E.gate/up/down_proj}`
_MIXTRAL_PARTS = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
_MIXTRAL_NAMES = re.compile("|".join(re.escape(k) for k in _MIXTRAL_PARTS))


def load_hf_dir(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load config.json and every safetensors shard of a folder; tensors come back as float32."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

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

    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        if not shard.is_file():
            raise ModelLoadError(f"{shard}: shard listed in the index is missing")
        try:
            tensors = load_file(shard)
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{shard}: corrupt safetensors file ({e})") from None
        state.update({k: v.float() for k, v in tensors.items()})
    if config.model_type == "mixtral":  # its MoE block's names, as the Qwen3-MoE / OLMoE ones the model takes
        state = {_MIXTRAL_NAMES.sub(lambda m: _MIXTRAL_PARTS[m.group(0)], k): v for k, v in state.items()}
    if config.model_type == "gemma3_text":
        # HF's Gemma norms multiply by (1 + w) and store w; the model (like GGUF files) takes 1 + w.
        state = {k: v + 1.0 if k.endswith("norm.weight") else v for k, v in state.items()}
    return config, state
