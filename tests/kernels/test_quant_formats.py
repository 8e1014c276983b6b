"""GGUF tensor formats checked against values computed independently of the `gguf` package's dequantizer
(which kvlm's loader calls):

* hand-decoding: the first block of every quantized tensor of a file, decoded here from ggml's documented
  block layouts (ggml-quants.c `dequantize_row_*`), equals what kvlm loaded;
* quantization error: for the formats `gguf.quants.quantize` can write, the loaded weights are within
  each format's error bound of the original floats (per 32-value block).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from quantize import KQUANT_F16_FIELDS, can_quantize, synthetic_quantize
from tiny_models import random_state_dict, tiny_config, write_tiny_gguf

from kvlm.loader import load_checkpoint
from kvlm.loader.gguf import SUPPORTED_TENSOR_TYPES, gguf_to_hf_name

F32 = np.float32


def f16(b: bytes, off: int) -> F32:
    return F32(np.frombuffer(b[off:off + 2], np.float16)[0])


def scale_min_k4(j: int, q: bytes) -> tuple[int, int]:
    """The 6-bit scale and min of sub-block j in a Q4_K / Q5_K block's 12 packed bytes."""
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def decode_block(fmt: str, b: bytes) -> np.ndarray:
    """One block of `fmt` (raw bytes) -> its float32 values, from ggml's layouts."""
    y: list[F32] = []
    b = b[:gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt]][1] * (32 if fmt in ("F32", "F16", "BF16") else 1)]
    if fmt == "F32":
        return np.frombuffer(b[:128], np.float32)
    if fmt == "F16":
        return np.frombuffer(b[:64], np.float16).astype(F32)
    if fmt == "BF16":
        return (np.frombuffer(b[:64], np.uint16).astype(np.uint32) << 16).view(F32)
    if fmt == "Q8_0":  # d f16, 32 x int8
        return f16(b, 0) * np.frombuffer(b[2:34], np.int8).astype(F32)
    if fmt in ("Q4_0", "Q4_1"):  # d [, m] f16, 16 bytes: low nibbles are values 0-15, high nibbles 16-31
        d, m, qs = f16(b, 0), (f16(b, 2) if fmt == "Q4_1" else None), b[-16:]
        lo, hi = [q & 0xF for q in qs], [q >> 4 for q in qs]
        return np.array([(x - 8) * d if m is None else x * d + m for x in lo + hi], F32)
    if fmt in ("Q5_0", "Q5_1"):  # d [, m] f16, qh u32 (5th bits), 16 bytes of nibbles
        d = f16(b, 0)
        m = f16(b, 2) if fmt == "Q5_1" else None
        qh = struct.unpack_from("<I", b, 4 if m is not None else 2)[0]
        qs = b[-16:]
        lo = [(qs[j] & 0xF) | (((qh >> j) & 1) << 4) for j in range(16)]
        hi = [(qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4) for j in range(16)]
        return np.array([(x - 16) * d if m is None else x * d + m for x in lo + hi], F32)
    if fmt == "Q2_K":  # scales[16], qs[64], d, dmin
        scales, qs, d, dmin = b[0:16], b[16:80], f16(b, 80), f16(b, 82)
        i = 0
        for half in (0, 32):
            for shift in (0, 2, 4, 6):
                for part in (0, 16):
                    sc = scales[i]
                    i += 1
                    dl, ml = d * F32(sc & 0xF), dmin * F32(sc >> 4)
                    y += [dl * F32((qs[half + part + lane] >> shift) & 3) - ml for lane in range(16)]
    elif fmt == "Q3_K":  # hmask[32], qs[64], scales[12] (6-bit, packed), d
        hm, qs, d = b[0:32], b[32:96], f16(b, 108)
        a0, a1, a2 = struct.unpack_from("<3I", b, 96)
        k1, k2 = 0x03030303, 0x0F0F0F0F
        packed = [(a0 & k2) | ((a2 & k1) << 4), (a1 & k2) | (((a2 >> 2) & k1) << 4),
                  ((a0 >> 4) & k2) | (((a2 >> 4) & k1) << 4), ((a1 >> 4) & k2) | (((a2 >> 6) & k1) << 4)]
        scales = np.frombuffer(struct.pack("<4I", *packed), np.int8)
        i, bit = 0, 1
        for half in (0, 32):
            for shift in (0, 2, 4, 6):
                for part in (0, 16):
                    dl = d * F32(int(scales[i]) - 32)
                    i += 1
                    y += [dl * F32(((qs[half + part + lane] >> shift) & 3) - (0 if hm[part + lane] & bit else 4))
                          for lane in range(16)]
                bit <<= 1
    elif fmt in ("Q4_K", "Q5_K"):  # d, dmin, scales[12], [qh[32],] qs[128]
        d, dmin, scales = f16(b, 0), f16(b, 2), b[4:16]
        qh, qs = (b[16:48], b[48:176]) if fmt == "Q5_K" else (None, b[16:144])
        for j in range(4):
            (s1, m1), (s2, m2) = scale_min_k4(2 * j, scales), scale_min_k4(2 * j + 1, scales)
            q = qs[32 * j:32 * j + 32]
            h1 = [16 if qh and qh[lane] & (1 << 2 * j) else 0 for lane in range(32)]
            h2 = [16 if qh and qh[lane] & (2 << 2 * j) else 0 for lane in range(32)]
            y += [d * F32(s1) * F32((q[lane] & 0xF) + h1[lane]) - dmin * F32(m1) for lane in range(32)]
            y += [d * F32(s2) * F32((q[lane] >> 4) + h2[lane]) - dmin * F32(m2) for lane in range(32)]
    elif fmt == "Q6_K":  # ql[128], qh[64], scales[16] int8, d
        ql, qh, sc, d = b[0:128], b[128:192], np.frombuffer(b[192:208], np.int8), f16(b, 208)
        out = np.zeros(256, F32)
        for n in (0, 1):
            L, H, S = ql[64 * n:], qh[32 * n:], sc[8 * n:]
            for lane in range(32):
                s = lane // 16
                q1 = ((L[lane] & 0xF) | ((H[lane] & 3) << 4)) - 32
                q2 = ((L[lane + 32] & 0xF) | (((H[lane] >> 2) & 3) << 4)) - 32
                q3 = ((L[lane] >> 4) | (((H[lane] >> 4) & 3) << 4)) - 32
                q4 = ((L[lane + 32] >> 4) | (((H[lane] >> 6) & 3) << 4)) - 32
                for k, q in enumerate((q1, q2, q3, q4)):
                    out[128 * n + lane + 32 * k] = d * F32(S[s + 2 * k]) * F32(q)
        return out
    else:
        raise AssertionError(f"no hand decoder for {fmt}")
    return np.array(y, F32)


