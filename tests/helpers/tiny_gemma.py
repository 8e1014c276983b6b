"""Tiny random Gemma 3 text models: an HF config and weights, written as GGUF (the way llama.cpp's
converter does: `gemma3` names, norms stored as 1 + w, no Q/K permutation) or as a safetensors folder,
and the same weights in Hugging Face transformers' Gemma3ForCausalLM (built from the config)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tiny_models import VOCAB, add_byte_level_vocab, gguf_writer, write_tensors, write_tiny_hf_dir

WINDOW = 8  # small, so that short prompts already reach past the sliding layers' window


def gemma3_config(**kw: Any) -> dict[str, Any]:
    """6 layers (5 sliding, then 1 full: llama.cpp's fixed Gemma 3 pattern), 4 query heads on 1 KV head."""
    cfg = {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "vocab_size": VOCAB,
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "sliding_window": WINDOW, "query_pre_attn_scalar": 32, "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        "tie_word_embeddings": True, "bos_token_id": VOCAB - 3, "eos_token_id": VOCAB - 2, "pad_token_id": 0,
        "attn_logit_softcapping": None, "final_logit_softcapping": None, "torch_dtype": "float32",
    }
    cfg.update(kw)
    return cfg


def gemma3_state(cfg: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named random weights; norms are HF's w (the model multiplies by 1 + w)."""
    g = torch.Generator().manual_seed(seed)
    h, i, D = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def r(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    sd = {"model.embed_tokens.weight": r(cfg["vocab_size"], h, scale=0.05), "model.norm.weight": r(h)}
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            sd[p + norm + ".weight"] = r(h)
        sd[p + "self_attn.q_proj.weight"] = r(nh * D, h)
        sd[p + "self_attn.k_proj.weight"] = r(kvh * D, h)
        sd[p + "self_attn.v_proj.weight"] = r(kvh * D, h)
        sd[p + "self_attn.o_proj.weight"] = r(h, nh * D)
        sd[p + "self_attn.q_norm.weight"] = r(D)
        sd[p + "self_attn.k_norm.weight"] = r(D)
        sd[p + "mlp.gate_proj.weight"] = r(i, h)
        sd[p + "mlp.up_proj.weight"] = r(i, h)
        sd[p + "mlp.down_proj.weight"] = r(h, i)
    return sd


_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
            "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
            "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
            "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_name(hf: str) -> str:
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf in glob:
        return glob[hf]
    parts = hf.split(".")
    return f"blk.{parts[2]}.{_TO_GGUF['.'.join(parts[3:-1])]}.{parts[-1]}"


def write_gemma3_gguf(path: Path, cfg: dict[str, Any], state: dict[str, torch.Tensor],
                      tensor_type: str = "F32") -> Path:
    w = gguf_writer(path, cfg, "gemma3", rope_theta=cfg["rope_parameters"]["full_attention"]["rope_theta"],
                    vocab_size=False)
    w.add_sliding_window(cfg["sliding_window"])
    add_byte_level_vocab(w, chat_template=False)  # like the real file: no template in the GGUF
    # llama.cpp's converter stores Gemma's norm weights as 1 + w
    write_tensors(w, ((_gguf_name(hf), t.float().numpy() + (1.0 if hf.endswith("norm.weight") else 0.0))
                      for hf, t in state.items()), tensor_type)
    return path


def write_gemma3_hf_dir(path: Path, cfg: dict[str, Any], state: dict[str, torch.Tensor]) -> Path:
    write_tiny_hf_dir(path, cfg, state)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def gemma3_hf_model(cfg: dict[str, Any], state: dict[str, torch.Tensor]) -> Any:
    import transformers

    c = transformers.Gemma3TextConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    c._attn_implementation = "eager"
    m = transformers.Gemma3ForCausalLM(c).eval()
    sd = dict(state)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    missing, unexpected = m.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k or "embed_scale" in k for k in missing), (missing, unexpected)
    return m
