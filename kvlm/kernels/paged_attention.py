"""Attention that reads the paged KV cache in place through the block table.

`paged_attention` takes query rows of any sequences (prefill rows, prefill chunks after cached blocks,
decode rows, mixed steps): row t attends the first ctx_lens[t] cached tokens of sequence seq_ids[t], and
its result is bit-identical to decoding that row alone with L = ctx_lens[t] (`paged_decode_attention`,
the case of one row per sequence), whatever rows share the call, their order or the thread count. Rows
of one sequence are tiled (up to 16 rows against each 16-token K/V group, which is then read once per
tile) while each row keeps the one-row arithmetic; see kernels.h, KvlmPagedAttn.

`paged_decode_attention` is one query token per sequence (decode), the same kernel with one row per
tile. Grouped-query attention: query head h uses K/V head h // (H / kv_heads). The native kernel walks
each sequence's blocks directly (no gather copy), keeps a running max and denominator (online softmax)
and runs in parallel over (row tile, 128-token chunk) work items that each read whole blocks (all kv
heads); a row's chunks, at multiples of 128 of its own length, are combined in chunk order, so its
result depends on nothing else in the call. The references gather the blocks and call SDPA
(`reference.paged_attention_ref`, `reference.paged_decode_attention_ref`); they also serve inputs the
kernel does not take (no native build, non-CPU, q not float32, head_dim not a multiple of 16, or a
non-contiguous cache). The cache may hold float32, float16 or bfloat16 (half the bytes to read per
token), or int8 / int4 codes ((..., kv_heads, row_bytes) uint8, `kv_quant.py`) that the kernel
dequantizes 16 values at a time as it reads them (code * scale, the reference's float32 product); the
codes hold Hadamard-rotated rows, so q is rotated before and the result rotated back after (an
orthonormal H: the scores are q . k). q and the result are float32 and the arithmetic is float32.
"""

from __future__ import annotations

import torch

from kvlm.kernels import kv_quant, native
from kvlm.kernels.backend import ATTN_HEAD_DIM_MULTIPLE, native_isa
from kvlm.kernels.reference import paged_attention_ref, paged_decode_attention_ref

KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # cache element types the kernel reads directly


def _native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """The ISA path that takes these tensors, or None where the reference must serve them. (An engine
    never reaches the reference here by surprise: `backend.select_backend` decides at load whether its
    attention is this native call, from the same conditions: float32 CPU rows, head_dim % 16.)"""
    isa = native_isa(q)
    readable = k_cache.dtype in KV_DTYPES or kv_quant.format_of(k_cache, q.shape[-1]) is not None
    fast = (isa is not None and k_cache.device.type == "cpu" and k_cache.dtype == v_cache.dtype and readable
            and k_cache.shape == v_cache.shape and q.shape[-1] % ATTN_HEAD_DIM_MULTIPLE == 0
            and k_cache.is_contiguous() and v_cache.is_contiguous())
    return isa if fast else None


def _check_out(q: torch.Tensor, out: torch.Tensor | None) -> None:
    if out is not None and (out.dtype != torch.float32 or not out.is_contiguous() or out.shape != q.shape):
        raise ValueError(f"out must be a contiguous float32 tensor of shape {tuple(q.shape)}")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_ids: torch.Tensor, ctx_lens: torch.Tensor, scale: float,
                    out: torch.Tensor | None = None, window: int = 0,
                    k0: kv_quant.K0Correction | None = None) -> torch.Tensor:
    """q (T, H, D); k_cache, v_cache (num_blocks, block_size, kv_heads, D); block_tables (B, max_blocks)
    int32; seq_ids (T,) int32, the block table row of each query row; ctx_lens (T,) int32, the cached
    tokens row t attends (its position + 1 for causal attention; 0 gives zeros) -> (T, H, D).
    window > 0 (a sliding-window layer): row t attends only tokens ctx_lens[t] - window .. ctx_lens[t] - 1.
    k0: a centered cache's position-0 key correction (`kv_quant.KeyCenter`): the score of token 0 of each
    sequence in k0.seqs (None: every one) gets scale * q . (k0 - mu) added (the kernel: one fixed-order dot
    of the rotated q with k0.delta_rot per row and head; the reference adds k0.delta to the gathered key).

    Row t's bits equal `paged_decode_attention(q[t:t+1], k_cache, v_cache, block_tables[s:s+1],
    ctx_lens[t:t+1], scale)` with s = seq_ids[t]. `out` (contiguous float32, q's shape), if given,
    receives the result."""
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: no sliding window), got {window}")
    return _call("paged_attention", paged_attention_ref, q, k_cache, v_cache, out, scale,
                 block_tables, seq_ids, ctx_lens, window=window, k0=k0)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, H, D); k_cache, v_cache (num_blocks, block_size, kv_heads, D); block_tables (B, max_blocks)
    int32; seq_lens (B,) int32 -> (B, H, D). Sequence b attends over its first seq_lens[b] cached tokens,
    token t living in block block_tables[b, t // block_size] at slot t % block_size. A sequence of
    length 0 gives zeros. `out` (contiguous float32, q's shape), if given, receives the result. The same
    kernel as `paged_attention` with seq_ids = 0 .. B - 1 (one tile per sequence)."""
    return _call("paged_decode_attention", paged_decode_attention_ref, q, k_cache, v_cache, out, scale,
                 block_tables, seq_lens)


def _call(op: str, ref, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None,
          scale: float, *index: torch.Tensor, k0: kv_quant.K0Correction | None = None, **kw: int) -> torch.Tensor:
    """The native op `op` where it takes these inputs, else `ref`; `index` are the int32 tensors (block
    tables, then the per-row or per-sequence ids / lengths) in the op's order; `kw` the op's trailing
    int options (window); k0 the position-0 key correction (`paged_attention`)."""
    _check_out(q, out)
    fmt = kv_quant.format_of(k_cache, q.shape[-1])
    if fmt is not None and fmt.rotate and _native(q, k_cache, v_cache) is not None:
        # the kernel reads codes of rotated rows: q H . k H = q . k, and (p V H) H = p V. (The references
        # rotate the dequantized rows back themselves.)
        y = kv_quant.hadamard(_run(op, ref, kv_quant.hadamard(q), k_cache, v_cache, None, scale, *index, k0=k0,
                                   rotated=True, **kw))
        return y if out is None else out.copy_(y)
    return _run(op, ref, q, k_cache, v_cache, out, scale, *index, k0=k0, **kw)


def _run(op: str, ref, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None,
         scale: float, *index: torch.Tensor, k0: kv_quant.K0Correction | None = None, rotated: bool = False,
         **kw: int) -> torch.Tensor:
    isa = _native(q, k_cache, v_cache)
    if isa is None:
        extra = {} if k0 is None else {"k0": k0}  # (the decode-only reference takes no k0)
        y = ref(q, k_cache, v_cache, *index, scale, **kw, **extra)
        return y if out is None else out.copy_(y)
    q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    k0_args = ()
    if k0 is not None:
        seqs = None if k0.seqs is None else k0.seqs.to(torch.uint8).contiguous()
        k0_args = ((k0.delta_rot if rotated else k0.delta).contiguous(), seqs)
    getattr(native.ops(), op)(q, k_cache, v_cache, *(x.to(torch.int32).contiguous() for x in index), float(scale),
                              native.isa_id(isa), out, *kw.values(), *k0_args)
    return out
