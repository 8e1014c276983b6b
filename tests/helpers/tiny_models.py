"""Tiny random models that tests write themselves: GGUF (via gguf.GGUFWriter) and HF safetensors folders.

The GGUF writer does what llama.cpp's converter does (HF -> GGUF names, Q/K RoPE permutation for the
llama architecture, optional quantization), so loading it back exercises kvlm's loader for real.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

# -------------------------------------------------------------------------------- a byte-level vocab


def _bytes_to_unicode() -> dict[int, str]:
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


BYTE = _bytes_to_unicode()
SPELL = lambda text: "".join(BYTE[b] for b in text.encode())  # noqa: E731
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_level_fields(**extra: Any) -> dict[str, Any]:
    """A byte-level BPE vocab: every single byte, a few merges, and ChatML control tokens (GGUF fields)."""
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), (SPELL(" "), "w")]
    tokens = [BYTE[b] for b in range(256)] + [a + b for a, b in merges] + ["<|im_start|>", "<|im_end|>", "<think>"]
    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (len(tokens) - 3) + [3, 3, 4],
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
        "tokenizer.ggml.bos_token_id": len(tokens) - 3,
        "tokenizer.ggml.eos_token_id": len(tokens) - 2,
        "tokenizer.chat_template": CHATML,
    }
    return {**fields, **extra}


VOCAB = len(byte_level_fields()["tokenizer.ggml.tokens"])  # 264

# A Qwen3-like thinking template: the generation prompt opens `<think>` for the model, or, told
# enable_thinking=false, closes an empty one so the model answers at once.
THINKING_TEMPLATE = CHATML.replace(
    "<|im_start|>assistant\n{% endif %}",
    "<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")


def thinking_fields() -> dict[str, Any]:
    """The byte-level vocab plus `</think>` (265 tokens; `<think>` and `</think>` user-defined, as Qwen3's
    added tokens are), with `THINKING_TEMPLATE`."""
    f = byte_level_fields()
    return {**f, "tokenizer.ggml.tokens": f["tokenizer.ggml.tokens"] + ["</think>"],
            "tokenizer.ggml.token_type": f["tokenizer.ggml.token_type"] + [4],
            "tokenizer.chat_template": THINKING_TEMPLATE}


def write_tiny_thinking_gguf(path: Path, **config: Any) -> Path:
    """A tiny random model that thinks in `<think>...</think>` (by its template and vocabulary); `config`
    overrides `tiny_config`'s fields."""
    return write_tiny_gguf(path, tiny_config(vocab_size=VOCAB + 1, **config), fields=thinking_fields())

# ----------------------------------------------------------------------------------- configs, weights


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                 "granite": "GraniteForCausalLM"}


def longrope(rotary_dim: int, original: int) -> dict[str, Any]:
    """Phi-3's `rope_scaling`: LongRoPE with distinct short and long factors per rotary frequency."""
    n = rotary_dim // 2
    return {"type": "longrope", "short_factor": [1.0 + 0.1 * j for j in range(n)],
            "long_factor": [1.5 + 0.5 * j for j in range(n)], "original_max_position_embeddings": original}


def tiny_config(model_type: str = "llama", **kw: Any) -> dict[str, Any]:
    """An HF config.json dict for a 2-layer model with GQA (4 query heads, 2 KV heads)."""
    cfg = {
        "model_type": model_type,
        "architectures": [ARCHITECTURES[model_type]],
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": VOCAB - 3,
        "eos_token_id": VOCAB - 2, "pad_token_id": None, "torch_dtype": "float32",
    }
    if model_type == "qwen2":
        cfg["use_sliding_window"] = False
    if model_type == "phi3":  # LongRoPE, its factor 256 / 64 = 4 (an attention factor of ~1.155)
        cfg.update(original_max_position_embeddings=64, rope_scaling=longrope(16, 64), sliding_window=None)
    if model_type == "smollm3":  # 4 layers: the 4th has no RoPE (transformers' and llama.cpp's default)
        cfg.update(num_hidden_layers=4, use_sliding_window=False, sliding_window=None)
    if model_type == "granite":
        cfg.update(embedding_multiplier=12.0, attention_multiplier=0.2, residual_multiplier=0.22, logits_scaling=3.0)
    cfg.update(kw)
    return cfg


