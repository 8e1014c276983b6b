"""Attention for PREFILL and MIXED steps: prompt chunks (and, in a mixed step, single decode rows).

`prefill_attention` is the pure-PyTorch computation (SDPA) on CPU and CUDA. Keys/values arrive gathered
per sequence as (B, kv_heads, L, D) by the KV cache, the step's new tokens already written. A lone
sequence whose whole context is new is plain causal attention; a chunk after cached blocks is causal
with an offset (the step's mask); a mixed batch runs one SDPA call per sequence on CPU, or one padded
masked call on CUDA. GQA never repeats K/V (SDPA's `enable_gqa`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlm.attention.metadata import AttentionMetadata, GatheredRows, build_attn_mask


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                      scale: float) -> torch.Tensor:
    """q: (T, n_heads, D) new queries; k, v: (B, kv_heads, L, D) per-sequence context. Returns (T, n_heads*D)."""
    T, nh, D = q.shape
    B = k.shape[0]
    rows = meta.attn
    assert isinstance(rows, GatheredRows)
    if B == 1:
        # One sequence: no padding. Without a mask its whole context is new (prefill from position 0),
        # so plain causal attention; with cached history the mask offsets the causal diagonal.
        qp = q.transpose(0, 1).unsqueeze(0)  # (1, nh, T, D)
        out = F.scaled_dot_product_attention(qp, k, v, attn_mask=rows.attn_mask, is_causal=rows.attn_mask is None,
                                             scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(T, nh * D)
    if q.device.type == "cpu":
        return _attention_per_sequence(q, k, v, meta, scale)
    # General mixed batch: scatter queries into a padded (B, nh, max_q, D) layout and mask.
    max_q = meta.max_query_len
    assert rows.q_pad_index is not None
    qp = q.new_zeros(B * max_q, nh, D)
    qp[rows.q_pad_index] = q
    qp = qp.view(B, max_q, nh, D).transpose(1, 2)
    out = F.scaled_dot_product_attention(qp, k, v, attn_mask=rows.attn_mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(B * max_q, nh * D)[rows.q_pad_index]


def prefill_rows(query_lens: list[int], seq_lens: list[int], device: torch.device) -> GatheredRows:
    """The gathered reference's part of a PREFILL / MIXED step's metadata: where each row sits in the
    padded (B, max_query_len) layout, and the causal mask offset by each chunk's cached history."""
    q_pad_index = mask = None
    if len(query_lens) > 1:
        max_q = max(query_lens)
        q_pad_index = torch.tensor([b * max_q + i for b, n in enumerate(query_lens) for i in range(n)], device=device)
    if not (len(query_lens) == 1 and query_lens[0] == seq_lens[0]):  # a lone whole prompt needs no mask
        mask = build_attn_mask(query_lens, seq_lens, device)
    return GatheredRows(q_pad_index, mask)




def _attention_per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                            scale: float) -> torch.Tensor:
    """A mixed batch on CPU, one SDPA call per sequence: a padded (B, nh, max_q, L_max) call with a boolean
    mask takes SDPA's math path, which materializes every score and runs several times slower than the
    causal kernel a lone prompt gets. Sequence b's rows are consecutive in q (the runner lays requests out
    in order); a chunk that is its whole context is plain causal, a single token needs no mask, other chunks
    take their slice of the step's mask (causal with an offset). This is also how each sequence is computed
    alone."""
    T, nh, D = q.shape
    out = q.new_empty(T, nh * D)
    row = 0
    for b, (n, L) in enumerate(zip(meta.query_lens, meta.seq_lens)):
        qb = q[row : row + n].transpose(0, 1).unsqueeze(0)  # (1, nh, n, D)
        kb, vb = k[b : b + 1, :, :L], v[b : b + 1, :, :L]  # (1, kvh, L, D)
        if n == L or n == 1:
            ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=n > 1, scale=scale, enable_gqa=True)
        else:
            assert isinstance(meta.attn, GatheredRows) and meta.attn.attn_mask is not None
            mask = meta.attn.attn_mask[b : b + 1, :, :n, :L]
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=True)
        out[row : row + n] = ob[0].transpose(0, 1).reshape(n, nh * D)
        row += n
    return out
