"""The int8 / int4 K/V formats (`kernels/kv_quant.py`) and the attention kernel reading their codes in place.

* Round trip within each format's documented bound: random rows at several scales, all-zero groups,
  negative zeros, max-magnitude groups (the largest the float16 scale represents), a lone spike.
* One group of each format decoded by hand from its documented byte layout (struct, not the module).
* Native kernel, each ISA path this CPU has: attention over a quantized cache is bit-identical to the
  same kernel over a float32 cache holding the dequantized values, with q rotated and the result rotated
  back (dequantization happens per 16 values inside the loop, one float32 multiply, the reference's),
  and within float tolerance of the reference (which dequantizes, then SDPA); a row's bits do not
  depend on the other rows of the call. The native quantizer and Hadamard rotation equal the references'
  bits.
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
import torch
from deps import need_native

from kvlm.kernels import kv_quant, paged_attention
from kvlm.kernels.kv_quant import FORMATS, INT4, INT8, dequantize, error_bound, format_of, quantize
from kvlm.kernels.reference import paged_attention_ref

FMTS = list(FORMATS.values())
# The group codec alone (no rotation): only the reference quantizer takes these.
PLAIN = [dataclasses.replace(f, name=f"{f.name}-plain", rotate=False) for f in FMTS]


def _round_trip(x: torch.Tensor, fmt: kv_quant.KVQuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(the values the codes stand for: x, or x H for a rotating format; what they decode to)."""
    raw = quantize(x, fmt) if fmt.rotate else kv_quant.quantize_ref(x, fmt)
    assert raw.dtype == torch.uint8 and raw.shape == (*x.shape[:-1], fmt.row_bytes(x.shape[-1]))
    return (kv_quant.hadamard_ref(x) if fmt.rotate else x), dequantize(raw, fmt, x.shape[-1])


@pytest.mark.parametrize("fmt", FMTS + PLAIN, ids=str)
@pytest.mark.parametrize("scale", [1e-6, 1e-3, 1.0, 30.0, 1e3])
def test_round_trip_within_the_documented_bound(fmt: kv_quant.KVQuantFormat, scale: float) -> None:
    x = torch.randn(64, 4, 128, generator=torch.Generator().manual_seed(0)) * scale
    x[3, 1, 40] *= 50  # a spike: its group's step grows, the others' do not
    want, got = _round_trip(x, fmt)
    assert ((want - got).abs() <= error_bound(x, fmt)).all()
    if fmt.rotate:  # back in the model's basis: within the bound's norm (H is orthonormal), to rounding
        back = kv_quant.unrotated(got, fmt)
        err = (back - x).reshape(64, 4, -1, 64).norm(dim=-1)
        assert (err <= error_bound(x, fmt).reshape(64, 4, -1, 64).norm(dim=-1) * 1.001 + 1e-6).all()


@pytest.mark.parametrize("fmt", FMTS)
def test_rotated_zero_rows_decode_to_positive_zero(fmt: kv_quant.KVQuantFormat) -> None:
    x = torch.zeros(3, 64)
    x[1] = -0.0
    x[2, ::2] = -0.0
    _, got = _round_trip(x, fmt)
    assert torch.equal(got, torch.zeros(3, 64)) and not torch.signbit(got).any()


@pytest.mark.parametrize("fmt", PLAIN, ids=str)
def test_zero_negative_zero_and_max_magnitude_groups(fmt: kv_quant.KVQuantFormat) -> None:
    x = torch.zeros(4, 64)
    x[1] = -0.0
    top = kv_quant.F16_MAX * 127  # the largest magnitude the scale represents (int4's extreme level is -127 too)
    x[2, :32] = torch.linspace(-top, top, 32)
    x[2, 32:] = -top
    x[3, :32] = torch.tensor([-0.0, 0.0] * 16)
    x[3, 32:] = exact = -127 * 0.25  # scale 0.25 exactly: decodes exactly
    _, y = _round_trip(x, fmt)
    assert torch.equal(y[0], torch.zeros(64)) and not torch.signbit(y[:2]).any()  # zeros decode to +0.0
    assert torch.equal(y[3, :32], torch.zeros(32)) and not torch.signbit(y[3, :32]).any()
    assert torch.isfinite(y).all() and ((x - y).abs() <= error_bound(x, fmt)).all()
    assert y[2, 32:].eq(-top).all()  # the extreme itself is exact (int4: it is level 0, -127)
    assert y[3, 32:].eq(exact).all()


