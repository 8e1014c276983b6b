"""`LoRAAdapter`: one loaded adapter's low-rank weights, laid out on the base model's stacked projections.

A LoRA adapter changes a base projection W (out x in) into W + scale * B A, A (r x in), B (out x r). kvlm
never merges it into W: the base matmul runs as for every other row, and rows whose request names the
adapter then get `y += (scale B) (A x)` (`LoRARows.apply`, in `kvlm.lora.rows`).

The model stacks q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, so an adapter's parts are stacked
the same way at load: `A` is the parts' A matrices one after another (sum of ranks x in), one matrix
product for every targeted part. B is kept per part, transposed and times its scale (`bt`, the parts' (r, n)
matrices packed one after another, with `spans`: each part's rank columns r0:r0+r of A's product and output
rows o0:o0+n of the stacked projection): the stacked B would be block diagonal, and at rank 16 its zeros
were a third of the adapter's bytes, all read every decode step. An adapter on a fused projection (Phi-3's
`qkv_proj`, `gate_up_proj`) has one A, and its B is split by rows into the parts, every span reading all r
columns of A's product: the same two kernels, the same bits as the parts' own adapters with that A.

This module knows the base only through `ModelConfig`; reading files is `kvlm.loader.lora`'s.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from kvlm.config import ModelConfig
from kvlm.errors import LoRAError
from kvlm.kernels.ggml_types import GGMLQuantizationType
from kvlm.kernels.quant_tensor import QuantTensor

# HF module names an adapter may target, and the model's (stacked) projection each lives in. Phi-3's
# checkpoints store q/k/v and gate/up fused (`qkv_proj`, `gate_up_proj`), so its PEFT adapters target those:
# one A for the fused projection, one B whose rows are the parts' rows one after another.
TARGETS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
           "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj",
           "qkv_proj": "qkv_proj", "gate_up_proj": "gate_up_proj"}
_STACK_ORDER = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")  # under self_attn; the rest under mlp


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each targetable HF module of the base model."""
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    nh, kvh = config.num_attention_heads, config.num_key_value_heads
    return {"q_proj": (nh * d, h), "k_proj": (kvh * d, h), "v_proj": (kvh * d, h), "o_proj": (h, nh * d),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def _shape(shapes: dict[str, tuple[int, int]], module: str) -> tuple[int, int]:
    """(out, in) of a targetable module, the fused ones (Phi-3's qkv_proj, gate_up_proj) included."""
    if module in _STACK_ORDER:  # a fused projection: its parts' rows one after another
        parts = _STACK_ORDER[module]
        return sum(shapes[m][0] for m in parts), shapes[parts[0]][1]
    return shapes[module]


def f32_rows(w: torch.Tensor) -> QuantTensor:
    """A float32 or bfloat16 (N, K) matrix as an F32 / BF16 `QuantTensor`: multiplied by the native row kernel
    (`qmatmul`), whose every output row has the same bits in any batch (the base's dense weights take the same
    path). BF16 rows run with bf16 activations (csrc/kernels_bf16.h), so the two formats' bits differ."""
    w = w.contiguous() if w.dtype == torch.bfloat16 else w.float().contiguous()
    qtype = GGMLQuantizationType.BF16 if w.dtype == torch.bfloat16 else GGMLQuantizationType.F32
    return QuantTensor(w.view(torch.uint8).reshape(w.shape[0], -1), qtype, (w.shape[0], w.shape[1]))


def compact(w: torch.Tensor) -> torch.Tensor:
    """float32 `w` as bfloat16 where bfloat16 holds every value exactly (an adapter trained or saved in
    bfloat16, its scale a power of two), else `w`. Used for B^T (`bt`): `lora_b_add` widens bfloat16 to
    float32 exactly before each multiply, so the bits are the float32 ones, and a decode step reads half of
    those bytes. (A stays float32: see `load`.)"""
    h = w.to(torch.bfloat16)
    return h if torch.equal(h.float(), w) else w


@dataclass(frozen=True, slots=True)
class LoRAPart:
    """One targeted HF module of one layer, as read from the file: A (r, in), B (out, r), scale."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass(frozen=True, slots=True)
class StackedLoRA:
    """An adapter's weights on one stacked projection of one layer: A (R, in) as F32 or BF16 rows; per targeted
    part its scaled B transposed, packed (`bt`, float32, or bfloat16 where that is exact: `compact`), and
    `spans` (P, 4) int64: r0, r, o0, n of each part."""

    a: QuantTensor
    bt: torch.Tensor
    spans: torch.Tensor


@dataclass(eq=False, slots=True)
class LoRAAdapter:
    """A loaded adapter: its name, numeric id (vLLM's `lora_int_id`), where it came from, and its weights
    per (layer, stacked projection). `key` names its content and scale: the prefix cache's hash chain and
    snapshots are keyed by it, so requests under different adapters never share K/V."""

    name: str
    id: int
    path: str
    scale: float  # the user's multiplier (--lora NAME=PATH:SCALE); alpha / r is folded in per part
    rank: int
    targets: tuple[str, ...]  # HF module names, e.g. ("q_proj", "v_proj")
    weights: dict[tuple[int, str], StackedLoRA] = field(repr=False)
    key: str = ""

    def on(self, layer: int, module: str) -> StackedLoRA | None:
        """The weights on `module` ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") of `layer`, if any."""
        return self.weights.get((layer, module))


def build_adapter(name: str, adapter_id: int, path: str, parts: dict[tuple[int, str], LoRAPart],
                  config: ModelConfig, scale: float = 1.0) -> LoRAAdapter:
    """Check `parts` ((layer, HF module) -> A, B, scale) against the base and stack them as the model's
    projections are stacked. Each misfit is one `LoRAError` line naming the adapter and the tensor."""
    if not parts:
        raise LoRAError(f"LoRA adapter {name!r} ({path}): no LoRA tensors found")
    shapes = module_shapes(config)
    ranks = set()
    for (layer, module), p in sorted(parts.items()):
        where = f"LoRA adapter {name!r}: layers.{layer}.{module}"
        if module not in TARGETS:
            raise LoRAError(f"{where}: target module {module!r} is not one kvlm can adapt "
                            f"(supported: {', '.join(TARGETS)})")
        if not 0 <= layer < config.num_hidden_layers:
            raise LoRAError(f"{where}: the base model has {config.num_hidden_layers} layers")
        out, inp = _shape(shapes, module)
        r = p.a.shape[0]
        if p.a.dim() != 2 or p.b.dim() != 2 or p.b.shape[1] != r:
            raise LoRAError(f"{where}: lora_A {tuple(p.a.shape)} and lora_B {tuple(p.b.shape)} do not share a rank")
        if p.a.shape[1] != inp or p.b.shape[0] != out:
            raise LoRAError(f"{where}: lora_B @ lora_A is {p.b.shape[0]} x {p.a.shape[1]}, the base module "
                            f"is {out} x {inp}")
        if r == 0 or r > min(out, inp):
            raise LoRAError(f"{where}: rank {r} does not fit a {out} x {inp} module")
        if not (torch.isfinite(p.a).all() and torch.isfinite(p.b).all()):
            raise LoRAError(f"{where}: non-finite values")
        ranks.add(r)
        if module != TARGETS[module] and (layer, TARGETS[module]) in parts:
            raise LoRAError(f"{where}: the adapter targets both the fused {TARGETS[module]} and its part {module}")
    weights: dict[tuple[int, str], StackedLoRA] = {}
    digest = hashlib.sha256(f"{scale!r}".encode())
    for layer in range(config.num_hidden_layers):
        for stacked, members in _STACK_ORDER.items():
            fused = parts.get((layer, stacked)) if len(members) > 1 else None
            if fused is not None:  # one A; B split by rows into the parts, each reading all r columns
                present = [(m, LoRAPart(fused.a, b, fused.scale))
                           for m, b in zip(members, fused.b.split([shapes[m][0] for m in members]))]
            else:
                present = [(m, parts[layer, m]) for m in members if (layer, m) in parts]
            if not present:
                continue
            a = fused.a.float() if fused is not None else torch.cat([p.a.float() for _, p in present])  # (R, in)
            bts, spans, r0 = [], [], 0
            for m, p in present:
                o0 = sum(shapes[x][0] for x in members[: members.index(m)])
                r = p.a.shape[0]
                bts.append((p.b.float() * (p.scale * scale)).T.contiguous().reshape(-1))  # (r, n), row-major
                spans.append((0 if fused is not None else r0, r, o0, shapes[m][0]))
                r0 += r
            bt, sp = torch.cat(bts), torch.tensor(spans, dtype=torch.int64)
            for t in (a, bt, sp):
                digest.update(f"{layer}.{stacked}{tuple(t.shape)}".encode())
                digest.update(t.numpy().tobytes())
            # A stays float32: BF16 rows run the bf16-activation kernels (csrc/kernels_bf16.h), whose bits are
            # not float32's, and an adapter's numbers must not depend on whether its values fit bfloat16.
            weights[layer, stacked] = StackedLoRA(f32_rows(a), compact(bt), sp)
    targets = tuple(m for m in TARGETS if any(k[1] == m for k in parts))
    return LoRAAdapter(name, adapter_id, path, scale, max(ranks), targets, weights, key=digest.hexdigest())
