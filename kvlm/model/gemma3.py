"""Gemma 3's text model (`gemma3` GGUF, `Gemma3ForCausalLM` / `gemma3_text` in HF) beside the Llama family.

The same flat-batch interface as `model/llama.py` (`forward(input_ids (T,), positions (T,), kv_cache,
meta)`, `compute_logits`, `load_weights`), the same stacked projections, quantized layers, attention
module and element-wise kernels. What differs, layer by layer (HF `modeling_gemma3.py`):
- the embedding is scaled by sqrt(hidden) (in float32, as HF does for float32 weights);
- RMSNorm on each head of q and k before RoPE, and "sandwich" norms: the attention's and the MLP's
  outputs are normed again before their residual add (four norms per layer);
- norms multiply by (1 + w): GGUF files store 1 + w already (llama.cpp's converter adds it); the
  safetensors loader adds it, so the model always multiplies by the stored weight;
- the MLP is GeGLU with the tanh-approximate GELU;
- per-layer attention: "sliding_attention" layers see their last `sliding_window` tokens and rotate with
  RoPE base `rope_local_base_freq` (10,000), "full_attention" layers (every 6th) see everything with
  `rope_theta` (1,000,000); queries are scaled by query_pre_attn_scalar ** -0.5;
- the head is tied to the embedding (computed on the embedding's quantized blocks in place).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn

from kvlm.attention.metadata import AttentionMetadata
from kvlm.config import ModelConfig
from kvlm.kernels.elementwise import apply_rope, gelu_tanh_mul
from kvlm.kv_cache.storage import KVCache
from kvlm.model.llama import Attention, Linear, LlamaForCausalLM, RMSNorm, rope_inv_freq


class Gemma3Attention(nn.Module):
    """Stacked q/k/v, per-head q/k norms, RoPE from this layer's table, attention within its window."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        h = config.hidden_size
        self.qkv_proj = Linear(h, (self.n_heads + 2 * self.n_kv) * self.head_dim, bias=config.attention_bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        windows = config.layer_windows
        self.window = windows[layer_idx] if windows else None  # None: every earlier token
        scalar = config.query_pre_attn_scalar or config.head_dim
        self.attn = Attention(layer_idx, scalar**-0.5, window=self.window)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        T, nh, kvh = x.shape[0], self.n_heads, self.n_kv
        qkv = self.qkv_proj(x).view(T, nh + 2 * kvh, self.head_dim)  # (T, nh + 2 kvh, D)
        q = self.q_norm(qkv[:, :nh])
        k = self.k_norm(qkv[:, nh : nh + kvh])
        qk = apply_rope(torch.cat((q, k), dim=1), cos, sin)  # cos, sin: (T, 1, D) of this layer's base
        return self.o_proj(self.attn(qk[:, :nh], qk[:, nh:], qkv[:, nh + kvh :], kv_cache, meta))


class Gemma3MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_mul(self.gate_up_proj(x)))  # gelu_tanh(gate) * up


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Gemma3Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.mlp = Gemma3MLP(config)
        self.post_feedforward_layernorm = RMSNorm(h, eps)
        self.local = self.self_attn.window is not None  # which RoPE table: the local base or the global one

    def forward(self, x: torch.Tensor, rope: dict[bool, tuple[torch.Tensor, torch.Tensor]],
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        cos, sin = rope[self.local]
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # No random init (see LlamaModel): load_weights replaces the weight.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Loading, stacking, quantized layers and the input-major layout are the Llama module's; the layers,
    the embedding scale, the two RoPE tables and the optional final soft-cap are Gemma's."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = Gemma3Model(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.max_positions = max_positions
        # sqrt(hidden) rounded to float32, as HF multiplies float32 embeddings by it
        self.embed_scale = float(np.float32(config.hidden_size**0.5))
        self.rope_factor = 1.0  # no LongRoPE
        self.set_rope(rope_inv_freq(config))

    def fused_decode_refusal(self) -> str | None:
        return "the fused step implements the Llama layer only (Gemma 3's sandwich norms, GeGLU, sliding layers)"

    def set_rope(self, inv_freq: torch.Tensor) -> None:
        """The full layers' table (`rope_cos`/`rope_sin`, from `inv_freq`) and the sliding layers' one
        (`rope_cos_local`/`rope_sin_local`, base rope_local_base_freq, never scaled)."""
        self.register_rope("", inv_freq)
        base = self.config.rope_local_base_freq or self.config.rope_theta
        local = dataclasses.replace(self.config, rope_theta=base, rope_scaling=None)
        self.register_rope("_local", rope_inv_freq(local))

    def rope_suffix(self, layer: int) -> str:
        return "_local" if self.model.layers[layer].local else ""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids) * self.embed_scale  # (T, hidden)
        rope = {}
        for local in (False, True):
            c, s = self.rope_rows(positions, "_local" if local else "")
            rope[local] = (c.to(x.dtype).unsqueeze(1), s.to(x.dtype).unsqueeze(1))  # (T, 1, D)
        for layer in self.model.layers:
            x = layer(x, rope, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()  # (N, vocab)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
