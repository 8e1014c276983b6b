"""`LoRAAdapter`: one loaded adapter's low-rank weights, laid out on the base model's stacked projections.

A LoRA adapter changes a base projection W (out x in) into W + scale * B A, A (r x in), B (out x r). kvlm
never merges it into W: the base matmul runs as for every other row, and rows whose request names the
adapter then get `y += (scale B) (A x)` (`LoRARows.apply`, in `kvlm.lora.rows`).

The model stacks q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, so an adapter's parts are stacked
the same way at load: `A` is the parts' A matrices one after another (sum of ranks x in), one matrix
product for every targeted part. B is kept per part, transposed and times its scale (`bt`, the parts' (r, n)
matrices packed one after another, with `spans`: each part's rank columns r0:r0+r of A's product and output
rows o0:o0+n of the stacked projection): the stacked B would be block diagonal, and at rank 16 its zeros
were a third of the adapter's bytes, all read every decode step.

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

# HF module names an adapter may target, and the model's (stacked) projection each lives in.
TARGETS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
           "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
_STACK_ORDER = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each targetable HF module of the base model."""
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    nh, kvh = config.num_attention_heads, config.num_key_value_heads
    return {"q_proj": (nh * d, h), "k_proj": (kvh * d, h), "v_proj": (kvh * d, h), "o_proj": (h, nh * d),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def f32_rows(w: torch.Tensor) -> QuantTensor:
    """A float32 (N, K) matrix as an F32 `QuantTensor`: multiplied by the native row kernel (`qmatmul`),
    whose every output row has the same bits in any batch (the base's dense weights take the same path)."""
    w = w.float().contiguous()
    return QuantTensor(w.view(torch.uint8).reshape(w.shape[0], -1), GGMLQuantizationType.F32, (w.shape[0], w.shape[1]))


@dataclass(frozen=True, slots=True)
class LoRAPart:
    """One targeted HF module of one layer, as read from the file: A (r, in), B (out, r), scale."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass(frozen=True, slots=True)
class StackedLoRA:
    """An adapter's weights on one stacked projection of one layer: A (R, in) as F32 rows; per targeted part
    its scaled B transposed, packed (`bt`, float32), and `spans` (P, 4) int64: r0, r, o0, n of each part."""

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
        out, inp = shapes[module]
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
    weights: dict[tuple[int, str], StackedLoRA] = {}
    digest = hashlib.sha256(f"{scale!r}".encode())
    for layer in range(config.num_hidden_layers):
        for stacked, members in _STACK_ORDER.items():
            present = [(m, parts[layer, m]) for m in members if (layer, m) in parts]
            if not present:
                continue
            a = torch.cat([p.a.float() for _, p in present])  # (R, in)
            bts, spans, r0 = [], [], 0
            for m, p in present:
                o0 = sum(shapes[x][0] for x in members[: members.index(m)])
                r = p.a.shape[0]
                bts.append((p.b.float() * (p.scale * scale)).T.contiguous().reshape(-1))  # (r, n), row-major
                spans.append((r0, r, o0, shapes[m][0]))
                r0 += r
            bt, sp = torch.cat(bts), torch.tensor(spans, dtype=torch.int64)
            for t in (a, bt, sp):
                digest.update(f"{layer}.{stacked}{tuple(t.shape)}".encode())
                digest.update(t.numpy().tobytes())
            weights[layer, stacked] = StackedLoRA(f32_rows(a), bt, sp)
    targets = tuple(m for m in TARGETS if any(k[1] == m for k in parts))
    return LoRAAdapter(name, adapter_id, path, scale, max(ranks), targets, weights, key=digest.hexdigest())
