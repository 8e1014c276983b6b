"""Decode attention that reads the paged KV cache in place through the block table.

`paged_decode_attention` is one query token per sequence (decode) against that sequence's cached
tokens, with grouped-query attention (query head h uses K/V head h // (H / kv_heads)). The native
kernel walks each sequence's blocks directly (no gather copy), keeps a running max and denominator
(online softmax) and runs in parallel over (sequence, kv head). Its reference gathers the blocks and
calls SDPA (`reference.paged_decode_attention_ref`); the reference also serves inputs the kernel does
not take (non-float32, non-CPU, head_dim not a multiple of 16, or a non-contiguous cache).
"""

from __future__ import annotations

import torch

from kvlm.kernels import native
from kvlm.kernels.reference import paged_decode_attention_ref


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, H, D); k_cache, v_cache (num_blocks, block_size, kv_heads, D); block_tables (B, max_blocks)
    int32; seq_lens (B,) int32 -> (B, H, D). Sequence b attends over its first seq_lens[b] cached tokens,
    token t living in block block_tables[b, t // block_size] at slot t % block_size. A sequence of
    length 0 gives zeros."""
    isa = native.active_isa()
    fast = (isa != "reference" and q.device.type == "cpu" and k_cache.device.type == "cpu"
            and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
            and q.shape[-1] % 16 == 0 and k_cache.is_contiguous() and v_cache.is_contiguous())
    if not fast:
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale)
    q = q.contiguous()
    out = torch.empty_like(q)
    torch.ops.kvlm_kernels.paged_decode_attention(
        q, k_cache, v_cache, block_tables.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous(),
        float(scale), native.isa_id(isa), out)
    return out
