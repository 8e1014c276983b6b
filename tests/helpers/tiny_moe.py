"""Tiny random mixture-of-experts models (Qwen3-MoE, OLMoE, Mixtral) that tests write themselves.

`moe_config` is an HF config.json dict; `moe_state_dict` HF-named random weights with one tensor per expert
(`model.layers.L.mlp.experts.E.gate_proj.weight`, as Qwen3-MoE and OLMoE checkpoints store them; Mixtral's
own names are written by `write_moe_hf_dir`). `write_moe_gguf` writes what llama.cpp's converter writes:
the router `ffn_gate_inp` (kept F32, as llama-quantize keeps it), the experts stacked into 3-D
`ffn_{gate,up,down}_exps`, the expert counts, Q/K permuted for Mixtral (arch "llama"). `hf_moe_model` loads
the same weights into transformers (its 3-D `experts.gate_up_proj` / `down_proj`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from tiny_models import (
    VOCAB,
    _permute,
    add_byte_level_vocab,
    gguf_writer,
    random_state_dict,
    tiny_config,
    write_tensors,
)

MOE_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM", "mixtral": "MixtralForCausalLM"}
_HF_CONFIGS = {"qwen3_moe": "Qwen3MoeConfig", "olmoe": "OlmoeConfig", "mixtral": "MixtralConfig"}
_GGUF_ARCH = {"qwen3_moe": "qwen3moe", "olmoe": "olmoe", "mixtral": "llama"}


def moe_config(kind: str, **kw: Any) -> dict[str, Any]:
    """2 layers, hidden 64, GQA 4/2 heads of 16; Qwen3-MoE: top 2 of 8 renormalised (expert size 32);
    OLMoE: top 4 of 8, not renormalised, q/k norms over the whole projection (expert size 32); Mixtral: top 2
    of 4 (expert size 64)."""
    cfg = tiny_config("llama", tie_word_embeddings=False)
    cfg.update(model_type=kind, architectures=[MOE_ARCHITECTURES[kind]])
    if kind == "qwen3_moe":
        cfg.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                   decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False, sliding_window=None)
    elif kind == "olmoe":
        cfg.update(num_experts=8, num_experts_per_tok=4, intermediate_size=32, norm_topk_prob=False, clip_qkv=None)
    else:
        cfg.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=None)
    cfg.update(kw)
    return cfg


def n_experts(cfg: dict[str, Any]) -> int:
    return cfg.get("num_experts") or cfg["num_local_experts"]


def expert_size(cfg: dict[str, Any]) -> int:
    return cfg["moe_intermediate_size"] if cfg["model_type"] == "qwen3_moe" else cfg["intermediate_size"]


def moe_state_dict(cfg: dict[str, Any], seed: int = 0, router_scale: float = 0.5) -> dict[str, torch.Tensor]:
    """Random weights: attention as the dense tiny models', q/k norms per head (Qwen3-MoE) or over the whole
    projection (OLMoE), a router and one gate/up/down per expert in each layer."""
    sd = random_state_dict({**cfg, "model_type": "qwen3" if cfg["model_type"] == "qwen3_moe" else "llama"}, seed)
    g = torch.Generator().manual_seed(seed + 1)
    h, E, inter = cfg["hidden_size"], n_experts(cfg), expert_size(cfg)
    nh, kvh, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        for n in ("gate_proj", "up_proj", "down_proj"):
            sd.pop(p + f"mlp.{n}.weight")
        if cfg["model_type"] == "olmoe":
            sd[p + "self_attn.q_norm.weight"] = 1 + torch.randn(nh * D, generator=g) * 0.1
            sd[p + "self_attn.k_norm.weight"] = 1 + torch.randn(kvh * D, generator=g) * 0.1
        sd[p + "mlp.gate.weight"] = torch.randn(E, h, generator=g) * router_scale
        for e in range(E):
            sd[p + f"mlp.experts.{e}.gate_proj.weight"] = torch.randn(inter, h, generator=g) * 0.1
            sd[p + f"mlp.experts.{e}.up_proj.weight"] = torch.randn(inter, h, generator=g) * 0.1
            sd[p + f"mlp.experts.{e}.down_proj.weight"] = torch.randn(h, inter, generator=g) * 0.1
    return sd


def _stacked(state: dict[str, torch.Tensor], L: int, proj: str, E: int) -> torch.Tensor:
    return torch.stack([state[f"model.layers.{L}.mlp.experts.{e}.{proj}.weight"] for e in range(E)])


_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}


def write_moe_gguf(path: Path, cfg: dict[str, Any], state: dict[str, torch.Tensor], tensor_type: str = "F32") -> Path:
    kind = cfg["model_type"]
    arch = _GGUF_ARCH[kind]
    E, L = n_experts(cfg), cfg["num_hidden_layers"]
    w = gguf_writer(path, cfg, arch)
    w.add_expert_count(E)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if kind == "qwen3_moe":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    add_byte_level_vocab(w)

    def tensors() -> Any:
        glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
        for hf, gname in glob.items():
            if hf in state:
                yield gname, state[hf].float().numpy()
        for n in range(L):
            p = f"model.layers.{n}."
            for hf, gname in _GGUF_NAMES.items():
                if p + hf + ".weight" in state:
                    a = state[p + hf + ".weight"].float().numpy()
                    if arch == "llama" and hf in ("self_attn.q_proj", "self_attn.k_proj"):
                        a = _permute(a, cfg["num_attention_heads"] if "q_" in hf else cfg["num_key_value_heads"])
                    yield f"blk.{n}.{gname}.weight", a
            for proj in ("gate_proj", "up_proj", "down_proj"):
                gname = f"ffn_{proj.split('_')[0]}_exps"
                yield f"blk.{n}.{gname}.weight", np.ascontiguousarray(_stacked(state, n, proj, E).float().numpy())

    write_tensors(w, tensors(), tensor_type)
    return path


def write_moe_hf_dir(path: Path, cfg: dict[str, Any], state: dict[str, torch.Tensor]) -> Path:
    """A safetensors folder with the family's own tensor names (Mixtral: block_sparse_moe, w1/w3/w2)."""
    from tiny_models import write_tiny_hf_dir

    if cfg["model_type"] == "mixtral":
        ren = {".mlp.": ".block_sparse_moe.", ".gate_proj.": ".w1.", ".up_proj.": ".w3.", ".down_proj.": ".w2."}
        out = {}
        for k, v in state.items():
            if ".mlp." in k:
                for a, b in ren.items():
                    k = k.replace(a, b)
            out[k] = v
        state = out
    return write_tiny_hf_dir(path, cfg, state)


def hf_moe_model(cfg: dict[str, Any], state: dict[str, torch.Tensor]) -> Any:
    """The same weights in transformers (float32, eager attention; built from the config, nothing downloaded)."""
    import transformers

    kind = cfg["model_type"]
    c = getattr(transformers, _HF_CONFIGS[kind])(**{k: v for k, v in cfg.items() if k != "model_type"})
    c._attn_implementation = "eager"
    m = getattr(transformers, MOE_ARCHITECTURES[kind])(c).eval()
    E = n_experts(cfg)
    sd = {k: v for k, v in state.items() if ".experts." not in k}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}.mlp.experts."
        gate, up = _stacked(state, n, "gate_proj", E), _stacked(state, n, "up_proj", E)
        sd[p + "gate_up_proj"] = torch.cat([gate, up], dim=1)
        sd[p + "down_proj"] = _stacked(state, n, "down_proj", E)
    missing, unexpected = m.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return m


__all__ = ["VOCAB", "hf_moe_model", "moe_config", "moe_state_dict", "write_moe_gguf", "write_moe_hf_dir"]