def test_hand_decoded_groups() -> None:
    """Decode one group of each format from the layout the module documents, with struct and numpy: the
    codes hold the rotated row x H (the Hadamard butterflies, written out here with a matrix)."""
    x = torch.arange(-16, 16, dtype=torch.float32).reshape(1, 32) * 0.37
    x[0, 5] = 9.0  # an outlier: rotation spreads it over the block
    h = np.array([[1.0]])
    while h.shape[0] < 32:
        h = np.block([[h, h], [h, -h]])
    xr = (x.numpy().astype(np.float64) @ (h / np.sqrt(32)))[0]  # x H, in float64
    raw8 = bytes(quantize(x, INT8).numpy().tobytes())
    assert len(raw8) == 34
    d = np.float32(struct.unpack("<e", raw8[:2])[0])
    rot = kv_quant.hadamard_ref(x).numpy()[0]  # float32 x H, what was quantized
    assert np.allclose(rot, xr, atol=1e-5)
    assert d == np.float32(np.float16(np.abs(rot).max() / np.float32(127)))  # amax / 127 as float16
    codes = np.array(struct.unpack("<32b", raw8[2:]), np.float32)
    assert np.array_equal(codes, np.clip(np.round(rot * (np.float32(1) / d)), -127, 127))
    assert np.array_equal(dequantize(quantize(x, INT8), INT8, 32).numpy()[0], codes * d)
    assert np.abs(codes * d - xr).max() <= d / 2 + 1e-5

    raw4 = bytes(quantize(x, INT4).numpy().tobytes())
    assert len(raw4) == 18
    d4 = np.float32(struct.unpack("<e", raw4[:2])[0])
    nib = np.array([raw4[2 + (i % 16)] >> (4 * (i // 16)) & 15 for i in range(32)])  # byte j: j low, j + 16 high
    levels = np.array([-127, -102, -82, -66, -51, -38, -25, -12, 0, 13, 25, 39, 53, 69, 87, 111], np.float32)
    assert tuple(levels) == kv_quant.Q4_LEVELS  # the documented table
    want4 = levels[nib] * d4
    assert np.array_equal(dequantize(quantize(x, INT4), INT4, 32).numpy()[0], want4)
    # the scale search as documented: the plain rule (d = m / -127), then m / (-127 t / 8) for t = 7.5, 8,
    # 8.5 with the scale refitted by least squares; each value takes its nearest level (a tie: the lower);
    # the smallest squared error wins (float64 sums in halves)
    def tree(e: np.ndarray) -> np.float64:
        e = e.astype(np.float64)
        while len(e) > 1:
            e = e[: len(e) // 2] + e[len(e) // 2 :]
        return e[0]

    def f16(d: np.float32) -> np.float32:
        return np.float32(np.float16(np.clip(d, -65504, 65504)))

    m = rot[np.argmax(np.abs(rot))]  # the signed value of largest magnitude
    cands = []
    mids = (levels[1:] + levels[:-1]) / 2
    for k, t in enumerate((8.0, 7.5, 8.0, 8.5)):
        d = f16(m / np.float32(-127 * t / 8))
        y = rot * (np.float32(1) / d)
        c = (mids[None, :] < y[:, None]).sum(1)  # codes: how many midpoints lie below
        lv = levels[c]
        if k:
            d = f16(np.float32(tree(rot.astype(np.float64) * lv) / tree(lv.astype(np.float64) ** 2)))
        cands.append((tree((rot - lv * d).astype(np.float64) ** 2), d, c))
    err, d_best, c_best = min(cands, key=lambda e: e[0])  # min keeps the first of equal errors
    assert d4 == d_best and np.array_equal(nib, c_best)
    assert err <= cands[0][0] and cands[0][1] == np.float32(np.float16(m / np.float32(-127)))
    assert cands[0][2][np.argmax(np.abs(rot))] == 0  # the plain rule maps m to code 0 (level -127)
    d0 = abs(cands[0][1])
    assert np.abs(want4 - xr).max() <= np.sqrt(32) * d0 * kv_quant.Q4_HALF_GAP + 1e-5  # the documented bound
    # and back in the model's basis: H is orthonormal, so the group's error norm is kept
    back = kv_quant.unrotated(torch.from_numpy(want4), INT4).numpy()
    assert np.linalg.norm(back - x.numpy()[0]) <= np.sqrt(err) * 1.001 + 1e-5


def test_format_of_and_sizes() -> None:
    assert (INT8.row_bytes(64), INT4.row_bytes(64)) == (68, 36)
    assert format_of(torch.empty(2, 16, 3, 68, dtype=torch.uint8), 64) is INT8
    assert format_of(torch.empty(2, 16, 3, 36, dtype=torch.uint8), 64) is INT4
    assert format_of(torch.empty(2, 16, 3, 64), 64) is None
    with pytest.raises(ValueError, match="head_dim"):
        INT8.row_bytes(48)


def _quant_cache(gen: torch.Generator, nb: int, bs: int, kvh: int, d: int, fmt: kv_quant.KVQuantFormat):
    k = torch.randn(nb, bs, kvh, d, generator=gen) * 2
    v = torch.randn(nb, bs, kvh, d, generator=gen)
    return quantize(k, fmt), quantize(v, fmt)


def _attention_case(gen: torch.Generator, fmt: kv_quant.KVQuantFormat, heads: int, kvh: int, d: int, bs: int):
    """A quantized cache of 4 sequences (1, 17, 130, 300 tokens) in shuffled blocks, and query rows: causal
    prefill rows of sequence 2 and decode rows of the others, in shuffled order. Returns (q, kq, vq,
    tables, seq_ids, ctx_lens)."""
    lens = [1, 17, 130, 300]
    mb = max(-(-n // bs) for n in lens)
    nb = len(lens) * mb + 2
    kq, vq = _quant_cache(gen, nb, bs, kvh, d, fmt)
    tables = torch.randperm(nb, generator=gen)[: len(lens) * mb].reshape(len(lens), mb).to(torch.int32)
    seq = [0, 1, 3] + [2] * 130
    ctx = [lens[0], lens[1], lens[3]] + list(range(1, 131))
    perm = torch.randperm(len(seq), generator=gen)
    seq_ids = torch.tensor(seq, dtype=torch.int32)[perm]
    ctx_lens = torch.tensor(ctx, dtype=torch.int32)[perm]
    q = torch.randn(len(seq), heads, d, generator=gen)
    return q, kq, vq, tables, seq_ids, ctx_lens


@pytest.mark.parametrize("fmt", FMTS, ids=str)
@pytest.mark.parametrize(("heads", "kvh", "d", "bs"), [(9, 3, 64, 16), (4, 2, 128, 7), (6, 6, 32, 48)])
def test_kernel_reads_codes_as_the_float_kernel_reads_their_values(
        isa: str, fmt: kv_quant.KVQuantFormat, heads: int, kvh: int, d: int, bs: int) -> None:
    gen = torch.Generator().manual_seed(heads * d + bs)
    q, kq, vq, tables, seq_ids, ctx_lens = _attention_case(gen, fmt, heads, kvh, d, bs)
    seq = seq_ids.tolist()
    scale = d**-0.5
    got = paged_attention(q, kq, vq, tables, seq_ids, ctx_lens, scale)
    kf, vf = dequantize(kq, fmt, d).contiguous(), dequantize(vq, fmt, d).contiguous()  # rotated rows' values
    rot = kv_quant.hadamard
    assert torch.equal(got, rot(paged_attention(rot(q), kf, vf, tables, seq_ids, ctx_lens, scale)))
    torch.testing.assert_close(got, paged_attention_ref(q, kq, vq, tables, seq_ids, ctx_lens, scale),
                               rtol=2e-5, atol=2e-5)
    for t in (0, 5, len(seq) - 1):  # a row alone: the same bits
        alone = paged_attention(q[t : t + 1], kq, vq, tables, seq_ids[t : t + 1], ctx_lens[t : t + 1], scale)
        assert torch.equal(alone, got[t : t + 1])


@pytest.mark.parametrize("fmt", FMTS, ids=str)
def test_kernel_adds_the_position0_key_correction(isa: str, fmt: kv_quant.KVQuantFormat) -> None:
    """A cache centered by a KeyCenter with k0 stores its position-0 keys as codes of k - k0: with the
    K0Correction every row reads that key as (k - k0) + (k0 - mu), i.e. as every other key, k - mu (to
    float32 rounding, against the float kernel over the keys so corrected and the reference), for the
    sequences k0.seqs names only, a row's bits alone as in the call; without it the output is not that."""
    kvh, d = 3, 64
    gen = torch.Generator().manual_seed(7)
    q, kq, vq, tables, seq_ids, ctx_lens = _attention_case(gen, fmt, 9, kvh, d, 16)
    seq = seq_ids.tolist()
    scale = d**-0.5
    delta = torch.randn(kvh, d, generator=gen) * 3  # k0 - mu
    center = kv_quant.KeyCenter(torch.zeros(1, kvh, d), delta[None])
    seqs = torch.tensor([1, 0, 1, 1], dtype=torch.uint8)  # sequence 1's token 0 is not its position 0
    k0 = kv_quant.K0Correction.of(center, 0, seqs)
    got = paged_attention(q, kq, vq, tables, seq_ids, ctx_lens, scale, k0=k0)
    kf = kv_quant.unrotated(dequantize(kq, fmt, d), fmt)  # the model's basis
    vf = kv_quant.unrotated(dequantize(vq, fmt, d), fmt)
    for s in (0, 2, 3):
        kf[tables[s, 0], 0] += delta  # token 0 of each corrected sequence
    want = paged_attention(q, kf.contiguous(), vf.contiguous(), tables, seq_ids, ctx_lens, scale)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got, paged_attention_ref(q, kq, vq, tables, seq_ids, ctx_lens, scale, k0=k0),
                               rtol=2e-5, atol=2e-5)
    plain = paged_attention(q, kq, vq, tables, seq_ids, ctx_lens, scale)
    one, others = seq_ids == 1, seq_ids != 1
    assert torch.equal(got[one], plain[one])  # sequence 1: not corrected, the same bits
    assert (got[others] - plain[others]).abs().max() > 1e-2  # the others: corrected
    for t in (0, 5, len(seq) - 1):  # a row alone: the same bits
        alone = paged_attention(q[t : t + 1], kq, vq, tables, seq_ids[t : t + 1], ctx_lens[t : t + 1], scale, k0=k0)
        assert torch.equal(alone, got[t : t + 1])


@pytest.mark.parametrize("fmt", FMTS, ids=str)
def test_native_quantizer_equals_the_reference(fmt: kv_quant.KVQuantFormat) -> None:
    need_native("the native quantizer is what is compared")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 3, 64, generator=gen) * torch.logspace(-7, 5, 40)[:, None, None]
    x[0] = 0.0
    x[1] = -0.0
    x[2, 0, :32] = 2.5  # ties: x * inv lands on .5 for some codes
    x[2, 1, :32] = torch.arange(32) * 0.5 - 8
    x[3, :, ::2] = kv_quant.F16_MAX * 200  # saturated scales
    x[4, 0, :32] = torch.tensor([-1.0, 1.0] * 16)  # a tie of signed extremes (int4 takes the positive one)
    got = quantize(x, fmt)
    assert torch.equal(got, kv_quant.quantize_ref(x, fmt))
    for seed in range(4):  # K-like rows: a few outlier channels, heavy tails (int4's search picks all candidates)
        g = torch.Generator().manual_seed(10 + seed)
        outliers = torch.randn(128, generator=g) * 4 * (torch.rand(128, generator=g) < 0.05)
        y = torch.randn(64, 3, 128, generator=g) ** 3 + outliers
        assert torch.equal(quantize(y, fmt), kv_quant.quantize_ref(y, fmt))
    for d in (32, 64, 96, 128):
        y = torch.randn(7, 3, d, generator=gen) * 3
        assert torch.equal(kv_quant.hadamard(y), kv_quant.hadamard_ref(y))
        assert torch.allclose(kv_quant.hadamard(kv_quant.hadamard(y)), y, atol=1e-5)  # H H = I
