"""How each family's Hugging Face `config.json` maps onto `ModelConfig`'s fields, where it differs from the
Llama shape: Phi-3's LongRoPE and partial rotary, the mixture-of-experts fields (Qwen3-MoE, OLMoE, Mixtral),
SmolLM3's NoPE layers and Gemma 3's layer types and RoPE bases. `ModelConfig.from_hf_dict` calls these; the
GGUF loader translates GGUF metadata into the same fields itself (loader/gguf.py)."""

from __future__ import annotations

from typing import Any

from kvlm.errors import UnsupportedModelError

SLIDING, FULL = "sliding_attention", "full_attention"  # HF's `layer_types` values


def phi3_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's LongRoPE (`rope_scaling` type "longrope" or the older "su", its factors, and the top-level
    original_max_position_embeddings) and Phi-4-mini's partial_rotary_factor, which newer configs keep in
    `rope_parameters`. A sliding_window of at least the context is no window."""
    rope = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    out: dict[str, Any] = {"partial_rotary_factor": float(rope.get("partial_rotary_factor",
                                                               d.get("partial_rotary_factor", 1.0)))}
    if "rope_theta" in rope:
        out["rope_theta"] = float(rope["rope_theta"])
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("longrope", "su"):
        out["rope_scaling"] = {
            "rope_type": "longrope", "short_factor": [float(f) for f in rope["short_factor"]],
            "long_factor": [float(f) for f in rope["long_factor"]], "factor": rope.get("factor"),
            "attention_factor": rope.get("attention_factor"),
            "original_max_position_embeddings": int(rope.get("original_max_position_embeddings")
                                                    or d.get("original_max_position_embeddings")
                                                    or d.get("max_position_embeddings", 2048))}
    else:
        out["rope_scaling"] = None if kind == "default" else rope
    window = d.get("sliding_window")
    if window and window >= int(d.get("max_position_embeddings", 2048)):
        out["sliding_window"] = None
    return out


def moe_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The expert fields of Qwen3-MoE, OLMoE and Mixtral configs (Mixtral's `num_local_experts`, its expert
    size `intermediate_size`, its routing always renormalised). OLMoE's optional clamp of q/k/v (clip_qkv)
    is not implemented (OLMoE-1B-7B does not set it)."""
    if d.get("clip_qkv") is not None:
        raise UnsupportedModelError("OLMoE with clip_qkv is not supported")
    if d["model_type"] == "mixtral":
        return {"num_experts": int(d.get("num_local_experts", 8)),
                "num_experts_per_tok": int(d.get("num_experts_per_tok", 2)),
                "moe_intermediate_size": int(d["intermediate_size"]), "norm_topk_prob": True}
    out = {"num_experts": int(d["num_experts"]), "num_experts_per_tok": int(d["num_experts_per_tok"]),
           "norm_topk_prob": bool(d.get("norm_topk_prob", False))}
    if d["model_type"] == "olmoe":  # every layer routed; its experts have intermediate_size
        out.update(moe_intermediate_size=int(d["intermediate_size"]), qk_norm_full=True)
    else:
        out.update(moe_intermediate_size=int(d["moe_intermediate_size"]),
                   decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
                   mlp_only_layers=tuple(int(n) for n in d.get("mlp_only_layers") or ()))
    return out


def smollm3_fields(d: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """SmolLM3's NoPE layers (`no_rope_layers`, else every `no_rope_layer_interval`-th layer, 4 by default,
    as transformers' SmolLM3Config derives them). Its optional sliding window on the NoPE layers is not
    implemented (the released models have use_sliding_window false)."""
    if d.get("use_sliding_window") and d.get("sliding_window"):
        raise UnsupportedModelError("SmolLM3 with use_sliding_window is not supported")
    every = int(d.get("no_rope_layer_interval", 4))
    layers = d.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(n_layers)]
    return {"no_rope_layers": tuple(int(x) for x in layers), "sliding_window": None}


def gemma3_fields(d: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """Gemma 3's config.json as ModelConfig fields. Older configs give `sliding_window_pattern` (every
    N-th layer full) and `rope_theta`/`rope_local_base_freq`; newer ones `layer_types` and per-type
    `rope_parameters`. Logit soft-capping inside attention is not implemented (Gemma 3 does not use it)."""
    if d.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError("attention logit soft-capping (attn_logit_softcapping) is not supported")
    types = d.get("layer_types")
    if types is None:
        every = int(d.get("sliding_window_pattern", 6))
        types = [FULL if (i + 1) % every == 0 else SLIDING for i in range(n_layers)]
    rope = d.get("rope_parameters") or {}
    full = rope.get(FULL) or {"rope_theta": d.get("rope_theta", 1_000_000.0)}
    local = rope.get(SLIDING) or {"rope_theta": d.get("rope_local_base_freq", 10_000.0)}
    scaling = d.get("rope_scaling") or (full if full.get("rope_type", "default") != "default" else None)
    return {"layer_types": tuple(types), "rope_theta": float(full["rope_theta"]), "qk_norm": True,
            "rope_local_base_freq": float(local["rope_theta"]), "rope_scaling": scaling,
            "query_pre_attn_scalar": float(d.get("query_pre_attn_scalar", d.get("head_dim", 256))),
            "hidden_activation": d.get("hidden_activation", "gelu_pytorch_tanh"),
            "tie_word_embeddings": bool(d.get("tie_word_embeddings", True)),
            "final_logit_softcapping": d.get("final_logit_softcapping")}
