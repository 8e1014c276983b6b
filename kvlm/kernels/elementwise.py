"""RMSNorm, rotate-half RoPE, SiLU(gate) x up and GELU(gate) x up on float32 CPU rows: the native kernels
(`csrc/elementwise.cpp`, the same functions the fused decode step calls) where the extension is built,
else their PyTorch references (`reference.py`).

Sharing one implementation with the fused step is the point: a token's norms, RoPE and SiLU then have
the same bits whether a decode step or a prefill computes them (with int8 activations a last-bit
difference in a norm can move an activation across an int8 rounding step, enough to flip a near-tie
between a cached and a recomputed run). Other dtypes and devices take the references.
"""

from __future__ import annotations

import torch

from kvlm.kernels import native
from kvlm.kernels.backend import native_isa
from kvlm.kernels.reference import gelu_tanh_mul_ref, lora_b_add_ref, rms_norm_ref, rope_ref, silu_mul_ref


def _ops(x: torch.Tensor) -> native.NativeOps | None:
    if native_isa(x) is None:
        return None
    return native.ops()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., n) float32, weight (n,) -> x / sqrt(mean(x^2) + eps) * weight, row by row."""
    ops = _ops(x)
    if ops is None or weight.dtype != torch.float32:
        return rms_norm_ref(x, weight, eps)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(x2)
    ops.rms_norm(x2, weight.detach(), eps, out)
    return out.view(x.shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2I) -> silu(gate_up[:, :I]) * gate_up[:, I:] (T, I)."""
    return _gated(gate_up, "silu_mul", silu_mul_ref)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2I) -> gelu_tanh(gate_up[:, :I]) * gate_up[:, I:] (T, I): Gemma's GeGLU."""
    return _gated(gate_up, "gelu_tanh_mul", gelu_tanh_mul_ref)


def _gated(gate_up: torch.Tensor, op: str, ref) -> torch.Tensor:
    """The native gated op `op` on contiguous float32 (T, 2I) rows, else its reference."""
    ops = _ops(gate_up)
    if ops is None or gate_up.dim() != 2 or not gate_up.is_contiguous():
        return ref(gate_up)
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    getattr(ops, op)(gate_up, out)
    return out


def lora_b_add(t: torch.Tensor, bt: torch.Tensor, spans: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y (T, N) float32 += the LoRA B product of t (T, R), in place (`reference.lora_b_add_ref` says what it
    computes): the native kernel the fused decode step runs too, else the reference, the same arithmetic."""
    ops = _ops(y)
    if ops is None or y.dtype != torch.float32 or y.dim() != 2 or y.stride(1) != 1 or not t.is_contiguous():
        return lora_b_add_ref(t, bt, spans, y)
    ops.lora_b_add(t, bt, spans, y)
    return y


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE: x * cos + rotate_half(x) * sin, where rotate_half([a, b]) = [-b, a].
    roll(x, D/2) gives [b, a]; the sign lives in the table (sin_signed = [-sin, sin]), saving two ops.
    x (T, heads, D) (heads D floats apart, any token stride); cos, sin_signed (T, 1, D)."""
    ops = _ops(x)
    if ops is None or x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2] or cos.dtype != torch.float32:
        return rope_ref(x, cos, sin_signed)
    out = torch.empty(x.shape, dtype=torch.float32)
    ops.rope(x, cos.reshape(x.shape[0], -1), sin_signed.reshape(x.shape[0], -1), out)
    return out
