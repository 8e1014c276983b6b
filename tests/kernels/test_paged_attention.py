"""`paged_attention`: query rows of any sequences over the paged KV cache, each row's bits those of the
one-row decode kernel with L = its ctx_len.

Paths are forced with KVLM_KERNEL_ISA (scalar, avx2, avx512, avx512-vnni; those this CPU lacks are
skipped). Bit for bit: every row of a call (rows of several sequences, causal prefill rows, a prefill
chunk after cached tokens, decode rows, empty rows, in shuffled order, at 1 and 2 threads) equals
`paged_decode_attention` of that row alone, for float32 / float16 / bfloat16 caches, GQA groups 1 to 4,
head dims 48 / 64 / 128 and block sizes that do and do not divide the 128-token chunk (1, 7, 16, 48,
one block per sequence). Within 2e-5 (absolute and relative): against `paged_attention_ref` (gather +
SDPA with a per-row key mask) and, for causal prefill, against SDPA with is_causal=True.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from deps import need_native

from kvlm.kernels import kv_quant, native, paged_attention, paged_decode_attention
from kvlm.kernels.reference import paged_attention_ref, paged_decode_attention_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {"rtol": 2e-5, "atol": 2e-5}


def _cache(gen: torch.Generator, seq_lens: list[int], heads: int, kv_heads: int, d: int, block_size: int | None,
           dtype: torch.dtype):
    """Caches holding len(seq_lens) sequences in shuffled blocks, block tables (B, max_blocks) and q's
    generator state. block_size None: the contiguous layout, one block of max(seq_lens) per sequence."""
    b = len(seq_lens)
    bs = block_size or max(seq_lens)
    max_blocks = max(1, max((n + bs - 1) // bs for n in seq_lens))
    num_blocks = b * max_blocks + 3
    k_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: b * max_blocks].reshape(b, max_blocks).to(torch.int32)
    return k_cache, v_cache, tables


SEQ_LENS = [1000, 300, 129, 40, 0]


def _mixed_rows(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_ids, ctx_lens) of a mixed step over SEQ_LENS: sequence 0 at the lengths around chunk and
    block edges plus a prefill chunk after 979 cached tokens; sequence 1's whole causal prefill (rows
    0..299); one decode row of sequence 2; random rows of sequence 3 (some of length 0); an empty row of
    the empty sequence 4. Shuffled."""
    rows = [(0, n) for n in (0, 1, 127, 128, 129, 300, 1000)] + [(0, n) for n in range(980, 1000)]
    rows += [(1, n) for n in range(1, 301)] + [(2, 129)] + [(4, 0)]
    rows += [(3, int(n)) for n in torch.randint(0, 41, (20,), generator=gen)]
    perm = torch.randperm(len(rows), generator=gen)
    rows = [rows[i] for i in perm]
    return (torch.tensor([s for s, _ in rows], dtype=torch.int32),
            torch.tensor([n for _, n in rows], dtype=torch.int32))


def _one_row_each(q, k_cache, v_cache, tables, seq_ids, ctx_lens, scale) -> torch.Tensor:
    """Each row through the one-row decode kernel alone (B = 1)."""
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        s = int(seq_ids[t])
        out[t:t + 1] = paged_decode_attention(q[t:t + 1], k_cache, v_cache, tables[s:s + 1], ctx_lens[t:t + 1], scale)
    return out


def _with_threads(n: int, f):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return f()
    finally:
        torch.set_num_threads(before)


def _assert_rows_equal(got: torch.Tensor, want: torch.Tensor, seq_ids: torch.Tensor, ctx_lens: torch.Tensor) -> None:
    same = (got == want).reshape(got.shape[0], -1).all(1)
    bad = [(int(seq_ids[t]), int(ctx_lens[t])) for t in torch.nonzero(~same).flatten()]
    assert not bad, f"{len(bad)} rows differ from the one-row kernel, (sequence, ctx_len) e.g. {bad[:5]}"


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (4, 2, 128), (8, 8, 64), (6, 2, 48)],
                         ids=["9-3-64", "4-2-128", "8-8-64", "6-2-48"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_bit_identical_to_one_row_decode(isa: str, dtype: torch.dtype, heads: int, kv_heads: int, d: int,
                                              no_fallback: None) -> None:
    """A mixed step, in two shuffled row orders, at 1 and at 2 threads: every row's bits are the one-row
    kernel's; and within tolerance of the reference."""
    gen = torch.Generator().manual_seed(31)
    kc, vc, tables = _cache(gen, SEQ_LENS, heads, kv_heads, d, 16, dtype)
    seq_ids, ctx_lens = _mixed_rows(gen)
    q = torch.randn(seq_ids.shape[0], heads, d, generator=gen)
    scale = d ** -0.5
    want = _with_threads(1, lambda: _one_row_each(q, kc, vc, tables, seq_ids, ctx_lens, scale))
    for threads, seed in ((1, 0), (2, 1)):
        perm = torch.randperm(q.shape[0], generator=torch.Generator().manual_seed(seed))
        got = torch.empty_like(q)
        got[perm] = _with_threads(threads, lambda: paged_attention(q[perm], kc, vc, tables, seq_ids[perm],
                                                                   ctx_lens[perm], scale))
        _assert_rows_equal(got, want, seq_ids, ctx_lens)
    zero = ctx_lens == 0
    assert torch.equal(got[zero], torch.zeros_like(got[zero]))
    torch.testing.assert_close(got, paged_attention_ref(q, kc, vc, tables, seq_ids, ctx_lens, scale), **TOL)


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (4, 2, 128), (8, 8, 64), (4, 1, 64)],
                         ids=["9-3-64", "4-2-128", "8-8-64", "4-1-64"])
