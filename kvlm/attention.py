"""Attention over a batch of sequences that each bring some new tokens and some cached history.

`AttentionMetadata` describes one engine step: which flat token belongs to which sequence, at which
position, where its K/V go in the cache and how long each sequence's context is. It is built once per
step by the runner (`runner.py`) and passed explicitly through the model; nothing here is global.

`attention()` is the pure-PyTorch reference (SDPA); it runs on CPU and CUDA. Keys/values arrive already
gathered per sequence as (B, kv_heads, L, D) by the KV cache. GQA never repeats K/V: decode folds each
K/V head's query group into the query-length axis, other steps use SDPA's `enable_gqa`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Per-step layout of a mixed batch of prefill chunks and decodes (T flat tokens, B sequences)."""

    positions: torch.Tensor  # (T,) int64: position of each token in its sequence
    slot_mapping: torch.Tensor  # (T,) int64: flat cache slot (block * block_size + offset) of each token
    block_tables: torch.Tensor  # (B, max_blocks) int64 (int32 with context_lens), padded with 0
    query_lens: tuple[int, ...]  # new tokens per sequence (host ints: they shape tensors)
    seq_lens: tuple[int, ...]  # context length per sequence after this step (cached + new)
    q_pad_index: torch.Tensor | None  # (T,) int64: row of each token in the (B * max_query_len) padded layout
    attn_mask: torch.Tensor | None  # (B, 1, max_query_len, max_seq_len) bool, True = may attend; None = not needed
    logits_indices: torch.Tensor  # (N,) int64: flat rows whose logits we need (a sequence's last token)
    # Decode-only batches of sequences with very different lengths are attended in groups of similar
    # length, so that short sequences are not padded to the longest (see plan_length_groups). Each
    # group is a metadata of its own whose `rows` are its tokens' rows in this batch.
    groups: tuple[AttentionMetadata, ...] = ()
    rows: torch.Tensor | None = None  # (T_group,) int64, only in a group
    # Decode-only steps on the paged cache with the native kernels: (B,) int32 context lengths, and
    # attention reads the blocks in place (PagedKVCache.decode_attention) instead of gather + SDPA.
    context_lens: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def plan_length_groups(seq_lens: list[int], max_groups: int = 4, group_cost: int = 1024) -> list[list[int]]:
    """Partition sequences into at most `max_groups` groups of similar length for decode attention.

    Gathering and attending over a padded (B, L_max) context costs about sum over groups of
    len(group) x max length in group; each extra group costs a fixed `group_cost` (in token slots) of
    per-call overhead. Sequences sorted by length are split into contiguous runs by dynamic programming
    (B is at most max_num_seqs, so this is a few thousand additions on the host). Returns lists of
    sequence indices; one group means no split.
    """
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    L = [seq_lens[i] for i in order]
    n = len(L)
    INF = float("inf")
    # best[g][j]: cheapest cost of splitting the first j sorted sequences into g groups.
    best = [[INF] * (n + 1) for _ in range(max_groups + 1)]
    cut = [[0] * (n + 1) for _ in range(max_groups + 1)]
    best[0][0] = 0
    for g in range(1, max_groups + 1):
        for j in range(1, n + 1):
            for i in range(g - 1, j):
                c = best[g - 1][i] + (j - i) * L[j - 1] + group_cost
                if c < best[g][j]:
                    best[g][j], cut[g][j] = c, i
    g = min(range(1, max_groups + 1), key=lambda k: best[k][n])
    groups, j = [], n
    while g > 0:
        i = cut[g][j]
        groups.append(order[i:j])
        j, g = i, g - 1
    return groups[::-1]


def build_attn_mask(query_lens: list[int], seq_lens: list[int], device: torch.device) -> torch.Tensor:
    """(B, 1, max_q, max_L) causal mask for sequences whose new tokens sit at the end of their context.

    Query i of sequence b is at position seq_len_b - query_len_b + i and may see keys j <= that position.
    Padding query rows get position 0 so they still see key 0 (no all-masked row, hence no NaN).
    """
    q = torch.tensor(query_lens, device=device)
    s = torch.tensor(seq_lens, device=device)
    i = torch.arange(max(query_lens), device=device)
    pos = (s - q)[:, None] + i[None, :]  # (B, max_q)
    pos = torch.where(i[None, :] < q[:, None], pos, torch.zeros_like(pos))
    j = torch.arange(max(seq_lens), device=device)
    return (j[None, None, :] <= pos[:, :, None]).unsqueeze(1)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q: (T, n_heads, D) new queries; k, v: (B, kv_heads, L, D) per-sequence context. Returns (T, n_heads*D)."""
    T, nh, D = q.shape
    B, kvh = k.shape[0], k.shape[1]
    if meta.is_decode_only:
        # One query per sequence: view it as (B, kv_heads, group, D) so each K/V head serves its group of
        # query heads directly (HF's head order: head h uses kv head h // group).
        qg = q.reshape(B, kvh, nh // kvh, D)
        mask = None if meta.attn_mask is None else meta.attn_mask[:, :, :1, :]  # (B, 1, 1, L) key padding
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        return out.reshape(T, nh * D)
    if B == 1:
        # One sequence: no padding. Without a mask its whole context is new (prefill from position 0),
        # so plain causal attention; with cached history the mask offsets the causal diagonal.
        qp = q.transpose(0, 1).unsqueeze(0)  # (1, nh, T, D)
        out = F.scaled_dot_product_attention(qp, k, v, attn_mask=meta.attn_mask, is_causal=meta.attn_mask is None,
                                             scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(T, nh * D)
    if q.device.type == "cpu":
        return _attention_per_sequence(q, k, v, meta, scale)
    # General mixed batch: scatter queries into a padded (B, nh, max_q, D) layout and mask.
    max_q = meta.max_query_len
    assert meta.q_pad_index is not None
    qp = q.new_zeros(B * max_q, nh, D)
    qp[meta.q_pad_index] = q
    qp = qp.view(B, max_q, nh, D).transpose(1, 2)
    out = F.scaled_dot_product_attention(qp, k, v, attn_mask=meta.attn_mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(B * max_q, nh * D)[meta.q_pad_index]


def _attention_per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                            scale: float) -> torch.Tensor:
    """A mixed batch on CPU, one SDPA call per sequence: a padded (B, nh, max_q, L_max) call with a
    boolean mask takes SDPA's math path, which materializes every score and runs several times slower
    than the causal kernel a lone prompt gets (measured: a 2048-token step of 6 prompts, 310 vs 550
    tok/s). Sequence b's rows are consecutive in q (the runner lays requests out in order); a chunk that
    is its whole context is plain causal, a single token needs no mask, other chunks take their slice of
    the step's mask (causal with an offset). This is also how each sequence is computed alone."""
    T, nh, D = q.shape
    out = q.new_empty(T, nh * D)
    row = 0
    for b, (n, L) in enumerate(zip(meta.query_lens, meta.seq_lens)):
        qb = q[row : row + n].transpose(0, 1).unsqueeze(0)  # (1, nh, n, D)
        kb, vb = k[b : b + 1, :, :L], v[b : b + 1, :, :L]  # (1, kvh, L, D)
        if n == L or n == 1:
            ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=n > 1, scale=scale, enable_gqa=True)
        else:
            assert meta.attn_mask is not None
            mask = meta.attn_mask[b : b + 1, :, :n, :L]
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=True)
        out[row : row + n] = ob[0].transpose(0, 1).reshape(n, nh * D)
        row += n
    return out
