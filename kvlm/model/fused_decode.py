"""The fused decode step: all layers of a decode-only step in one native call (`csrc/decode.cpp`).

A decode step feeds one token per sequence through 30 layers of small matrix-vector products; run as
PyTorch modules, each layer is ~15 tensor ops whose dispatch and allocation cost more than the
arithmetic on a 2-core CPU. `FusedDecoder` binds a loaded model once (pointers to its norm weights, its
quantized projections and its RoPE tables: a "plan" on the C++ side) and then runs a decode step as
`embedding (Python) -> decode_step (C++: every layer + final norm) -> lm_head (Python)`.

Mixture-of-experts layers (Qwen3-MoE, OLMoE, Mixtral) run here too: their routed MLP is `moe_mlp`
(csrc/moe.cpp), the one native function the module path's `MoEMLP` calls as well, given the router, the
expert stacks and the layer's expert-load counters (`MoEMLP.stats`, added to in place); OLMoE's q/k norms
over the whole projection are one rmsnorm over q and one over k, as the module path's.

It applies where the module path would run the same kernels: CPU, float32 activations, every projection
a `QuantLinear` on a native kernel path (no dense fallback), a paged KV cache (float32, float16 or
bfloat16; the step rounds K/V into it as the module path's index_copy_ does; or int8 / int4, which the
step quantizes with the native quantizer the module path's write also runs, `csrc/kv_quantize.h`, on keys
centered as the module path's write centers them, with what the cache gives, `decode_centers`) and the
native paged attention. Anything else (the float32 reference path, a contiguous cache, CUDA, no extension)
keeps the module path, which stays the reference: tests compare the two token for token.
`KVLM_FUSED_DECODE=0` turns it off.

Rows under a LoRA adapter (`meta.lora`) run here too: each adapter becomes a native plan of its own on first
use (`_lora_plan`: its A and per-part scaled B^T per layer and projection, the kernels `kvlm/lora/rows.py` calls),
and the step takes each row's plan id; the low-rank update follows each base projection as on the module path.

The plan holds raw pointers into the model's tensors; it keeps references to them on both sides, and is
freed with the decoder.
"""

from __future__ import annotations

import os
import weakref

import torch

from kvlm.attention.metadata import AttentionMetadata, PagedRows
from kvlm.kernels import native
from kvlm.kernels.backend import Backend, kernel_path, native_isa, panel_kernel
from kvlm.kernels.ggml_types import GGMLQuantizationType
from kvlm.kernels.kv_quant import KVQuantFormat
from kvlm.kernels.paged_attention import KV_DTYPES
from kvlm.kv_cache.storage import PagedKVCache
from kvlm.lora.adapter import LoRAAdapter
from kvlm.lora.rows import LoRARows
from kvlm.model.moe import MoEMLP
from kvlm.model.quant_layers import QuantLinear

BF16 = GGMLQuantizationType.BF16
# Seconds per part of a profiled step, in decode.cpp's order.
PROFILE_PARTS = ("elementwise", "matmul", "kv_write", "attention", "other")


def _linear_spec(lin: QuantLinear, spec: list[int], tensors: list[torch.Tensor]) -> None:
    spec.append(len(lin.parts))
    for p in lin.parts:
        data = p.data if p.data.stride(1) == 1 else p.data.contiguous()
        spec += [p.type_id, p.shape[0]]
        tensors.append(data)


def _eligible(model: torch.nn.Module, kv_cache: object, backend: Backend) -> str | None:
    """Why the fused step cannot run this model and cache (None: it can)."""
    if os.environ.get("KVLM_FUSED_DECODE", "1").strip() == "0":
        return "disabled by KVLM_FUSED_DECODE=0"
    refusal = model.fused_decode_refusal()  # what the model computes that the native step does not
    if refusal is not None:
        return refusal
    if backend.attention != "paged-native" or backend.elementwise != "native":
        return "attention or element-wise ops are not the native kernels"
    if not isinstance(kv_cache, PagedKVCache) or not all(t.is_contiguous() for t in kv_cache.k + kv_cache.v) \
            or (kv_cache.k[0].dtype not in KV_DTYPES and not isinstance(kv_cache.element, KVQuantFormat)):
        return "the cache is not a paged pool the native step reads"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        moe = isinstance(mlp, MoEMLP)
        if moe and mlp.native_args() is None:
            return "a mixture-of-experts layer's router or experts are not on native kernels"
        for lin in (attn.qkv_proj, attn.o_proj) if moe else (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                            mlp.down_proj):
            if not isinstance(lin, QuantLinear) or any(d is not None for d in lin.dense_t):
                return "a projection is not quantized on a native kernel"
            if any(kernel_path(p.qtype) == "reference" for p in lin.parts):
                return "a projection format has no native kernel"
            if any(p.panels for p in lin.parts) and not panel_kernel(native_isa()):
                return "weights packed in panels for a kernel path no longer taken"
        if attn.o_proj.bias is not None or (not moe and (mlp.gate_up_proj.bias is not None
                                                         or mlp.down_proj.bias is not None)):
            return "bias outside q/k/v"
    return None


