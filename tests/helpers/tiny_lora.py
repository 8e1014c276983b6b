"""LoRA adapters for the tiny test models: made with PEFT itself (random A and B, so they change the logits),
saved as PEFT folders, and rewritten as llama.cpp's convert_lora_to_gguf writes GGUF LoRA files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from tiny_models import PERMUTED_QK, _gguf_name, _permute, hf_reference_model

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model(cfg: dict[str, Any], state: dict[str, torch.Tensor], targets: list[str], r: int = 4,
               alpha: float = 8.0, seed: int = 0, rslora: bool = False, rank_pattern: dict[str, int] | None = None,
               alpha_pattern: dict[str, float] | None = None) -> Any:
    """The HF reference model of cfg/state wrapped by PEFT with one random adapter (float32, eval);
    `rank_pattern` / `alpha_pattern`: PEFT's per-module rank and alpha (a key matches a module path's end)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = hf_reference_model(cfg, state)
    lc = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, lora_dropout=0.0,
                    use_rslora=rslora, rank_pattern=rank_pattern or {}, alpha_pattern=alpha_pattern or {})
    m = get_peft_model(base, lc).eval()
    with torch.no_grad():  # B at PEFT's random init is large next to the tiny base: keep logits O(1)
        for name, p in m.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    return m


def save_peft(model: Any, folder: Path) -> Path:
    model.save_pretrained(str(folder))
    assert (folder / "adapter_model.safetensors").is_file()
    return folder


def write_gguf_lora(path: Path, model: Any, cfg: dict[str, Any], alpha: float) -> Path:
    """The PEFT model's adapter as convert_lora_to_gguf writes it: general.type adapter, adapter.type lora,
    adapter.lora.alpha, `blk.N.attn_q.weight.lora_a` (r x in) / `.lora_b` (out x r), Q/K B rows permuted."""
    import gguf

    arch = cfg["model_type"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    for name, p in model.named_parameters():
        if "lora_" not in name:
            continue
        # base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight
        hf = name.split("base_model.model.", 1)[1].replace(".default", "")
        module, ab = hf.rsplit(".lora_", 1)
        a = p.detach().float().numpy().copy()
        if ab.startswith("B") and arch in PERMUTED_QK and (".q_proj" in module or ".k_proj" in module):
            heads = cfg["num_attention_heads"] if ".q_proj" in module else cfg["num_key_value_heads"]
            a = _permute(a, heads)
        w.add_tensor(f"{_gguf_name(module + '.weight')}.lora_{ab[0].lower()}", np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