@pytest.mark.parametrize("cache", ["float32", "float16", "int8", "int4"])
def test_fewer_items_than_threads_split_the_kv_heads(isa: str, cache: str, heads: int, kv_heads: int, d: int,
                                                     no_fallback: None) -> None:
    """A call with fewer (tile, chunk) items than threads (one or two decode rows, short or a few chunks
    long) gives each thread a share of the kv heads (kvlm/kernels/csrc/ops.cpp, kv_split; 3 kv heads in 2
    shares are 1 and 2): at 1 to 4 threads every row has the bits of that row alone on one thread."""
    gen = torch.Generator().manual_seed(heads * d + kv_heads)
    lens = [1, 40, 128, 129, 300]
    dtype = torch.float16 if cache == "float16" else torch.float32
    kc, vc, tables = _cache(gen, lens, heads, kv_heads, d, 16, dtype)
    if cache in ("int8", "int4"):
        fmt = kv_quant.FORMATS[cache]
        kc, vc = kv_quant.quantize(kc, fmt), kv_quant.quantize(vc, fmt)
    q = torch.randn(len(lens), heads, d, generator=gen)
    seq_ids = torch.arange(len(lens), dtype=torch.int32)
    ctx_lens = torch.tensor(lens, dtype=torch.int32)
    scale = d ** -0.5
    want = _with_threads(1, lambda: _one_row_each(q, kc, vc, tables, seq_ids, ctx_lens, scale))
    for rows in ([0], [1], [2], [3], [4], [1, 2], [0, 4]):
        r = torch.tensor(rows)
        for threads in (2, 3, 4):
            got = _with_threads(threads, lambda: paged_attention(q[r], kc, vc, tables, seq_ids[r], ctx_lens[r], scale))
            assert torch.equal(got, want[r]), f"rows {rows} at {threads} threads differ from one thread's"


@pytest.mark.parametrize("block_size", [1, 7, 16, 48, None], ids=["bs1", "bs7", "bs16", "bs48", "contiguous"])
def test_block_sizes(isa: str, block_size: int | None, no_fallback: None) -> None:
    """Blocks that do not divide the 16-token groups or the 128-token chunks, and one block per sequence."""
    gen = torch.Generator().manual_seed(32)
    kc, vc, tables = _cache(gen, SEQ_LENS, 9, 3, 64, block_size, torch.float32)
    seq_ids, ctx_lens = _mixed_rows(gen)
    q = torch.randn(seq_ids.shape[0], 9, 64, generator=gen)
    want = _with_threads(1, lambda: _one_row_each(q, kc, vc, tables, seq_ids, ctx_lens, 0.125))
    got = _with_threads(2, lambda: paged_attention(q, kc, vc, tables, seq_ids, ctx_lens, 0.125))
    _assert_rows_equal(got, want, seq_ids, ctx_lens)
    torch.testing.assert_close(got, paged_attention_ref(q, kc, vc, tables, seq_ids, ctx_lens, 0.125), **TOL)


@pytest.mark.parametrize("n", [1, 16, 17, 300])
def test_causal_prefill_matches_sdpa(isa: str, n: int, no_fallback: None) -> None:
    """Rows 0..n-1 of one sequence with ctx_lens 1..n: causal self-attention, as SDPA is_causal=True
    computes it on the gathered K/V."""
    gen = torch.Generator().manual_seed(33)
    heads, kv_heads, d = 9, 3, 64
    kc, vc, tables = _cache(gen, [n], heads, kv_heads, d, 16, torch.float32)
    q = torch.randn(n, heads, d, generator=gen)
    got = paged_attention(q, kc, vc, tables, torch.zeros(n, dtype=torch.int32),
                          torch.arange(1, n + 1, dtype=torch.int32), 0.125)
    blocks = tables[0].long()
    k = kc[blocks].reshape(-1, kv_heads, d)[:n].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    v = vc[blocks].reshape(-1, kv_heads, d)[:n].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True, scale=0.125).transpose(0, 1)
    torch.testing.assert_close(got, want, **TOL)


