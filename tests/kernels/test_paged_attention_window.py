"""Sliding-window rows of `paged_attention` (window > 0): row t attends only its last `window` tokens.

Bit for bit, every row of a mixed call (rows of several sequences, causal prefill rows, decode rows,
rows whose window starts inside a chunk, on a chunk edge, or covers the whole context, in shuffled
order, at 1 and 2 threads) equals that row alone; within 2e-5 of the reference (gather + SDPA with the
windowed key mask), which is itself checked against a plain SDPA over the window's keys; window 0 is
the full computation, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_paged_attention import _assert_rows_equal, _cache, _with_threads

from kvlm.kernels import paged_attention
from kvlm.kernels.reference import paged_attention_ref

TOL = {"rtol": 2e-5, "atol": 2e-5}
SEQ_LENS = [1000, 300, 129, 40]


def _rows(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [(0, n) for n in (1, 100, 127, 128, 129, 255, 256, 257, 600, 1000)] + [(0, n) for n in range(900, 1000)]
    rows += [(1, n) for n in range(1, 301)] + [(2, 129)]
    rows += [(3, int(n)) for n in torch.randint(0, 41, (8,), generator=gen)]
    perm = torch.randperm(len(rows), generator=gen)
    rows = [rows[i] for i in perm]
    return (torch.tensor([s for s, _ in rows], dtype=torch.int32),
            torch.tensor([n for _, n in rows], dtype=torch.int32))


def _alone(q, kc, vc, tables, seq_ids, ctx_lens, scale, window) -> torch.Tensor:
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        s = int(seq_ids[t])
        out[t:t + 1] = paged_attention(q[t:t + 1], kc, vc, tables[s:s + 1], torch.zeros(1, dtype=torch.int32),
                                       ctx_lens[t:t + 1], scale, window=window)
    return out


@pytest.mark.parametrize("window", [1, 100, 128, 200, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_window_rows_bit_identical_alone(isa: str, dtype: torch.dtype, window: int, no_fallback: None) -> None:
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, d = 4, 1, 256 if window == 512 else 64
    kc, vc, tables = _cache(gen, SEQ_LENS, heads, kv_heads, d, 16, dtype)
    seq_ids, ctx_lens = _rows(gen)
    q = torch.randn(seq_ids.shape[0], heads, d, generator=gen)
    scale = d ** -0.5
    want = _with_threads(1, lambda: _alone(q, kc, vc, tables, seq_ids, ctx_lens, scale, window))
    for threads, seed in ((1, 0), (2, 1)):
        perm = torch.randperm(q.shape[0], generator=torch.Generator().manual_seed(seed))
        got = torch.empty_like(q)
        got[perm] = _with_threads(threads, lambda: paged_attention(q[perm], kc, vc, tables, seq_ids[perm],
                                                                   ctx_lens[perm], scale, window=window))
        _assert_rows_equal(got, want, seq_ids, ctx_lens)
    ref = paged_attention_ref(q, kc, vc, tables, seq_ids, ctx_lens, scale, window=window)
    torch.testing.assert_close(got, ref, **TOL)


def test_reference_window_is_sdpa_over_the_window() -> None:
    gen = torch.Generator().manual_seed(3)
    kc, vc, tables = _cache(gen, [300], 2, 1, 32, 16, torch.float32)
    q = torch.randn(3, 2, 32, generator=gen)
    lens = torch.tensor([300, 50, 1], dtype=torch.int32)
    got = paged_attention_ref(q, kc, vc, tables, torch.zeros(3, dtype=torch.int32), lens, 0.2, window=64)
    k = kc[tables[0].long()].reshape(-1, 1, 32)[:300, 0]
    v = vc[tables[0].long()].reshape(-1, 1, 32)[:300, 0]
    for t, n in enumerate(lens.tolist()):
        lo = max(0, n - 64)
        want = F.scaled_dot_product_attention(q[t][:, None], k[lo:n][None].expand(2, -1, -1),
                                              v[lo:n][None].expand(2, -1, -1), scale=0.2)[:, 0]
        torch.testing.assert_close(got[t], want, **TOL)


def test_window_covering_the_context_is_full_attention(isa: str, no_fallback: None) -> None:
    gen = torch.Generator().manual_seed(5)
    kc, vc, tables = _cache(gen, SEQ_LENS, 4, 2, 64, 16, torch.float32)
    seq_ids, ctx_lens = _rows(gen)
    q = torch.randn(seq_ids.shape[0], 4, 64, generator=gen)
    full = paged_attention(q, kc, vc, tables, seq_ids, ctx_lens, 0.125)
    assert torch.equal(paged_attention(q, kc, vc, tables, seq_ids, ctx_lens, 0.125, window=1000), full)
    with pytest.raises(ValueError, match="window"):
        paged_attention(q, kc, vc, tables, seq_ids, ctx_lens, 0.125, window=-1)
