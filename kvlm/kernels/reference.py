"""Pure-PyTorch/numpy references for the kernels: slow, obviously right, always available on CPU.

Every native kernel is tested against these, and they are the fallback where the native extension
cannot be built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvlm.kernels import kv_quant

if TYPE_CHECKING:
    from kvlm.kernels.kv_quant import K0Correction
    from kvlm.kernels.quant_tensor import QuantTensor


def dequantize_ref(w: QuantTensor) -> torch.Tensor:
    """(N, K) float32 from the GGUF blocks, decoded by the `gguf` package's numpy code."""
    from gguf import GGMLQuantizationType, quants

    raw = w.data.cpu().numpy()
    if w.qtype == GGMLQuantizationType.F32:
        arr = raw.view(np.float32)
    elif w.qtype == GGMLQuantizationType.F16:
        arr = raw.view(np.float16).astype(np.float32)
    else:
        arr = quants.dequantize(raw, w.qtype).astype(np.float32, copy=False)
    return torch.from_numpy(np.ascontiguousarray(arr).reshape(w.shape))


def qmatmul_ref(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """x (M, K) float32 @ dequantize(w).T -> (M, N) float32."""
    return x.float() @ dequantize_ref(w).to(x.device).T


def quantize_act_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 activation quantization of the int8 kernels: x (M, K) float32, K % 32 == 0, ->
    q (M, K // 32, 32) int8 and d (M, K // 32, 1) float32 with d = amax / 127 per 32-element block,
    q = round_half_even(x * (1 / d)) (q = 0 where d = 0), all in float32 as the kernels compute it."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(blocks * inv).to(torch.int8), d


def fake_quantize_act(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) -> the float32 values the int8 kernels compute with: q * d per block (same shape)."""
    q, d = quantize_act_ref(x)
    return (q.float() * d).reshape(x.shape)


def qmatmul_int8_ref(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """The numerics of the int8-activation kernels (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K):
    fake-quantize x per 32-element block, then x_fq (M, K) @ dequantize(w).T in float32. A min term
    (Q4_1, Q5_1, Q4_K, Q5_K) m * sum(x_fq) is then m * d * sum(q) (llama.cpp's q8_1 convention), which is
    what the kernels compute. The K-quants' x is quantized per 32 too (llama.cpp: per 256, q8_K)."""
    return fake_quantize_act(x) @ dequantize_ref(w).to(x.device).T


def _dense(blocks: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Cache blocks (..., D) of a float type, or (..., row_bytes) uint8 codes of a quantized format ->
    float32 (..., D) values (codes dequantized and, for a rotating format, rotated back)."""
    fmt = kv_quant.format_of(blocks, head_dim)
    if fmt is None:
        return blocks.float()
    return kv_quant.unrotated(kv_quant.dequantize(blocks, fmt, head_dim), fmt)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Gather each sequence's blocks, then SDPA with each K/V head's query heads folded together.

    q (B, H, D); caches (num_blocks, block_size, kv_heads, D) of any float type (or int8 / int4 codes,
    dequantized) -> (B, H, D) in q's dtype,
    computed in float32; zeros for a length-0 sequence.
    """
    import torch.nn.functional as F

    b_size, heads, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(b_size):
        length = int(seq_lens[b])
        if length == 0:
            continue
        blocks = block_tables[b, : (length + block_size - 1) // block_size].long()
        k = _dense(k_cache[blocks], d).reshape(-1, kv_heads, d)[:length].transpose(0, 1)  # (kv_heads, L, D)
        v = _dense(v_cache[blocks], d).reshape(-1, kv_heads, d)[:length].transpose(0, 1)
        qg = q[b].float().reshape(kv_heads, group, d)  # query head h = g * group + i uses K/V head g
        out[b] = F.scaled_dot_product_attention(qg, k, v, scale=scale).reshape(heads, d)
    return out.to(q.dtype)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_ids: torch.Tensor, ctx_lens: torch.Tensor, scale: float, window: int = 0,
                        k0: K0Correction | None = None) -> torch.Tensor:
    """Query rows of any sequences: gather each sequence's blocks once, then SDPA of its rows with a
    per-row key mask (row t sees tokens < ctx_lens[t], and with window > 0 none before ctx_lens[t] -
    window), each K/V head's query heads folded together.

    q (T, H, D); caches (num_blocks, block_size, kv_heads, D) of any float type (or int8 / int4 codes,
    dequantized); block_tables (B,
    max_blocks); seq_ids, ctx_lens (T,) -> (T, H, D) in q's dtype, computed in float32; zeros for a row
    with ctx_lens 0. k0: token 0 of each sequence in k0.seqs (None: all) reads k + k0.delta (a centered
    cache's position-0 key, `kv_quant.KeyCenter`).
    """
    import torch.nn.functional as F

    t_rows, heads, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    seq_ids = seq_ids.to(device=q.device, dtype=torch.long)
    lens = ctx_lens.to(device=q.device, dtype=torch.long)
    for s in torch.unique(seq_ids).tolist():
        rows = torch.nonzero((seq_ids == s) & (lens > 0)).flatten()
        if rows.numel() == 0:
            continue
        length = int(lens[rows].max())
        blocks = block_tables[s, : (length + block_size - 1) // block_size].long()
        k = _dense(k_cache[blocks], d).reshape(-1, kv_heads, d)[:length].transpose(0, 1)  # (kv_heads, L, D)
        v = _dense(v_cache[blocks], d).reshape(-1, kv_heads, d)[:length].transpose(0, 1)
        if k0 is not None and (k0.seqs is None or bool(k0.seqs[s])):
            k = k.clone()
            k[:, 0] += k0.delta.to(k)
        n = rows.numel()
        # (kv_heads, group * n, D): query head h = g * group + i uses K/V head g; row-major (i, row).
        qg = q[rows].float().reshape(n, kv_heads, group, d).permute(1, 2, 0, 3).reshape(kv_heads, group * n, d)
        pos = torch.arange(length, device=q.device)[None, :]
        mask = pos < lens[rows][:, None]  # (n, L)
        if window > 0:
            mask &= pos >= lens[rows][:, None] - window
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask.repeat(group, 1), scale=scale)
        out[rows] = o.reshape(kv_heads, group, n, d).permute(2, 0, 1, 3).reshape(n, heads, d)
    return out.to(q.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * weight (torch's fused rms_norm)."""
    return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2I) -> silu(first half) * second half."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2I) -> gelu(first half, tanh approximation) * second half (HF's gelu_pytorch_tanh)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE with a signed sin table: x * cos + roll(x, D/2) * sin_signed."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed
