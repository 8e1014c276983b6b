"""Attention for DECODE steps: one query row per sequence, over its whole cached context.

The reference path (no native kernels, or CUDA): `decode_attention` over K/V gathered per sequence
(SDPA; each K/V head's query group folded into the query-length axis, so GQA never repeats K/V), in
groups of similar length where that saves padding (`plan_length_groups`). With the native kernels
decode rows attend in place like every other row (`paged.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlm.attention.metadata import AttentionMetadata, GatheredRows, StepKind, build_attn_mask


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                     scale: float) -> torch.Tensor:
    """q: (B, n_heads, D), one query per sequence; k, v: (B, kv_heads, L, D). Returns (B, n_heads*D)."""
    T, nh, D = q.shape
    B, kvh = k.shape[0], k.shape[1]
    # One query per sequence: view it as (B, kv_heads, group, D) so each K/V head serves its group of
    # query heads directly (HF's head order: head h uses kv head h // group).
    qg = q.reshape(B, kvh, nh // kvh, D)
    assert isinstance(meta.attn, GatheredRows)
    mask = None if meta.attn.attn_mask is None else meta.attn.attn_mask[:, :, :1, :]  # (B, 1, 1, L) key padding
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return out.reshape(T, nh * D)


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


def decode_rows(tables: list[list[int]], seq_lens: list[int], block_size: int, device: torch.device,
                min_group_batch: int, group_cost: int) -> GatheredRows:
    """The gathered reference's part of a DECODE step's metadata (one row per sequence): the key padding
    mask, and, for a batch of at least `min_group_batch` sequences whose lengths differ enough, groups
    of similar length (`plan_length_groups`), each a metadata of its own over group 0's tables."""
    B = len(seq_lens)
    mask = q_pad_index = None
    if B > 1:  # key padding for the gathered contexts; the pad index is the identity (one row each)
        mask = build_attn_mask([1] * B, seq_lens, device)
        q_pad_index = torch.arange(B, device=device)
    groups: tuple[AttentionMetadata, ...] = ()
    if B >= min_group_batch:
        plan = plan_length_groups(seq_lens, group_cost=group_cost)
        if len(plan) > 1:
            groups = tuple(_group(idx, tables, seq_lens, block_size, device) for idx in plan)
    return GatheredRows(q_pad_index, mask, groups)


def _group(idx: list[int], tables: list[list[int]], seq_lens: list[int], block_size: int,
           device: torch.device) -> AttentionMetadata:
    """Metadata of a group of decoding sequences (one row each, so row == sequence index)."""
    lens = [seq_lens[i] for i in idx]
    nblk = -(-max(lens) // block_size)
    rows = torch.tensor(idx, device=device)
    mask = None if len(idx) == 1 else build_attn_mask([1] * len(idx), lens, device)
    return AttentionMetadata(
        kind=StepKind.DECODE, positions=rows, slots=(rows,),  # positions, slots unused: a group only fetches
        tables=(torch.tensor([tables[i][:nblk] for i in idx], device=device),),
        query_lens=(1,) * len(idx), seq_lens=tuple(lens), logits_indices=rows,
        attn=GatheredRows(None, mask, rows=rows))
