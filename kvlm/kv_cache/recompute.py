"""`NoKVCache`: the cache of recompute mode, which keeps nothing between steps.

Each step must carry each sequence's whole history. K/V are rounded or quantized (and keys centered) as
a cache of that element type stores them (`storage.py`), so a no-cache recompute attends to exactly the
values a cache would hold: the engine's cache == no-cache equivalence.
"""

from __future__ import annotations

import torch

from kvlm.attention.metadata import AttentionMetadata, GatheredRows, PagedRows
from kvlm.attention.paged import PagedKV
from kvlm.kernels.kv_quant import K0Correction, KeyCenter, centered
from kvlm.kv_cache.storage import KVElement, add_k0_delta, decode_kv, encode_kv


def _pad_new_tokens(x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """(T, kvh, D) flat new tokens -> (B, kvh, max_q, D), each sequence's tokens first, then zeros."""
    if meta.num_seqs == 1:
        return x.transpose(0, 1).unsqueeze(0)
    assert isinstance(meta.attn, GatheredRows) and meta.attn.q_pad_index is not None
    out = x.new_zeros(meta.num_seqs * meta.max_query_len, *x.shape[1:])
    out[meta.attn.q_pad_index] = x
    return out.view(meta.num_seqs, meta.max_query_len, *x.shape[1:]).transpose(1, 2)


class NoKVCache:
    """Stores nothing between steps: each step must carry each sequence's whole history (recompute mode).
    K/V are rounded (or quantized) to `dtype`, as a cache of that type would store them. For in-place
    attention the step's stored K/V are laid out as one block per sequence, (B, max_seq_len, kv_heads, D
    or row_bytes), which lives until the next write: the same bytes at the same positions a cache would
    hold, so every row computes the same."""

    block_size = 1 << 30
    num_blocks = 1 << 30
    nbytes = 0
    bytes_per_token = 0.0

    def __init__(self, dtype: KVElement | None = None, k_center: KeyCenter | None = None) -> None:
        self.dtype, self.k_center = dtype, k_center

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        elem = self.dtype if self.dtype is not None else k.dtype
        # only until fetch(): the current step's tokens are the whole context
        self._kv = (encode_kv(centered(k, self.k_center, layer, meta.positions), elem), encode_kv(v, elem),
                    k.dtype, k.shape[-1])


    def begin_step(self, meta: AttentionMetadata) -> None:
        pass

    def blocks(self, layer: int, meta: AttentionMetadata) -> PagedKV:
        assert meta.query_lens == meta.seq_lens and isinstance(meta.attn, PagedRows), \
            "NoKVCache needs every sequence recomputed from position 0"
        k, v, _, _ = self._kv
        B, L = meta.num_seqs, meta.max_seq_len
        kb = k.new_zeros(B, L, *k.shape[1:])  # zeros: untouched slots are never NaN
        vb = torch.zeros_like(kb)
        rows, pos = meta.attn.row_seq.long(), meta.positions
        kb[rows, pos] = k
        vb[rows, pos] = v
        tables = torch.arange(B, dtype=torch.int32, device=k.device)[:, None]
        # every sequence is recomputed from position 0, so each starts at its position-0 key
        return PagedKV(kb, vb, tables, K0Correction.of(self.k_center, layer, None))

    def fetch(self, layer: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        assert meta.query_lens == meta.seq_lens, "NoKVCache needs every sequence recomputed from position 0"
        k, v, dtype, D = self._kv
        elem = self.dtype if self.dtype is not None else dtype
        k, v = decode_kv(k, elem, D, dtype), decode_kv(v, elem, D, dtype)
        return add_k0_delta(_pad_new_tokens(k, meta), self.k_center, layer, None), _pad_new_tokens(v, meta)

    def update_and_fetch(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata):
        self.write(layer, k, v, meta)
        return self.fetch(layer, meta)