def test_every_supported_format_has_a_hand_decoder() -> None:
    for fmt in SUPPORTED_TENSOR_TYPES:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt]]
        assert decode_block(fmt, bytes(max(size, 128))).shape[0] in (block, 32)


@pytest.fixture(scope="module")
def model_256() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    cfg = tiny_config("llama", hidden_size=256, intermediate_size=512, head_dim=64, tie_word_embeddings=False)
    return cfg, random_state_dict(cfg, seed=5)


@pytest.mark.parametrize("fmt", sorted(SUPPORTED_TENSOR_TYPES))
def test_first_block_of_each_tensor_hand_decoded(fmt: str, model_256, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """What kvlm loads starts with the values ggml's documented layout gives for the stored bytes."""
    qtype = gguf.GGMLQuantizationType[fmt]
    if not can_quantize(qtype) and fmt in KQUANT_F16_FIELDS:
        monkeypatch.setattr(gguf.quants, "quantize", synthetic_quantize)  # gguf only decodes K-quants
    cfg, state = model_256
    path = write_tiny_gguf(tmp_path / f"{fmt}.gguf", cfg, state, tensor_type=fmt)
    _, loaded, _ = load_checkpoint(path)
    checked = 0
    for t in gguf.GGUFReader(str(path)).tensors:
        name = gguf_to_hf_name(t.name)
        if t.tensor_type.name != fmt or name is None or "q_proj" in name or "k_proj" in name:
            continue  # (Q/K rows are un-permuted on load; the others map row to row)
        raw = np.asarray(t.data).reshape(-1).view(np.uint8).tobytes()[:256]
        want = decode_block(fmt, raw)
        got = loaded[name].reshape(-1)[: len(want)].numpy()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7 * float(np.abs(want).max() + 1e-30))
        checked += 1
    assert checked >= 5


def block_bound(fmt: str, x: np.ndarray) -> np.ndarray:
    """Largest |dequantize(quantize(x)) - x| a correct codec may give, per value, for 32-value blocks."""
    if fmt == "F16":
        return np.abs(x) * 2.0**-11 + 6e-8
    if fmt == "BF16":
        return np.abs(x) * 2.0**-8
    blocks = x.reshape(-1, 32).astype(np.float64)
    amax = np.abs(blocks).max(1, keepdims=True)
    lo, hi = blocks.min(1, keepdims=True), blocks.max(1, keepdims=True)
    f16_slack = (amax + (hi - lo)) * 2.0**-10  # scales (and mins) are stored as float16
    step = {"Q8_0": amax / 127 / 2, "Q4_0": amax / 8, "Q5_0": amax / 16,  # symmetric: one step at the clipped end
            "Q4_1": (hi - lo) / 15 / 2, "Q5_1": (hi - lo) / 31 / 2}[fmt]
    return np.broadcast_to(step + f16_slack, blocks.shape).reshape(x.shape)


@pytest.mark.parametrize("fmt", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantized_weights_within_format_error_bound(fmt: str, model_256, tmp_path: Path) -> None:
    """Loaded weights are the original floats up to the format's rounding (not a plausible-looking
    array from a wrong scale or a shifted block), and they are not simply the originals."""
    cfg, state = model_256
    path = write_tiny_gguf(tmp_path / f"{fmt}.gguf", cfg, state, tensor_type=fmt)
    _, loaded, _ = load_checkpoint(path)
    w = state["model.layers.1.mlp.down_proj.weight"].numpy()
    got = loaded["model.layers.1.mlp.down_proj.weight"].numpy()
    err, bound = np.abs(got.astype(np.float64) - w), block_bound(fmt, w)
    assert (err <= bound).all(), f"{fmt}: worst error {float((err - bound).max()):.3g} over the bound"
    assert err.max() > 0  # it really was quantized
    assert err.mean() < 0.6 * bound.mean()  # and typical errors are well inside the bound
