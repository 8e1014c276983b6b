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

from typing import NamedTuple

import torch

from kvlm.attention.metadata import AttentionMetadata, PagedRows
from kvlm.kernels import paged_attention as _kernel
from kvlm.kernels.kv_quant import K0Correction


class PagedKV(NamedTuple):
    """One layer's K/V as a cache hands them to in-place attention (`KVCache.blocks`): what to read and
    how; the model passes it on without looking inside."""

    k: torch.Tensor  # (num_blocks, block_size, kv_heads, D) float, or quantized codes (kernels/kv_quant.py)
    v: torch.Tensor
    tables: torch.Tensor  # (B, max_blocks) int32, one row per sequence of the step
    # A cache that stores a sequence's first key on a center of its own: the score correction for it
    correction: K0Correction | None = None


def paged_attention(q: torch.Tensor, kv: PagedKV, meta: AttentionMetadata, scale: float,
                    window: int = 0) -> torch.Tensor:
    """q (T, n_heads, D); kv the layer's blocks and tables (one row per sequence of `meta`); window > 0:
    each row attends its last `window` tokens only (a sliding-window layer; the kernel's per-row rule
    holds the same). Returns (T, n_heads * D)."""
    rows = meta.attn
    assert isinstance(rows, PagedRows)
    # Each row's bits are the decode kernel's for that single query at its own context length (the
    # kernel tiles the rows of one sequence against each K/V group, without changing any row's order).
    out = _kernel(q, kv.k, kv.v, kv.tables, rows.row_seq, rows.row_ctx, scale, window=window, k0=kv.correction)
    return out.reshape(q.shape[0], -1)


def paged_rows(positions: torch.Tensor, query_lens: list[int], seq_lens: list[int], shifts: list[int]) -> PagedRows:
    """The paged backend's part of a step's metadata. positions (T,) int64; per sequence its new rows,
    the tokens its last row attends and its shift (a bounded cache's rows read p + 1 - shift tokens of
    [sinks | kept]; 0 otherwise). int32, as the native kernels take them."""
    dev = positions.device
    row_seq = torch.arange(len(query_lens), dtype=torch.int32, device=dev)
    # decode (one row per sequence): row t is sequence t, nothing to repeat; repeat_interleave was ~1% of the
    # default model's decode step (py-spy, docs/results/xeon_session28.txt)
    qlens = None if all(q == 1 for q in query_lens) else torch.tensor(query_lens, device=dev)
    if qlens is not None:
        row_seq = torch.repeat_interleave(row_seq, qlens)
    row_ctx = (positions + 1).to(torch.int32)  # causal: the row at position p attends p + 1 tokens
    if any(shifts):
        shift = torch.tensor(shifts, dtype=torch.int32, device=dev)
        row_ctx -= shift if qlens is None else torch.repeat_interleave(shift, qlens)
    return PagedRows(row_seq, row_ctx, torch.tensor(seq_lens, dtype=torch.int32, device=dev))
