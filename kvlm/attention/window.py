"""Reference attention for sliding-window layers (no native build, or CUDA): each query sees its last
`window` tokens, its own included (HF's sliding_window; llama.cpp masks p_q - p_k >= window).

One SDPA call per sequence with an explicit (query, key) mask: a sequence's new rows are consecutive in
q and sit at the end of its context (the runner's layout). The native path takes the window inside the
one paged computation (`attention/paged.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlm.attention.metadata import AttentionMetadata


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float,
                       window: int) -> torch.Tensor:
    """q: (T, n_heads, D) the step's queries; k, v: (B, kv_heads, L, D) each sequence's context.
    Returns (T, n_heads * D)."""
    T, nh, D = q.shape
    out = q.new_empty(T, nh * D)
    row = 0
    for b, (n, L) in enumerate(zip(meta.query_lens, meta.seq_lens)):
        pos = torch.arange(L - n, L, device=q.device)[:, None]  # (n, 1) the rows' positions
        key = torch.arange(L, device=q.device)[None, :]  # (1, L)
        mask = (key <= pos) & (key > pos - window)  # (n, L)
        qb = q[row : row + n].transpose(0, 1).unsqueeze(0)  # (1, nh, n, D)
        ob = F.scaled_dot_product_attention(qb, k[b : b + 1, :, :L], v[b : b + 1, :, :L], attn_mask=mask,
                                            scale=scale, enable_gqa=True)
        out[row : row + n] = ob[0].transpose(0, 1).reshape(n, nh * D)
        row += n
    return out
