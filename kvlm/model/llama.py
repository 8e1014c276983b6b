"""The Llama family (Llama 2/3, SmolLM/SmolLM2, Mistral, Qwen2/2.5, Qwen3, Phi-3/Phi-4-mini, SmolLM3,
Granite 3.x, and the mixture-of-experts Qwen3-MoE, OLMoE and Mixtral) as one PyTorch module tree.

The members differ only by `ModelConfig` fields: q/k/v bias (Qwen2), per-head q/k norms (Qwen3), LongRoPE
and RoPE on part of each head (Phi-3, Phi-4-mini; their checkpoints store q/k/v and gate/up fused, which are
this module's own stacked projections, loaded as stored), layers without RoPE (SmolLM3), and scalar
multipliers on the embedding, the attention scores, the residual branches and the logits (Granite), and a
routed MLP of experts in place of the dense one (model/moe.py; OLMoE's q/k norms span the whole projection).

Module names equal Hugging Face checkpoint names (`model.layers.0.self_attn.q_proj`), so loading is a
dictionary copy; format-specific renaming lives in `loader/`. The model works on a flat batch:
`forward(input_ids (T,), positions (T,), kv_cache, meta)` where the T tokens may come from many
sequences (prefill chunks and decodes mixed); `meta` (attention.metadata.AttentionMetadata) says which is which.
The model owns no cache state: each attention layer asks the cache for its context.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import torch
from torch import nn

from kvlm.attention import attention
from kvlm.attention.metadata import AttentionMetadata, GatheredRows
from kvlm.attention.paged import paged_attention
from kvlm.attention.window import windowed_attention
from kvlm.config import ModelConfig
from kvlm.errors import ModelLoadError
from kvlm.kernels import ExpertStack, QuantTensor
from kvlm.kernels.elementwise import apply_rope, rms_norm, silu_mul
from kvlm.kv_cache.storage import KVCache
from kvlm.lora.rows import LoRARows
from kvlm.model.moe import MoEMLP
from kvlm.model.quant_layers import QuantEmbedding, QuantLinear, stack_quant


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return rms_norm(x, self.weight, self.eps)  # one kernel (kernels/elementwise.py)
        # Half precision: normalise in float32 like the reference, cast back before the weight.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(config: ModelConfig, rope_freqs: torch.Tensor | None = None,
                  context: int | None = None) -> torch.Tensor:
    """(rotary_dim/2,) inverse frequencies, with llama3 / linear / longrope scaling or GGUF per-frequency
    factors. LongRoPE takes its long factors where the engine's context (`context`) exceeds the original
    one: decided once per engine, as llama.cpp does (transformers switches per sequence length, which would
    make a token's keys depend on how long its sequence grew; the two agree while context <= original)."""
    D = config.rotary_dim
    # On the CPU even inside the engine's `torch.device("meta")` block: arithmetic on meta tensors runs
    # torch's Python reference ops, whose first use imports torch._dynamo (~1 s, ~45 MB per start).
    shape = torch.arange(0, D, 2, dtype=torch.int64, device="cpu").float() / D
    inv = 1.0 / (config.rope_theta ** shape)
    rs = config.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "longrope":  # HF's _compute_longrope_parameters, factors multiplied before the reciprocal
        long = context is not None and context > int(rs["original_max_position_embeddings"])
        ext = torch.tensor(rs["long_factor" if long else "short_factor"], dtype=torch.float32, device="cpu")
        inv = 1.0 / (ext * config.rope_theta ** shape)
    elif kind == "linear":
        inv = inv / float(rs["factor"])
    elif kind == "llama3":
        factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        inv = torch.where(medium, smoothed, scaled)
    if rope_freqs is not None:
        inv = inv / rope_freqs.float()
    return inv


def rope_attention_factor(config: ModelConfig) -> float:
    """LongRoPE's magnitude correction of cos and sin (HF's `attention_scaling`; 1.0 for other RoPE):
    sqrt(1 + ln(factor) / ln(original context)), factor = context / original context, unless given."""
    rs = config.rope_scaling or {}
    if rs.get("rope_type") != "longrope":
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    original = int(rs["original_max_position_embeddings"])
    factor = rs.get("factor") or config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rotate(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] values of each head of qk (T, heads, D) (all of them but for a
    partial rotary factor, where the rest pass through unrotated)."""
    rd = cos.shape[-1]
    if rd == qk.shape[-1]:
        return apply_rope(qk, cos, sin)
    return torch.cat((apply_rope(qk[..., :rd].contiguous(), cos, sin), qk[..., rd:]), dim=-1)


_STACKS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def stack_experts(state: dict[str, Any]) -> dict[str, Any]:
    """Per-expert checkpoint tensors (`...mlp.experts.{e}.gate_proj.weight`, safetensors' layout) become one
    stacked (E, out, in) tensor `...mlp.experts.gate_proj` as GGUF stores them; transformers 5's fused
    `...mlp.experts.gate_up_proj` (E, 2I, hidden) splits into gate and up."""
    groups: dict[tuple[str, str], dict[int, Any]] = {}
    for key in [k for k in state if ".experts." in k]:
        m = _EXPERT_RE.match(key)
        if m:
            groups.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = state.pop(key)
        elif key.endswith(".experts.gate_up_proj") and isinstance(state[key], torch.Tensor):
            gate, up = state.pop(key).chunk(2, dim=1)
            state[key.replace("gate_up_proj", "gate_proj")] = gate
            state[key.replace("gate_up_proj", "up_proj")] = up
    for (prefix, proj), parts in groups.items():
        if sorted(parts) != list(range(len(parts))):
            raise ModelLoadError(f"{prefix}: experts {sorted(parts)} are not numbered 0..{len(parts) - 1}")
        ts = [parts[e] for e in range(len(parts))]
        if all(isinstance(t, QuantTensor) and t.qtype == ts[0].qtype for t in ts):  # blocks: one stacked copy
            data = torch.from_numpy(np.stack([t.data.numpy() for t in ts]))
            state[f"{prefix}.{proj}"] = ExpertStack(data, ts[0].qtype, (len(ts), *ts[0].shape))
        else:
            state[f"{prefix}.{proj}"] = torch.stack([_dense(t) for t in ts])
    return state


def stack_weights(state: dict[str, Any]) -> dict[str, Any]:
    """Replace `...q_proj.weight`, `...k_proj.weight`, `...v_proj.weight` by `...qkv_proj.weight`
    (rows concatenated in that order), likewise biases and gate/up -> gate_up_proj. Quantized parts
    become a list of QuantTensors (`stack_quant`: parts back to back in the file merge as one view, the
    others stay apart, never copied). Experts: `stack_experts`."""
    state = stack_experts(state)
    for key in [k for k in state if ".q_proj." in k or ".gate_proj." in k]:
        for stacked, parts in _STACKS.items():
            if f".{parts[0]}." in key:
                names = [key.replace(f".{parts[0]}.", f".{p}.") for p in parts]
                if all(n in state for n in names):
                    ts = [state.pop(n) for n in names]
                    if all(isinstance(t, QuantTensor) for t in ts):
                        state[key.replace(f".{parts[0]}.", f".{stacked}.")] = stack_quant(ts)
                    else:
                        state[key.replace(f".{parts[0]}.", f".{stacked}.")] = torch.cat(
                            [_dense(t) for t in ts])
    return state


def _dense(t: Any) -> torch.Tensor:
    """Float32 values of a dense tensor or a QuantTensor (mixed dense/quantized stacks are rare)."""
    if isinstance(t, QuantTensor):
        from kvlm.kernels import dequantize

        return dequantize(t)
    return t.float()


def _shape(t: Any) -> tuple[int, ...]:
    if isinstance(t, list):  # stacked QuantTensor parts
        return (sum(p.shape[0] for p in t), t[0].shape[1])
    return tuple(t.shape)


class Linear(nn.Linear):
    """nn.Linear without its random init: the engine builds the model on the meta device and
    `load_weights` replaces every weight, while kaiming_uniform_ on meta still runs through torch's
    decompositions at every start (docs/startup.md)."""

    def reset_parameters(self) -> None:
        pass


class Attention(nn.Module):
    """One layer's attention over the cache: store the step's K/V first, then attend. With the native
    kernels every row attends over the cache's blocks in place (`meta.in_place`); the reference attends
    over each sequence's context fetched from the cache, by plan (prefill, decode, length groups).
    No parameters."""

    def __init__(self, layer_idx: int, scale: float, window: int | None = None) -> None:
        super().__init__()
        self.layer_idx, self.scale = layer_idx, scale
        self.window = window  # a sliding-window layer: each query sees its last `window` tokens

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: (T, n_heads, D); k, v: (T, kv_heads, D) the step's new rows. Returns (T, n_heads * D)."""
        layer = self.layer_idx
        if meta.in_place:  # every row over the cache's blocks: one computation for every step's rows
            kv_cache.write(layer, k, v, meta)
            return paged_attention(q, kv_cache.blocks(layer, meta), meta, self.scale, window=self.window or 0)
        groups = meta.attn.groups if isinstance(meta.attn, GatheredRows) else ()
        if not groups or self.window:
            kk, vv = kv_cache.update_and_fetch(layer, k, v, meta)  # (B, kvh, L, D)
            if self.window:
                return windowed_attention(q, kk, vv, meta, self.scale, self.window)
            return attention(q, kk, vv, meta, self.scale)
        # Decode batch split by context length: write once, then attend group by group.
        kv_cache.write(layer, k, v, meta)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        for g in groups:
            rows = g.attn.rows  # type: ignore[union-attr]  (a group's metadata is GatheredRows)
            kk, vv = kv_cache.fetch(layer, g)
            out[rows] = attention(q[rows], kk, vv, g, self.scale)
        return out


class LlamaAttention(nn.Module):
    """q/k/v projections are stacked into one `qkv_proj` (and gate/up into `gate_up_proj` in the MLP):
    one matrix product per step instead of three; `load_weights` stacks the checkpoint's tensors."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        h = config.hidden_size
        self.qkv_proj = Linear(h, (self.n_heads + 2 * self.n_kv) * self.head_dim, bias=config.attention_bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, h, bias=False)
        self.qk_norm_full = config.qk_norm and config.qk_norm_full  # OLMoE: over all heads at once
        if config.qk_norm:
            qn, kn = ((self.n_heads * self.head_dim, self.n_kv * self.head_dim) if self.qk_norm_full
                      else (self.head_dim, self.head_dim))
            self.q_norm = RMSNorm(qn, config.rms_norm_eps)
            self.k_norm = RMSNorm(kn, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.use_rope = config.uses_rope(layer_idx)  # SmolLM3's NoPE layers: no position encoding at all
        self.attn = Attention(layer_idx, config.attention_multiplier or self.head_dim**-0.5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        T, nh, kvh = x.shape[0], self.n_heads, self.n_kv
        qkv = self.qkv_proj(x)  # (T, (nh + 2 kvh) D)
        lora = meta.lora  # LoRA adapters: their rows' low-rank update, after the base matmul (kvlm/lora/rows.py)
        if lora is not None:
            lora.apply(qkv, x, self.layer_idx, "qkv_proj")
        qkv = qkv.view(T, nh + 2 * kvh, self.head_dim)  # (T, nh + 2 kvh, D)
        qk, v = qkv[:, : nh + kvh], qkv[:, nh + kvh :]
        if self.qk_norm_full:
            q, k = qk[:, :nh].reshape(T, -1), qk[:, nh:].reshape(T, -1)  # (T, nh * D), (T, kvh * D) copies
            qk = torch.cat((self.q_norm(q).view(T, nh, -1), self.k_norm(k).view(T, kvh, -1)), dim=1)
        elif self.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, :nh]), self.k_norm(qk[:, nh:])), dim=1)
        if self.use_rope:
            qk = rotate(qk, cos, sin)  # queries and keys at once; cos, sin: (T, 1, rotary_dim)
        q, k = qk[:, :nh], qk[:, nh:]
        a = self.attn(q, k, v, kv_cache, meta)
        out = self.o_proj(a)
        return out if lora is None else lora.apply(out, a, self.layer_idx, "o_proj")


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        h, i = config.hidden_size, config.intermediate_size
        self.gate_up_proj = Linear(h, 2 * i, bias=False)
        self.down_proj = Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor, lora: LoRARows | None = None) -> torch.Tensor:
        if lora is None:
            return self.down_proj(silu_mul(self.gate_up_proj(x)))  # silu(gate) * up
        h = silu_mul(lora.apply(self.gate_up_proj(x), x, self.layer_idx, "gate_up_proj"))
        return lora.apply(self.down_proj(h), h, self.layer_idx, "down_proj")


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoEMLP(config) if config.is_moe_layer(layer_idx) else LlamaMLP(config, layer_idx)
        self.residual_multiplier = config.residual_multiplier  # Granite's; 1.0 elsewhere (then no multiply)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        r = self.residual_multiplier
        x = x + (attn if r == 1.0 else attn * r)
        mlp = self.mlp(self.post_attention_layernorm(x), meta.lora)
        return x + (mlp if r == 1.0 else mlp * r)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # An explicit (uninitialized) weight skips nn.Embedding's normal_() init: on the meta device the
        # engine builds on, that init imports torch._dynamo (~1 s and ~45 MB at every start), and
        # load_weights replaces the weight anyway.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """forward() -> final hidden states (T, hidden); compute_logits() -> float32 logits for chosen rows."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.max_positions = max_positions
        # LongRoPE scales cos and sin by this (in forward, on rows of the unscaled tables: shifting a cached
        # key by `shift_keys` must stay a pure rotation)
        self.rope_factor = rope_attention_factor(config)
        self.set_rope(rope_inv_freq(config, context=max_positions))

    def fused_decode_refusal(self) -> str | None:
        """Why the fused native decode step (model/fused_decode.py, csrc/decode.cpp) cannot compute this
        model as its layers do (None: it can). The native step implements the whole Llama layer as this
        module does: q/k/v bias, q/k norms, RoPE on rotary_dim values of each head or on none (NoPE layers),
        any RoPE tables and attention factor, the attention scale, the embedding and residual multipliers,
        q/k norms over the whole projection (OLMoE) and routed experts (csrc/moe.cpp, where their weights are
        on native kernels: `fused_decode._eligible` checks)."""
        return None

    def set_rope(self, inv_freq: torch.Tensor) -> None:
        self.register_rope("", inv_freq)

    def register_rope(self, suffix: str, inv_freq: torch.Tensor) -> None:
        """Buffers `rope_cos{suffix}`, `rope_sin{suffix}`: cos / signed sin tables for every position of the
        context, (max_positions, D), computed in float32 (kept float32 whatever the compute dtype); a row
        past the context (a bounded cache's) is `rope_rows`' to compute."""
        dev = self.model.norm.weight.device
        self.register_buffer("rope_inv" + suffix, inv_freq.to(dev), persistent=False)  # rows past the table
        if dev.type == "meta":  # built on the meta device: load_weights computes the real tables
            shape = (self.max_positions, 2 * inv_freq.shape[0])
            self.register_buffer("rope_cos" + suffix, torch.empty(shape, device=dev), persistent=False)
            self.register_buffer("rope_sin" + suffix, torch.empty(shape, device=dev), persistent=False)
            return
        t = torch.arange(self.max_positions, dtype=torch.float32, device=inv_freq.device)  # CPU
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos" + suffix, emb.cos().to(dev), persistent=False)
        sin = emb.sin()
        half = sin.shape[-1] // 2
        self.register_buffer("rope_sin" + suffix, torch.cat((-sin[:, :half], sin[:, half:]), -1).to(dev),
                             persistent=False)

    def rope_rows(self, positions: torch.Tensor, suffix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin rows (T, D) float32 of `positions` (T,). Positions past the table (a bounded
        cache's generation running past the context, kv_policy.py) get their angles in float64: each row
        is still a function of its position alone."""
        cos_t, sin_t = getattr(self, "rope_cos" + suffix), getattr(self, "rope_sin" + suffix)
        n = self.max_positions
        if positions.numel() == 0 or int(positions.max()) < n:
            return cos_t[positions], sin_t[positions]
        far = positions >= n
        cos, sin = cos_t[positions.clamp(max=n - 1)], sin_t[positions.clamp(max=n - 1)]  # copies
        ang = positions[far].double()[:, None] * getattr(self, "rope_inv" + suffix).double()[None, :]
        emb = torch.cat((ang, ang), dim=-1)
        s, half = emb.sin().float(), ang.shape[1]
        cos[far] = emb.cos().float()
        sin[far] = torch.cat((-s[:, :half], s[:, half:]), -1)
        return cos, sin

    def rope_suffix(self, layer: int) -> str:
        """Which RoPE table layer `layer` rotates with ("": the one table of the Llama family)."""
        return ""

    def shift_keys(self, layer: int, k: torch.Tensor, delta: int) -> torch.Tensor:
        """Keys k (n, kv_heads, D) of layer `layer`, rotated delta positions further (RoPE is a rotation
        per frequency: a key at position i becomes the key at i + delta, to float rounding)."""
        if not self.config.uses_rope(layer):
            return k
        cos, sin = self.rope_rows(torch.tensor([delta], device=k.device), self.rope_suffix(layer))
        n = k.shape[0]
        return rotate(k.float().contiguous(), cos.repeat(n, 1).unsqueeze(1), sin.repeat(n, 1).unsqueeze(1))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        if self.config.embedding_multiplier != 1.0:
            x = x * self.config.embedding_multiplier
        cos, sin = self.scaled_rope_rows(positions)
        cos, sin = cos.to(x.dtype).unsqueeze(1), sin.to(x.dtype).unsqueeze(1)  # (T, 1, rotary_dim)
        for layer in self.model.layers:
            x = layer(x, cos, sin, kv_cache, meta)
        return self.model.norm(x)

    def scaled_rope_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope_rows` times LongRoPE's attention factor (float32, as HF scales its cos and sin)."""
        cos, sin = self.rope_rows(positions)
        f = self.rope_factor
        return (cos, sin) if f == 1.0 else (cos * f, sin * f)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()  # (N, vocab)
        s = self.config.logits_scaling  # Granite divides its logits
        return logits if s == 1.0 else logits / s

    def to_input_major(self) -> None:
        """Store every linear weight (out, in) in input-major memory order (a transposed view of an
        (in, out) contiguous tensor). Same values and shapes; on CPU the matrix-vector product of a
        decode step then runs as x @ W_t, which PyTorch's GEMM streams about twice as fast as its GEMV
        over the (out, in) layout (bench: kvlm bench decode). Tied embeddings are transposed once."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.weight.data = m.weight.data.t().contiguous().t()

    def load_weights(self, state: dict[str, Any]) -> None:
        """Take an HF-named state dict in (the model may be built on the meta device: tensors are
        assigned, not copied); shape and name mismatches become one readable error.

        The checkpoint's separate q/k/v and gate/up tensors are concatenated into the stacked modules.
        A weight given as a QuantTensor (or a list of them) replaces its nn.Linear / nn.Embedding with
        a QuantLinear / QuantEmbedding that computes on the stored blocks. Dense tensors become float32
        parameters (cast to the engine's dtype afterwards with `.to()`).
        """
        state = stack_weights(dict(state))
        rope_freqs = state.pop("rope_freqs", None)
        tied = self.config.tie_word_embeddings
        if tied:
            state.pop("lm_head.weight", None)
        own = {k: tuple(v.shape) for k, v in self.state_dict().items()}
        if tied:
            own.pop("lm_head.weight", None)
        missing = sorted(set(own) - set(state))
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")
        for name, t in state.items():
            if name not in own:
                continue  # e.g. rotary inv_freq buffers in old checkpoints
            if _shape(t) != own[name]:
                raise ModelLoadError(f"tensor {name} has shape {_shape(t)}, config implies {own[name]}")
            self._assign(name, t)
        if tied:
            emb = self.model.embed_tokens
            self.lm_head = QuantLinear(emb.qweight) if isinstance(emb, QuantEmbedding) else self.lm_head
            if isinstance(self.lm_head, nn.Linear):
                self.lm_head.weight = emb.weight
        self.set_rope(rope_inv_freq(self.config, None if rope_freqs is None else _dense(rope_freqs),
                                    context=self.max_positions))

    def _assign(self, name: str, t: Any) -> None:
        path, attr = name.rsplit(".", 1)
        parent_path, _, child = path.rpartition(".")
        mod = self.get_submodule(path)
        if path.endswith(".mlp.experts"):  # stacked (E, out, in): blocks as stored, or a dense tensor
            mod.set(attr, t if isinstance(t, ExpertStack) else _dense(t))
            return
        if isinstance(t, (QuantTensor, list)):
            assert attr == "weight", name
            if isinstance(mod, nn.Embedding):
                new: nn.Module = QuantEmbedding(t if isinstance(t, QuantTensor) else t[0])
            else:
                bias = mod.bias if mod.bias is not None and not mod.bias.is_meta else None
                new = QuantLinear(t, bias)
                if mod.bias is not None and bias is None:
                    new.bias = mod.bias  # still meta: its tensor is assigned when its name comes
            setattr(self.get_submodule(parent_path) if parent_path else self, child, new)
            return
        setattr(mod, attr, nn.Parameter(_dense(t), requires_grad=False))
