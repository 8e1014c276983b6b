"""Attention over one engine step's rows, planned as prefill or decode.

`metadata.py`: `AttentionMetadata` and `StepKind`, built once per step by the model runner.
`prefill.py`: reference for steps that carry prompt chunks (PREFILL, MIXED).
`decode.py`: reference for steps of one row per sequence (DECODE): gathered, length-grouped.
`paged.py`: the one native computation for every row of every step, in place over the cache's blocks.
`window.py`: reference for sliding-window layers (Gemma 3's local layers), any step.

With the native kernels the model calls `paged.paged_attention` for every step. The reference (no
native build, or CUDA) calls `attention()`, which picks prefill or decode by the step's kind, after the
KV cache has stored the step's K/V and handed back each sequence's context.
"""

from __future__ import annotations

import torch

from kvlm.attention.decode import decode_attention
from kvlm.attention.metadata import AttentionMetadata
from kvlm.attention.prefill import prefill_attention


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
              scale: float) -> torch.Tensor:
    """q: (T, n_heads, D) the step's queries; k, v: (B, kv_heads, L, D) each sequence's context.
    Returns (T, n_heads * D)."""
    if meta.is_decode:
        return decode_attention(q, k, v, meta, scale)
    return prefill_attention(q, k, v, meta, scale)