def _free_loras(ops: object, plans: dict[int, int], stale: list[int]) -> None:
    for plan in [*plans.values(), *stale]:
        ops.decode_lora_free(plan)  # type: ignore[attr-defined]


ROPE_SCRATCH = 256  # RoPE table rows past the context, for a step's rows beyond it (a bounded cache's)


def _rope_tables(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused step's own copy of the model's cos / signed sin tables, (max_positions + ROPE_SCRATCH, D)
    float32, times LongRoPE's attention factor as the module path scales its rows (`scaled_rope_rows`): where
    a step's rows past the context find the rows that computes for them (`_positions`), so the step never
    writes into the model's buffers."""
    f = model.rope_factor

    def table(t: torch.Tensor) -> torch.Tensor:
        t = t.float() if f == 1.0 else t.float() * f
        return torch.cat((t, t.new_zeros(ROPE_SCRATCH, t.shape[1], dtype=torch.float32))).contiguous()
    return table(model.rope_cos), table(model.rope_sin)


class FusedDecoder:
    """Runs decode-only steps of `model` natively. Build with `FusedDecoder.create(model, kv_cache)`."""

    def __init__(self, model: torch.nn.Module, plan: int, isa: str, rope: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.model, self.plan = model, plan
        self._cos, self._sin = rope  # the plan's RoPE tables (`_rope_tables`), scratch rows included
        self._ops = native.ops()
        self._isa = native.isa_id(isa)
        self._out = torch.empty(0)  # (B, hidden) result, reused while B stays the same
        self._no_profile = torch.empty(0, dtype=torch.float64)  # "not profiling", without an allocation per step
        self._none = torch.empty(0)  # an argument that does not apply (`PagedKVCache.decode_centers`)
        self._finalizer = weakref.finalize(self, self._ops.decode_plan_free, plan)
        self.profile: torch.Tensor | None = None  # set to zeros(5, float64) to accumulate seconds per part
        self._loras: dict[int, int] = {}  # LoRA adapter id -> its native plan (freed with the decoder)
        self._stale_loras: list[int] = []  # plans of unloaded adapters, freed before the next step
        self._lora_finalizer = weakref.finalize(self, _free_loras, self._ops, self._loras, self._stale_loras)

    @classmethod
    def create(cls, model: torch.nn.Module, kv_cache: object, backend: Backend) -> tuple[FusedDecoder | None, str]:
        """(the fused decoder for this model and cache, or None where the module path must run; why)."""
        why_not = _eligible(model, kv_cache, backend)
        if why_not is not None:
            return None, why_not
        assert isinstance(kv_cache, PagedKVCache)
        cfg = model.config
        cos, sin = _rope_tables(model)
        spec = [cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                cfg.head_dim, cfg.intermediate_size, cos.shape[0], int(native.int8_activations()), cfg.rotary_dim]
        tensors: list[torch.Tensor] = []
        for layer in model.model.layers:
            attn = layer.self_attn
            bias = attn.qkv_proj.bias
            moe = isinstance(layer.mlp, MoEMLP)
            spec.append((1 if bias is not None else 0) | (2 if attn.qk_norm else 0) | (0 if attn.use_rope else 4)
                        | (8 if attn.qk_norm_full else 0) | (16 if moe else 0))
            tensors += [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
            if attn.qk_norm:
                tensors += [attn.q_norm.weight.detach(), attn.k_norm.weight.detach()]
            _linear_spec(attn.qkv_proj, spec, tensors)
            if bias is not None:
                tensors.append(bias.detach().float().contiguous())
            _linear_spec(attn.o_proj, spec, tensors)
            if moe:  # spec: router type, E, k, renorm, I, then each stack's type; router, stacks, counters
                mlp = layer.mlp
                router, rtype, gate, up, down, types = mlp.native_args()
                spec += [rtype, mlp.experts.num_experts, mlp.top_k, int(mlp.renormalize), mlp.experts.inter]
                tensors.append(router)
                for qtype, stack in zip(types, (gate, up, down)):
                    spec.append(qtype)
                    tensors.append(stack)
                tensors.append(mlp.stats)
            else:
                _linear_spec(layer.mlp.gate_up_proj, spec, tensors)
                _linear_spec(layer.mlp.down_proj, spec, tensors)
        # the module path's attention scale and residual multiplier, as float32 (what its ops compute with)
        scalars = torch.tensor([model.model.layers[0].self_attn.attn.scale, cfg.residual_multiplier],
                               dtype=torch.float32)
        tensors += [model.model.norm.weight.detach(), cos, sin, scalars]
        eps = model.model.norm.eps
        plan = native.ops().decode_plan_create(tensors, spec, float(eps))
        return cls(model, plan, backend.isa, (cos, sin)), "decode-only steps run every layer in one native call"

    def _lora_plan(self, adapter: LoRAAdapter) -> int:
        """The native plan of `adapter` (created on first use): per layer and projection its A, B^T and spans."""
        plan = self._loras.get(adapter.id)
        if plan is None:
            tensors: list[torch.Tensor] = []
            for layer in range(len(self.model.model.layers)):
                for module in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                    w = adapter.on(layer, module)
                    a = None if w is None else w.a.data.view(torch.bfloat16 if w.a.qtype == BF16 else torch.float32)
                    tensors += ([self._none] * 3 if w is None else [a, w.bt, w.spans])
            plan = self._loras[adapter.id] = self._ops.decode_lora_create(tensors, len(self.model.model.layers))
        return plan

    def forget_lora(self, adapter_id: int) -> None:
        """Free an unloaded adapter's native plan (a request still running under it makes a new one). Any
        thread may call it (the server's unload endpoint): the plan is freed at the start of the next step,
        on the thread that runs steps, never under a step that reads it."""
        plan = self._loras.pop(adapter_id, None)
        if plan is not None:
            self._stale_loras.append(plan)

    def _lora_ids(self, lora: LoRARows | None, n: int) -> list[int]:
        """Each of the step's n rows' LoRA plan id (0: the base); [] when no row has an adapter."""
        if lora is None:
            return []
        ids = [0] * n
        for adapter, rows in lora.groups:
            plan = self._lora_plan(adapter)
            for r in (range(n) if rows is None else rows.tolist()):
                ids[r] = plan
        return ids

    def fits(self, positions: torch.Tensor) -> bool:
        """Whether this step's positions fit the RoPE table and its scratch rows (see `_positions`)."""
        return int((positions >= self.model.max_positions).sum()) <= ROPE_SCRATCH

    def _positions(self, positions: torch.Tensor) -> torch.Tensor:
        """positions (B,) as the native step reads them: past the context (a bounded cache's generation),
        a row's cos / sin are `scaled_rope_rows`' (what the module path computes) written into the table's
        scratch rows, and the row reads those."""
        n = self.model.max_positions
        far = positions >= n
        if not bool(far.any()):
            return positions
        cos, sin = self.model.scaled_rope_rows(positions[far])
        k = cos.shape[0]
        self._cos[n : n + k] = cos
        self._sin[n : n + k] = sin
        out = positions.clone()
        out[far] = torch.arange(n, n + k, dtype=positions.dtype, device=positions.device)
        return out

    def __call__(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: PagedKVCache) -> torch.Tensor:
        """input_ids (B,) of a decode-only step -> final hidden states (B, hidden) float32."""
        rows = meta.attn
        assert isinstance(rows, PagedRows)
        while self._stale_loras:
            self._ops.decode_lora_free(self._stale_loras.pop())
        x = self.model.model.embed_tokens(input_ids).float()  # (B, hidden)
        if self.model.config.embedding_multiplier != 1.0:  # Granite's, as the module path multiplies
            x = x * self.model.config.embedding_multiplier
        x = x.contiguous()
        if self._out.shape != x.shape:
            self._out = torch.empty_like(x)
        prof = self.profile if self.profile is not None else self._no_profile
        centers = kv_cache.decode_centers(meta, self._none)  # what a centered cache's keys are stored on
        self._ops.decode_step(self.plan, x, self._positions(meta.positions), meta.slot_mapping, meta.block_tables,
                              rows.seq_lens, kv_cache.k, kv_cache.v, *centers, self._lora_ids(meta.lora, x.shape[0]),
                              self._isa, self._out, prof)
        return self._out
