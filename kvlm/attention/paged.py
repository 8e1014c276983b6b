"""The one attention computation: every query row over its sequence's cached K/V, read in place.

Prefill rows, prefill chunks after cached blocks, decode rows, the rows of a mixed step and the rows
of a no-cache recompute are all computed here, after the step's K/V were written to the cache. Row t
of a step attends the first `row_ctx[t]` (its position + 1) tokens of sequence `row_seq[t]`, read
through that sequence's block table, with the native kernel's fixed order (online softmax over
128-token chunks in position order, `kernels/paged_attention.py`). So a row's output bits depend only
on its query and on the K/V at positions 0..p as the cache stores them: never on how many rows,
sequences or chunks share the step, nor on the thread count. A prefill row reads exactly what a later
decode of the same position reads.
"""

from __future__ import annotations

import torch

from kvlm.attention.metadata import AttentionMetadata
from kvlm.kernels import paged_attention as _kernel
from kvlm.kernels.kv_quant import K0Correction


def paged_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, block_tables: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int = 0,
                    k0: K0Correction | None = None) -> torch.Tensor:
    """q (T, n_heads, D); k_blocks, v_blocks (num_blocks, block_size, kv_heads, D); block_tables (B, max_blocks)
    int32, one row per sequence of `meta`; window > 0: each row attends its last `window` tokens only (a
    sliding-window layer; the kernel's per-row rule holds the same). k0: a cache whose position-0 keys are
    centered on k0 (`KVCache.k0_correction`). Returns (T, n_heads * D)."""
    assert meta.in_place and meta.row_seq is not None and meta.row_ctx is not None
    # Each row's bits are the decode kernel's for that single query at its own context length (the
    # kernel tiles the rows of one sequence against each K/V group, without changing any row's order).
    out = _kernel(q, k_blocks, v_blocks, block_tables, meta.row_seq, meta.row_ctx, scale, window=window, k0=k0)
    return out.reshape(q.shape[0], -1)
