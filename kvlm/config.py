"""Configuration dataclasses: `ModelConfig` (what the checkpoint is) and `EngineConfig` (how we run it).

`ModelConfig` uses Hugging Face `config.json` field names so that a safetensors folder maps onto it
directly; the GGUF loader translates GGUF metadata into the same fields. Nothing here is inferred from a
file name. Per-request knobs live in `sampling_params.SamplingParams`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from kvlm.errors import UnsupportedModelError

# model_type -> architecture class name, for the Llama family we implement with one model file.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only Llama-family model (HF field names)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k before RoPE
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.model_type!r}; kvlm supports {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if rope_type not in ("default", "llama3", "linear"):
            raise UnsupportedModelError(f"unsupported RoPE scaling type {rope_type!r}")

    @property
    def architecture(self) -> str:
        return SUPPORTED_MODEL_TYPES[self.model_type]

    @property
    def num_parameters(self) -> int:
        """Parameter count implied by the shapes (embeddings counted once when tied)."""
        h, i, kv = self.hidden_size, self.intermediate_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        attn += 2 * self.head_dim if self.qk_norm else 0
        layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + emb + h

    def kv_bytes_per_token(self, dtype_bytes: float = 4, kv_heads: int | None = None) -> float:
        """2 (K and V) x layers x kv_heads x head_dim x bytes: the cache cost of one token."""
        heads = self.num_key_value_heads if kv_heads is None else kv_heads
        return 2 * self.num_hidden_layers * heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dictionary, ignoring fields we do not use."""
        if "model_type" not in d:
            raise UnsupportedModelError("config.json has no model_type")
        if d["model_type"] not in SUPPORTED_MODEL_TYPES:
            archs = d.get("architectures") or [d["model_type"]]
            raise UnsupportedModelError(f"unsupported architecture {archs[0]!r} (model_type {d['model_type']!r})")
        heads = int(d["num_attention_heads"])
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw["num_key_value_heads"] = int(d.get("num_key_value_heads") or heads)
        kw["head_dim"] = int(d.get("head_dim") or d["hidden_size"] // heads)
        kw.setdefault("max_position_embeddings", 2048)
        kw["qk_norm"] = d["model_type"] == "qwen3"
        if d["model_type"] == "qwen2":
            kw["attention_bias"] = True
        if not d.get("use_sliding_window", True) and d["model_type"].startswith("qwen"):
            kw["sliding_window"] = None
        return cls(**kw)


@dataclass(slots=True)
class EngineConfig:
    """Runtime knobs of the engine. Defaults suit one CPU user; the CLI exposes each as a flag.

    KV memory: `kv_cache_memory` is bytes (int), a fraction of free memory (float in (0, 1]) or None, which
    sizes the pool for `max_num_seqs` requests at full context, capped at a quarter of free memory and,
    on CPU, at 1 GiB.
    """

    device: str | None = None  # None: "cuda" when available, else "cpu"
    # "auto": float32 activations, GGUF weights kept quantized on CPU; float32 etc.: dense weights.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    enable_kv_cache: bool = True
    kv_cache_layout: Literal["paged", "contiguous"] = "paged"
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's context length, capped at 4096 to bound memory
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int | float | None = None
    num_threads: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_cache_layout not in ("paged", "contiguous"):
            raise ValueError(f"kv_cache_layout must be 'paged' or 'contiguous', got {self.kv_cache_layout!r}")
        m = self.kv_cache_memory
        if isinstance(m, float) and not 0 < m <= 1:
            raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {m}")
        if isinstance(m, int) and m <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {m}")


def parse_bytes(text: str) -> int | float:
    """'2GiB' -> 2147483648, '512MB' -> 512e6, '0.5' -> 0.5 (a fraction of free memory)."""
    s = text.strip()
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1,
             "k": 2**10, "m": 2**20, "g": 2**30}
    low = s.lower()
    for u in sorted(units, key=len, reverse=True):
        if low.endswith(u):
            num = float(low[: -len(u)])
            return int(num * units[u])
    val = float(s)
    return val if val <= 1 else int(val)