def test_decode_is_the_one_row_per_sequence_case(isa: str, no_fallback: None) -> None:
    gen = torch.Generator().manual_seed(34)
    lens = torch.tensor([0, 1, 700, 16, 17, 128, 129, 1000], dtype=torch.int32)
    kc, vc, tables = _cache(gen, lens.tolist(), 9, 3, 64, 16, torch.float16)
    q = torch.randn(8, 9, 64, generator=gen)
    want = paged_decode_attention(q, kc, vc, tables, lens, 0.125)
    got = paged_attention(q, kc, vc, tables, torch.arange(8, dtype=torch.int32), lens, 0.125)
    assert torch.equal(got, want)


def test_many_partial_states_run_in_waves(isa: str, no_fallback: None) -> None:
    """A prefill whose partial softmax states exceed the driver's cap (ops.cpp, ATTN_PART_CAP) runs in
    waves of tiles over one buffer; rows keep their bits (checked against the batched one-row kernel,
    one "sequence" per row, which equals each row alone: test_kernels.py)."""
    if isa in ("scalar", "avx2"):
        pytest.skip("a large case: the AVX-512 paths run it in a second, the others alike in arithmetic")
    gen = torch.Generator().manual_seed(35)
    n, heads, kv_heads, d = 1024, 16, 4, 128  # 1024 rows x ~4.5 chunks x 16 x 130 floats: about 1.2x the cap
    kc, vc, tables = _cache(gen, [n], heads, kv_heads, d, 16, torch.bfloat16)
    q = torch.randn(n, heads, d, generator=gen)
    ctx_lens = torch.arange(1, n + 1, dtype=torch.int32)
    got = _with_threads(2, lambda: paged_attention(q, kc, vc, tables, torch.zeros(n, dtype=torch.int32), ctx_lens,
                                                   d ** -0.5))
    want = paged_decode_attention(q, kc, vc, tables.expand(n, -1).contiguous(), ctx_lens, d ** -0.5)
    _assert_rows_equal(got, want, torch.zeros(n, dtype=torch.int32), ctx_lens)


def test_large_scores(isa: str, no_fallback: None) -> None:
    """Scores far apart (per-chunk max, exp underflow to 0, the combine's rescaling) keep the bits."""
    gen = torch.Generator().manual_seed(36)
    kc, vc, tables = _cache(gen, [300, 70], 6, 2, 32, 8, torch.float32)
    seq_ids = torch.tensor([0] * 40 + [1] * 30, dtype=torch.int32)
    ctx_lens = torch.cat([torch.arange(261, 301), torch.arange(41, 71)]).to(torch.int32)
    q = torch.randn(70, 6, 32, generator=gen) * 30
    got = paged_attention(q, kc, vc, tables, seq_ids, ctx_lens, 1.0)
    _assert_rows_equal(got, _one_row_each(q, kc, vc, tables, seq_ids, ctx_lens, 1.0), seq_ids, ctx_lens)
    # Scores of a few hundred carry float32 rounding of ~|s| * 2^-24 each, which exp turns into relative
    # errors of p: kernel and reference alike are ~1e-4 off the exact result here.
    torch.testing.assert_close(got, paged_attention_ref(q, kc, vc, tables, seq_ids, ctx_lens, 1.0), rtol=0, atol=3e-4)


def test_out_buffer_and_empty_call(isa: str) -> None:
    gen = torch.Generator().manual_seed(37)
    kc, vc, tables = _cache(gen, [50, 20], 4, 2, 64, 16, torch.float32)
    seq_ids = torch.tensor([1, 0, 0], dtype=torch.int32)
    ctx_lens = torch.tensor([20, 49, 50], dtype=torch.int32)
    q = torch.randn(3, 4, 64, generator=gen)
    o = torch.full_like(q, float("nan"))
    assert paged_attention(q, kc, vc, tables, seq_ids, ctx_lens, 0.125, out=o) is o
    assert torch.equal(o, paged_attention(q, kc, vc, tables, seq_ids, ctx_lens, 0.125))
    with pytest.raises(ValueError, match="out must be"):
        paged_attention(q, kc, vc, tables, seq_ids, ctx_lens, 0.125, out=torch.empty(3, 4, 32))
    empty = paged_attention(q[:0], kc, vc, tables, seq_ids[:0], ctx_lens[:0], 0.125)
    assert empty.shape == (0, 4, 64)


