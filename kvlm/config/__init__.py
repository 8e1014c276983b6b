"""Configuration dataclasses: `ModelConfig` (what the checkpoint is) and `EngineConfig` (how we run it).

`ModelConfig` uses Hugging Face `config.json` field names so that a safetensors folder maps onto it
directly; the GGUF loader translates GGUF metadata into the same fields. Nothing here is inferred from a
file name. Per-request knobs live in `sampling_params.SamplingParams`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Literal

from kvlm.config.families import FULL, SLIDING, gemma3_fields, moe_fields, phi3_fields, smollm3_fields
from kvlm.errors import ParameterError, UnsupportedModelError

# model_type -> architecture class name: the Llama family (one model file, model/llama.py: Phi-3, SmolLM3,
# Granite and the mixture-of-experts models Qwen3-MoE, OLMoE and Mixtral are config differences on it; their
# routed MLP is model/moe.py) and Gemma 3's text model (model/gemma3.py).
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
MOE_MODEL_TYPES = ("qwen3_moe", "olmoe", "mixtral")
ROPE_TYPES = ("default", "llama3", "linear", "longrope")


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only model of the Llama family or Gemma 3 (HF field names)."""

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
    # Gemma 3: per-layer attention ("sliding_attention" layers see the last `sliding_window` tokens,
    # including their own, with RoPE base `rope_local_base_freq`; "full_attention" layers everything, with
    # `rope_theta`), the query scale query_pre_attn_scalar ** -0.5 and the MLP's activation.
    layer_types: tuple[str, ...] | None = None
    rope_local_base_freq: float | None = None
    query_pre_attn_scalar: float | None = None
    hidden_activation: str = "silu"
    final_logit_softcapping: float | None = None
    # Phi-3 / Phi-4-mini: RoPE on the first head_dim * partial_rotary_factor values of each head only.
    partial_rotary_factor: float = 1.0
    # SmolLM3: per layer, 1 where the layer rotates q and k, 0 where it uses no position encoding.
    no_rope_layers: tuple[int, ...] | None = None
    # Granite: embeddings x embedding_multiplier, attention scores x attention_multiplier (instead of
    # head_dim ** -0.5), each block's output x residual_multiplier before its residual add, logits / logits_scaling.
    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Mixture of experts (model/moe.py): the top `num_experts_per_tok` of `num_experts` experts per token,
    # weights renormalised where `norm_topk_prob`; Qwen3-MoE's `mlp_only_layers` and layers off the
    # `decoder_sparse_step` grid keep a dense MLP of `intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # OLMoE: the q / k RMSNorm spans the whole projection (all heads at once), not each head.
    qk_norm_full: bool = False

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.model_type!r}; "
                f"kvlm supports {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(f"unsupported RoPE scaling type {rope_type!r}")
        if rope_type == "longrope" and not (len(self.rope_scaling["short_factor"]) == len(  # type: ignore[index]
                self.rope_scaling["long_factor"]) == self.rotary_dim // 2):  # type: ignore[index]
            raise UnsupportedModelError(f"longrope needs {self.rotary_dim // 2} short and long factors "
                                        f"(rotary dimensions / 2)")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise UnsupportedModelError(f"partial_rotary_factor {self.partial_rotary_factor} gives "
                                        f"{self.rotary_dim} rotary dimensions of head_dim {self.head_dim}")
        if self.no_rope_layers is not None and len(self.no_rope_layers) != self.num_hidden_layers:
            raise UnsupportedModelError(f"no_rope_layers must name {self.num_hidden_layers} layers")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {SLIDING, FULL}:
                raise UnsupportedModelError(f"layer_types must name {self.num_hidden_layers} layers as "
                                            f"{SLIDING!r} or {FULL!r}")
            if SLIDING in self.layer_types and not self.sliding_window:
                raise UnsupportedModelError("sliding_attention layers need a sliding_window")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size > 0 and self.decoder_sparse_step > 0):
            raise UnsupportedModelError(
                f"mixture of experts needs 0 < num_experts_per_tok <= num_experts and a moe_intermediate_size "
                f"(got top {self.num_experts_per_tok} of {self.num_experts}, size {self.moe_intermediate_size})")

    @property
    def layer_windows(self) -> tuple[int | None, ...] | None:
        """Per layer, the tokens a query attends (its own included), None for every earlier token; None
        when the model has no per-layer pattern (then `sliding_window`, if any, caps the context)."""
        if self.layer_types is None:
            return None
        return tuple(self.sliding_window if t == SLIDING else None for t in self.layer_types)

    @property
    def rotary_dim(self) -> int:
        """How many leading values of each q/k head RoPE rotates (HF: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def uses_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates q and k (SmolLM3's NoPE layers do not)."""
        return self.no_rope_layers is None or bool(self.no_rope_layers[layer])

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is routed to experts (Qwen3-MoE's sparse step and dense-only layers)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def architecture(self) -> str:
        return SUPPORTED_MODEL_TYPES[self.model_type]

    @property
    def num_parameters(self) -> int:
        """Parameter count implied by the shapes (embeddings counted once when tied)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        attn += (q + kv if self.qk_norm_full else 2 * self.head_dim) if self.qk_norm else 0
        layer = attn + (4 if self.model_type == "gemma3_text" else 2) * h  # Gemma: sandwich norms
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return sum(layer + self._mlp_parameters(n, self.num_experts) for n in range(self.num_hidden_layers)) + emb + h

    @property
    def num_active_parameters(self) -> int:
        """Parameters one token computes with: the router and its top `num_experts_per_tok` experts in each
        routed layer (`num_parameters` for a dense model)."""
        if not self.num_experts:
            return self.num_parameters
        return self.num_parameters - sum(
            self._mlp_parameters(n, self.num_experts) - self._mlp_parameters(n, self.num_experts_per_tok)
            for n in range(self.num_hidden_layers))

    def _mlp_parameters(self, layer: int, experts: int) -> int:
        """Weights of layer `layer`'s MLP counting `experts` experts (plus the router) where it is routed."""
        h = self.hidden_size
        if self.is_moe_layer(layer):
            return self.num_experts * h + experts * 3 * h * self.moe_intermediate_size
        return 3 * h * self.intermediate_size

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
        gemma = ("layer_types", "rope_local_base_freq", "query_pre_attn_scalar", "hidden_activation",
                 "final_logit_softcapping")
        kw = {k: v for k, v in d.items() if k in known and k not in gemma}  # Gemma's: gemma3_fields
        kw["num_key_value_heads"] = int(d.get("num_key_value_heads") or heads)
        kw["head_dim"] = int(d.get("head_dim") or d["hidden_size"] // heads)
        kw.setdefault("max_position_embeddings", 2048)
        kw["qk_norm"] = d["model_type"] in ("qwen3", "qwen3_moe", "olmoe")
        if d["model_type"] in MOE_MODEL_TYPES:
            kw.update(moe_fields(d))
        if d["model_type"] == "qwen2":
            kw["attention_bias"] = True
        if not d.get("use_sliding_window", True) and d["model_type"].startswith("qwen"):
            kw["sliding_window"] = None
        if d["model_type"] == "gemma3_text":
            kw.update(gemma3_fields(d, int(d["num_hidden_layers"])))
        if d["model_type"] == "phi3":
            kw.update(phi3_fields(d))
        if d["model_type"] == "smollm3":
            kw.update(smollm3_fields(d, int(d["num_hidden_layers"])))
        if d["model_type"] == "granite":  # transformers' default: scores times 1, not head_dim ** -0.5
            kw.setdefault("attention_multiplier", 1.0)
        return cls(**kw)


# The one list of element types, for compute (`EngineConfig.dtype`) and the KV cache (`kv_cache_dtype`):
# "auto" first, then the torch names. Flags, validation and benchmarks all take their choices from here.
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: tuple[Dtype, ...] = ("auto", "float32", "bfloat16", "float16")
# The KV cache also stores quantized codes (kernels/kv_quant.py): int8 (34 bytes per 32 values, q8_0-like)
# and int4 (18 bytes per 32, q4_0-like), a float16 scale per 32 values of a head row.
KVDtype = Literal["auto", "float32", "bfloat16", "float16", "int8", "int4"]
KV_DTYPES: tuple[KVDtype, ...] = (*DTYPES, "int8", "int4")
KV_QUANT_BYTES_PER_VALUE: dict[str, float] = {"int8": 34 / 32, "int4": 18 / 32}


SPEC_METHODS = ("ngram", "suffix", "draft")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` shape): `method` "ngram" (prompt lookup),
    "suffix" (an n-gram index over the request's history and recent requests) or "draft" (greedy guesses
    of a smaller `model`, a path or name, with the same tokenizer: engine/draft_model.py), up to
    `num_speculative_tokens` drafts a step, n-gram lengths `prompt_lookup_min`..`prompt_lookup_max`
    (None: the method's defaults, ngram 2..4, suffix 1..8). `draft_rows`: a step carries at most this many
    rows of decoding requests with their drafts, so each of B decoding requests proposes at most
    (draft_rows - B) // B (engine/speculator.py). `cost_rule`: within that, draft only where a draft's
    expected tokens beat its row's cost (spec_decode/depth.py); False: up to k each (tests use it to force
    drafts in any batch). Output is the same bits with it on or off, whatever these choose."""

    method: str
    num_speculative_tokens: int = 5
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    draft_rows: int = 64
    cost_rule: bool = True
    model: str | None = None  # method "draft": the draft model (a GGUF file, a folder or a known name)

    @classmethod
    def of(cls, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """From a dict (vLLM's keys; unknown ones refused), validated; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ParameterError("speculative_config", "speculative_config must be a dict like "
                                                       '{"method": "ngram", "num_speculative_tokens": 5}')
        unknown = set(value) - {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                                "draft_rows", "cost_rule", "model"}
        if unknown:
            raise ParameterError("speculative_config", f"speculative_config: unknown key(s) {sorted(unknown)}")
        if "method" not in value:
            raise ParameterError("speculative_config", "speculative_config needs a method: ngram, suffix or draft")
        return cls(**value)

    def __post_init__(self) -> None:
        def bad(rule: str) -> ParameterError:
            return ParameterError("speculative_config", f"speculative_config: {rule}")

        if self.method not in SPEC_METHODS:
            raise bad(f"method must be ngram, suffix or draft, got {self.method!r}")
        if (self.method == "draft") != (self.model is not None):
            raise bad("a model is needed with method draft (and only then): "
                      '{"method": "draft", "model": PATH}' if self.method == "draft"
                      else f"model is for method draft only, not {self.method}")
        if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
            raise bad(f"model must be a path or a model name, got {self.model!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 64:
            raise bad(f"num_speculative_tokens must be an integer in [1, 64], got {k!r}")
        r = self.draft_rows
        if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= 1 << 16:
            raise bad(f"draft_rows must be an integer in [1, 65536], got {r!r}")
        if not isinstance(self.cost_rule, bool):
            raise bad(f"cost_rule must be true or false, got {self.cost_rule!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for v in (lo, hi):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 64):
                raise bad(f"prompt_lookup_min / prompt_lookup_max must be integers in [1, 64], got {v!r}")
        if lo is not None and hi is not None and lo > hi:
            raise bad(f"prompt_lookup_min {lo} > prompt_lookup_max {hi}")


@dataclass(slots=True)
class EngineConfig:
    """Runtime knobs of the engine. Defaults suit one CPU user; the CLI exposes each as a flag.

    KV memory: `kv_cache_memory` is bytes (an int), a fraction of the memory available now (a float in
    (0, 1]) or None, which sizes the pool for `max_num_seqs` requests at full context, capped at a
    quarter of available memory and, on CPU, at 1 GiB. A budget above 90% of available memory is refused
    when the pool is made (`kv_cache.sizing.kv_pool_budget`).

    Validated on construction, like `SamplingParams`: a bad value raises `ParameterError` naming the
    field. Checks that need the model (max_model_len above its context) are made by the engine.
    """

    device: str | None = None  # None: "cuda" when available, else "cpu"
    # "auto": on CPU, GGUF weights kept in their stored formats (Q4_0/Q4_1/Q8_0 matmuls quantize activations
    # to int8 on AVX2/AVX-512, the rest compute in float32); float32 etc. (and any GPU): dense weights.
    dtype: Dtype = "auto"
    enable_kv_cache: bool = True
    # "auto": the compute dtype (float32 on CPU). float16 / bfloat16 store K/V in half the bytes (as
    # llama.cpp does by default): half the pool per token and half the bytes each decode step's
    # attention reads. int8 / int4: codes plus a float16 scale per 32 values (3.8x / 7.1x fewer bytes
    # than float32). Every attention path reads K/V back from the cache, so all see the same values.
    kv_cache_dtype: KVDtype = "auto"
    kv_cache_layout: Literal["paged", "contiguous"] = "paged"
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's context length, capped at 4096 to bound memory
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int | float | None = None
    num_threads: int | None = None
    enable_prefix_caching: bool = True  # share cached full blocks across requests (paged layout only)
    # A bounded KV cache for every request (kv_policy.py; None: unbounded, a request ends at the context):
    # keep the first sink_tokens tokens and the most recent ones, at most max_kv_tokens. Per request too.
    max_kv_tokens: int | None = None
    sink_tokens: int = 4
    # CPU: run on the cores other processes leave free, re-checked every half second (engine/threads.py)
    adaptive_threads: bool = True
    # Prompt-only (embedding) requests: "last", "mean" or "cls" for every request that names none (`--pooling`);
    # None: the model's sentence-transformers pooling config where its folder has one, else "last".
    pooling: Literal["last", "mean", "cls"] | None = None
    # Speculative decoding (spec_decode/, engine/speculator.py): a SpeculativeConfig or its dict; None: off.
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None
    # A disk tier under the prefix cache (kv_cache/tier.py; docs/kv_tier.md): blocks evicted from the pool
    # go to files in kv_tier_dir, at most kv_tier_bytes, and come back instead of a prefill. None: off.
    kv_tier_dir: str | None = None
    kv_tier_bytes: int = 20 << 30
    kv_tier_write_through: bool = False  # also store a finished request's prompt blocks at once
    # The tier files' K/V format: None, the pool's own (lossless); "int8", int8 rows of a float pool's K/V
    # (kv_cache/tier_codec.py: 1.9x to 3.8x fewer bytes; a tier hit is then not the bits of a recompute)
    kv_tier_dtype: Literal["int8"] | None = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        def bad(name: str, rule: str) -> ParameterError:
            text = repr(getattr(self, name))
            return ParameterError(name, f"{name} {rule}, got {text if len(text) <= 40 else text[:37] + '...'}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        # Upper bounds keep every size a tensor index can hold; none is near a real setting.
        for name, hi in (("block_size", 1 << 16), ("max_num_seqs", 1 << 20), ("max_num_batched_tokens", 1 << 31),
                         ("max_model_len", 1 << 31), ("num_threads", 1 << 12)):
            v = getattr(self, name)
            if v is None and name in ("max_model_len", "num_threads"):
                continue
            if not is_int(v) or not 1 <= v <= hi:
                raise bad(name, f"must be an integer in [1, {hi}]")
        for name, names in (("dtype", DTYPES), ("kv_cache_dtype", KV_DTYPES)):
            if getattr(self, name) not in names:
                raise bad(name, "must be " + ", ".join(names[:-1]) + " or " + names[-1])
        if self.kv_cache_layout not in ("paged", "contiguous"):
            raise bad("kv_cache_layout", "must be 'paged' or 'contiguous'")
        if self.max_kv_tokens is not None and (not is_int(self.max_kv_tokens) or self.max_kv_tokens < 1):
            raise bad("max_kv_tokens", "must be a positive integer or None")
        if not is_int(self.sink_tokens) or self.sink_tokens < 0:
            raise bad("sink_tokens", "must be an integer >= 0")
        if self.pooling not in (None, "last", "mean", "cls"):
            raise bad("pooling", "must be last, mean or cls")
        if self.kv_tier_dir is not None and (not isinstance(self.kv_tier_dir, str | os.PathLike)
                                             or not str(self.kv_tier_dir)):
            raise bad("kv_tier_dir", "must be a directory path or None")
        if self.kv_tier_dir is not None:
            self.kv_tier_dir = os.fspath(self.kv_tier_dir)
        if not is_int(self.kv_tier_bytes) or self.kv_tier_bytes < 1:
            raise bad("kv_tier_bytes", "must be a positive number of bytes")
        if self.kv_tier_dtype not in (None, "int8"):
            raise bad("kv_tier_dtype", "must be int8 or None (the KV cache's own format)")
        if self.kv_tier_dtype is not None and self.kv_tier_dir is None:
            raise bad("kv_tier_dtype", "needs kv_tier_dir (a KV tier to store)")
        if self.kv_tier_dtype == "int8" and self.kv_cache_dtype_name == "int4":  # (refused before the model loads)
            raise bad("kv_tier_dtype", "is for a float KV cache (an int4 cache's blocks go to the tier as stored)")
        for name in ("enable_kv_cache", "adaptive_threads", "kv_tier_write_through"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        m = self.kv_cache_memory
        if isinstance(m, float) and not (math.isfinite(m) and 0 < m <= 1):
            raise bad("kv_cache_memory", "as a fraction of available memory must be in (0, 1]")
        if (m is not None and not isinstance(m, float)) and (not is_int(m) or m <= 0):
            raise bad("kv_cache_memory", "must be a positive number of bytes (int) or a fraction in (0, 1] (float)")
        if self.device is not None:
            self._check_device()

    @property
    def compute_dtype_name(self) -> str:
        """The activations' element type by name: `dtype`, "auto" being float32 (on every device)."""
        return "float32" if self.dtype == "auto" else self.dtype

    @property
    def kv_cache_dtype_name(self) -> str:
        """The KV cache's element type by name: `kv_cache_dtype`, "auto" being the compute dtype. Torch-free,
        so `kvlm kv-size` sizes the cache the engine would make (`Engine.kv_cache_dtype` is this, as a torch dtype)."""
        return self.compute_dtype_name if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def _check_device(self) -> None:
        """"cpu", "cuda" or "cuda:N", and CUDA must be there when asked for."""
        import torch

        d = self.device
        if not isinstance(d, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", d):
            raise ParameterError("device", f"device must be 'cpu', 'cuda' or 'cuda:N', got {d!r}")
        if d.startswith("cuda"):
            if not torch.cuda.is_available():
                raise ParameterError("device", f"device {d!r} was asked for but CUDA is not available here "
                                               f"(torch {torch.__version__}); use --device cpu")
            if ":" in d and int(d.split(":")[1]) >= torch.cuda.device_count():
                raise ParameterError("device", f"device {d!r} does not exist: {torch.cuda.device_count()} CUDA "
                                               "device(s) visible")


_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str, field: str = "kv_cache_memory", flag: str = "--kv-cache-memory") -> int | float:
    """A KV budget from the command line, with one meaning per spelling:

    '2GiB' -> 2147483648, '512MB' -> 512000000, '1048576' -> 1048576 (a bare number is bytes, so it must
    be whole), '30%' -> 0.3 (a fraction of available memory). Anything else raises `ParameterError`.
    """
    s = text.strip().lower().replace(" ", "")
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)(%|[kmgt]i?b|[kmgtb])?", s)
    if not m:
        raise ParameterError(field, f"{flag}: cannot parse {text!r} "
                                                "(write bytes like 2GiB, 512MB or 1048576, or a share like 30%)")
    num, unit = m.group(1), m.group(2) or ""
    if unit == "%":
        frac = float(num) / 100
        if not 0 < frac <= 1:
            raise ParameterError(field, f"{flag}: {text!r} must be a share in (0%, 100%]")
        return frac
    if unit == "" and "." in num:
        raise ParameterError(field, f"{flag}: a bare number is bytes and must be whole, "
                                                f"got {text!r} (for a share of memory write e.g. 30%)")
    value = int(float(num) * _UNITS[unit]) if "." in num else int(num) * _UNITS[unit]
    if value < 1:
        raise ParameterError(field, f"{flag}: {text!r} is less than one byte")
    return value