def random_state_dict(cfg: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named random weights for `cfg` (scaled so activations stay O(1))."""
    g = torch.Generator().manual_seed(seed)
    h, i, D = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)

    def r(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    sd = {"model.embed_tokens.weight": r(cfg["vocab_size"], h, scale=0.3), "model.norm.weight": 1 + r(h)}
    if not cfg["tie_word_embeddings"]:
        sd["lm_head.weight"] = r(cfg["vocab_size"], h)
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        sd[p + "input_layernorm.weight"] = 1 + r(h)
        sd[p + "post_attention_layernorm.weight"] = 1 + r(h)
        for name, rows in (("q_proj", nh * D), ("k_proj", kvh * D), ("v_proj", kvh * D)):
            sd[p + f"self_attn.{name}.weight"] = r(rows, h)
            if bias:
                sd[p + f"self_attn.{name}.bias"] = r(rows)
        sd[p + "self_attn.o_proj.weight"] = r(h, nh * D)
        if cfg["model_type"] == "qwen3":
            sd[p + "self_attn.q_norm.weight"] = 1 + r(D)
            sd[p + "self_attn.k_norm.weight"] = 1 + r(D)
        sd[p + "mlp.gate_proj.weight"] = r(i, h)
        sd[p + "mlp.up_proj.weight"] = r(i, h)
        sd[p + "mlp.down_proj.weight"] = r(h, i)
        if cfg["model_type"] == "phi3":  # stored fused, as Phi-3 checkpoints are
            sd[p + "self_attn.qkv_proj.weight"] = torch.cat([sd.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            sd[p + "mlp.gate_up_proj.weight"] = torch.cat([sd.pop(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
    return sd


# --------------------------------------------------------------------------------------------- GGUF
_HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: gate and up fused in one `ffn_up`
}
PERMUTED_QK = ("llama", "smollm3", "granite")  # llama.cpp's LlamaModel converter and its subclasses


def _gguf_name(hf: str) -> str:
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    if hf in glob:
        return glob[hf]
    parts = hf.split(".")  # model.layers.{i}.<module...>.<weight|bias>
    return f"blk.{parts[2]}.{_HF_TO_GGUF['.'.join(parts[3:-1])]}.{parts[-1]}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, cfg: dict[str, Any] | None = None, state: dict[str, torch.Tensor] | None = None,
                    tensor_type: str = "F32", arch: str | None = None, fields: dict[str, Any] | None = None) -> Path:
    """Write cfg/state as a GGUF file the way llama.cpp's converter would. tensor_type: F32, F16, Q8_0, ..."""

    cfg = cfg or tiny_config()
    state = state if state is not None else random_state_dict(cfg)
    arch = arch or {"mistral": "llama"}.get(cfg["model_type"], cfg["model_type"])
    w = gguf_writer(path, cfg, arch)
    extra = _converter_extras(w, cfg, arch)
    add_byte_level_vocab(w, fields)

    def tensors() -> Any:
        yield from extra
        for hf, t in state.items():
            a = t.float().numpy()
            if arch in PERMUTED_QK and (".q_proj." in hf or ".k_proj." in hf):
                heads = cfg["num_attention_heads"] if ".q_proj." in hf else cfg["num_key_value_heads"]
                a = _permute(a, heads)
            yield _gguf_name(hf), a

    write_tensors(w, tensors(), tensor_type)
    return path


def gguf_writer(path: Path, cfg: dict[str, Any], arch: str, rope_theta: float | None = None,
                vocab_size: bool = True) -> Any:
    """A GGUFWriter for `arch` with the hyper-parameters every converter writes (head_dim but for Phi-3 and
    Granite, whose converters write none: hidden / heads; the vocab size unless `vocab_size` is False)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"] if rope_theta is None else rope_theta)
    if arch not in ("phi3", "granite"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if vocab_size:
        w.add_vocab_size(cfg["vocab_size"])
    return w


def _converter_extras(w: Any, cfg: dict[str, Any], arch: str) -> list[tuple[str, np.ndarray]]:
    """What llama.cpp's converter adds for Phi-3 (rotary dimensions, original context, sliding window 0 for
    none, LongRoPE's attention factor and its factor tensors) and Granite (its multipliers, as *_scale);
    returns the extra tensors."""
    import math

    if arch == "granite":
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    if arch != "phi3":
        return []
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    rope = cfg.get("rope_scaling") or {}
    rot = int(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) * h) // nh
    orig = cfg.get("original_max_position_embeddings", cfg["max_position_embeddings"])
    w.add_rope_dimension_count(rot)
    w.add_rope_scaling_orig_ctx_len(orig)
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    if not rope.get("long_factor"):
        return []
    scale = cfg["max_position_embeddings"] / orig
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
    return [("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)),
            ("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))]


def add_byte_level_vocab(w: Any, fields: dict[str, Any] | None = None, chat_template: bool = True) -> None:
    """The byte-level vocab's tokenizer fields into a GGUFWriter (ChatML template unless chat_template=False)."""
    tok = byte_level_fields(**(fields or {}))
    w.add_tokenizer_model(tok["tokenizer.ggml.model"])
    w.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    w.add_token_list(tok["tokenizer.ggml.tokens"])
    w.add_token_types(tok["tokenizer.ggml.token_type"])
    w.add_token_merges(tok["tokenizer.ggml.merges"])
    w.add_bos_token_id(tok["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(tok["tokenizer.ggml.eos_token_id"])
    if chat_template:
        w.add_chat_template(tok["tokenizer.chat_template"])


def write_tensors(w: Any, tensors: Any, tensor_type: str) -> None:
    """(GGUF name, float array) pairs in `tensor_type` (1-D ones F32, as llama.cpp keeps norms and biases),
    then the file."""
    import gguf

    qtype = gguf.GGMLQuantizationType[tensor_type]
    for name, a in tensors:
        if a.ndim == 1 or tensor_type == "F32" or ".ffn_gate_inp." in name:  # llama.cpp keeps routers F32
            w.add_tensor(name, a.astype(np.float32))
        elif tensor_type == "F16":
            w.add_tensor(name, a.astype(np.float16))
        else:
            q = gguf.quants.quantize(a, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# -------------------------------------------------------------------------------------- HF folders


def write_tiny_hf_dir(path: Path, cfg: dict[str, Any] | None = None, state: dict[str, torch.Tensor] | None = None,
                      shards: int = 1) -> Path:
    """config.json, (sharded) safetensors, tokenizer.json and tokenizer_config.json with a ChatML template."""
    from safetensors.torch import save_file
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    cfg = cfg or tiny_config()
    state = state if state is not None else random_state_dict(cfg)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    names = sorted(state)
    if shards == 1:
        save_file({k: state[k].contiguous() for k in names}, str(path / "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = names[s::shards]
            save_file({k: state[k].contiguous() for k in part}, str(path / fname))
            weight_map.update({k: fname for k in part})
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    f = byte_level_fields()
    vocab = {t: i for i, t in enumerate(f["tokenizer.ggml.tokens"])}
    merges = [tuple(m.split(" ")) for m in f["tokenizer.ggml.merges"]]
    backend = Backend(models.BPE(vocab, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")])
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False, "chat_template": CHATML}))
    return path


def hf_reference_model(cfg: dict[str, Any], state: dict[str, torch.Tensor]) -> Any:
    """The same weights in Hugging Face transformers (built from the config: nothing is downloaded)."""
    import transformers

    conf_cls = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
                "phi3": "Phi3Config", "smollm3": "SmolLM3Config", "granite": "GraniteConfig"}
    c = getattr(transformers, conf_cls[cfg["model_type"]])(**{k: v for k, v in cfg.items() if k != "model_type"})
    c._attn_implementation = "eager"
    m = getattr(transformers, ARCHITECTURES[cfg["model_type"]])(c).eval()
    sd = dict(state)
    if cfg["tie_word_embeddings"]:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    m.load_state_dict(sd, strict=False)
    return m