def test_rejects_bad_rows(isa: str) -> None:
    gen = torch.Generator().manual_seed(38)
    kc, vc, tables = _cache(gen, [20, 40], 4, 2, 64, 16, torch.float32)
    q = torch.randn(2, 4, 64, generator=gen)
    ok_ids, ok_lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([20, 40], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="outside block_tables"):
        paged_attention(q, kc, vc, tables, torch.tensor([0, 2], dtype=torch.int32), ok_lens, 0.125)
    with pytest.raises(RuntimeError, match="exceed its block table"):
        paged_attention(q, kc, vc, tables, ok_ids, torch.tensor([20, 10_000], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="negative"):
        paged_attention(q, kc, vc, tables, ok_ids, torch.tensor([-1, 40], dtype=torch.int32), 0.125)
    bad = tables.clone()
    bad[1, 2] = kc.shape[0]  # past the cache
    with pytest.raises(RuntimeError, match="outside the cache"):
        paged_attention(q, kc, vc, bad, ok_ids, ok_lens, 0.125)


def test_reference_path(force_isa) -> None:
    """Forced to the reference (as without the native build), and for inputs the kernel does not take
    (head dim not a multiple of 16): paged_attention_ref, which agrees with the one-row reference."""
    gen = torch.Generator().manual_seed(39)
    force_isa("reference")
    kc, vc, tables = _cache(gen, SEQ_LENS, 9, 3, 64, 16, torch.bfloat16)
    seq_ids, ctx_lens = _mixed_rows(gen)
    q = torch.randn(seq_ids.shape[0], 9, 64, generator=gen)
    got = paged_attention(q, kc, vc, tables, seq_ids, ctx_lens, 0.125)
    assert torch.equal(got, paged_attention_ref(q, kc, vc, tables, seq_ids, ctx_lens, 0.125))
    per_row = paged_decode_attention_ref(q, kc, vc, tables[seq_ids.long()], ctx_lens, 0.125)
    torch.testing.assert_close(got, per_row, **TOL)
    force_isa(native.best_isa())
    kc, vc, tables = _cache(gen, [30], 4, 2, 24, 16, torch.float32)
    q = torch.randn(5, 4, 24, generator=gen)
    ids, lens = torch.zeros(5, dtype=torch.int32), torch.tensor([0, 1, 9, 29, 30], dtype=torch.int32)
    got = paged_attention(q, kc, vc, tables, ids, lens, 0.2)
    assert torch.equal(got, paged_attention_ref(q, kc, vc, tables, ids, lens, 0.2))
    assert torch.equal(got[0], torch.zeros_like(got[0]))


VECTOR_ISAS = [i for i in native.ISAS if i != "scalar"]  # the x86 scalar unit has no FMA: bits of its own


@pytest.mark.parametrize("cache", ["float32", "float16", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (4, 2, 128), (6, 2, 48)],
                         ids=["9-3-64", "4-2-128", "6-2-48"])
def test_same_bits_on_every_vector_isa(force_isa, cache: str, heads: int, kv_heads: int, d: int,
                                       no_fallback: None) -> None:
    """Every vector ISA path this CPU has (AVX2, AVX-512, AVX-512 VNNI; the NEON ones on ARM) gives the same
    bits for a mixed step: the same products in the same order, and one tree for the 16 lanes of a score on
    each (AVX2 works in 8-lane halves, AVX-512 tokens-on-lanes for many pairs). A model's outputs then do
    not depend on which of these machines runs it. (The x86 scalar unit has no FMA: its own bits.)"""
    need_native("each ISA path is forced in turn")
    have = [i for i in VECTOR_ISAS if native.isa_available(i)]
    if len(have) < 2:
        pytest.skip(f"one vector ISA path here ({have}): nothing to compare")
    gen = torch.Generator().manual_seed(41)
    if cache in ("int8", "int4"):
        if d % 32:
            pytest.skip("quantized K/V rows are groups of 32 values")
        fmt = kv_quant.FORMATS[cache]
        kc, vc, tables = _cache(gen, SEQ_LENS, heads, kv_heads, d, 16, torch.float32)
        kc, vc = kv_quant.quantize(kc * 2, fmt), kv_quant.quantize(vc, fmt)
    else:
        kc, vc, tables = _cache(gen, SEQ_LENS, heads, kv_heads, d, 16, getattr(torch, cache))
    seq_ids, ctx_lens = _mixed_rows(gen)
    q = torch.randn(seq_ids.shape[0], heads, d, generator=gen)
    outs = {}
    for isa in have:
        force_isa(isa)
        outs[isa] = _with_threads(2, lambda: paged_attention(q, kc, vc, tables, seq_ids, ctx_lens, d ** -0.5))
    for isa in have[1:]:
        _assert_rows_equal(outs[isa], outs[have[0]], seq_ids, ctx_lens)
