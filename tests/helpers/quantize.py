"""GGUF block data for tests: gguf's quantizer where it supports the type, plausible random blocks
(sane float16 scales) for the K-quants it cannot write."""

from __future__ import annotations

import zlib
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from kvlm.kernels.quant_tensor import QuantTensor

# Byte offsets of the float16 scale fields in one block of each K-quant (gguf/quants.py block layouts).
KQUANT_F16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
real_quantize = gguf.quants.quantize


def can_quantize(qtype: gguf.GGMLQuantizationType) -> bool:
    try:
        real_quantize(np.zeros((1, 256), np.float32), qtype)
        return True
    except NotImplementedError:
        return False


def synthetic_quantize(a: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """Valid-looking blocks for types gguf cannot quantize: random bytes with sane f16 scales.

    Each row's bytes depend only on that row's values, so (like a real quantizer) this commutes with
    the row permutation the GGUF writer applies to Q/K.
    """
    if qtype.name not in KQUANT_F16_FIELDS:
        return real_quantize(a, qtype)
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rows = a.reshape(-1, a.shape[-1])
    out = np.empty((rows.shape[0], rows.shape[1] // block * nbytes), np.uint8)
    for i, row in enumerate(rows):
        rng = np.random.default_rng(zlib.crc32(row.tobytes()))
        blocks = rng.integers(0, 256, (rows.shape[1] // block, nbytes), dtype=np.uint8)
        for off in KQUANT_F16_FIELDS[qtype.name]:
            blocks[:, off:off + 2] = rng.uniform(1e-3, 1e-2, (len(blocks), 1)).astype(np.float16).view(np.uint8)
        out[i] = blocks.reshape(-1)
    return out.reshape(*a.shape[:-1], -1)


# Byte offsets of each format's float16 scale fields inside a block.
SCALE_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q8_0: [0], T.Q5_0: [0], T.Q5_1: [0, 2],
                T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}


def random_blocks(qtype: T, n: int, k: int, seed: int) -> QuantTensor:
    """(n, k) weight of random blocks: random quants and scales, plus the edge rows (when n >= 3):
    row 0 all-zero bytes, row 1 the largest float16 scales (and +-max values for dense types),
    row 2 negative-zero scales (and -0.0 values for dense types)."""
    rng = np.random.default_rng(seed)
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    if qtype in (T.F32, T.F16, T.BF16):
        vals = rng.standard_normal((n, k)).astype(np.float32)
        if n >= 3:
            vals[1, ::2], vals[1, 1::2] = 65504.0, -65504.0
            vals[2] = -0.0
        if qtype == T.F32:
            raw = vals.view(np.uint8)
        elif qtype == T.F16:
            raw = vals.astype(np.float16).view(np.uint8)
        else:
            raw = (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        blocks = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
        for off in SCALE_FIELDS[qtype]:
            scales = (rng.standard_normal((n, k // elems)) * 0.05).astype(np.float16)
            if n >= 3:
                scales[0], scales[1], scales[2] = 0.0, np.float16(65504.0), np.float16(-0.0)
            blocks[:, :, off:off + 2] = scales.view(np.uint8).reshape(n, k // elems, 2)
        if n >= 1:
            blocks[0] = 0
        raw = blocks.reshape(n, -1)
    return QuantTensor(torch.from_numpy(np.ascontiguousarray(raw)), qtype, (n, k))


def write_tiny_q4k_gguf(path: Path) -> Path:
    """The tiny Llama in Q4_K (synthetic blocks: gguf's numpy code only dequantizes K-quants), hidden 256 so
    its matrices are whole 16-row panels, the head tied to the embedding."""
    from tiny_models import tiny_config, write_tiny_gguf

    cfg = tiny_config(hidden_size=256, intermediate_size=256, head_dim=64, tie_word_embeddings=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.quants, "quantize", synthetic_quantize)
        return write_tiny_gguf(path, cfg, tensor_type="Q4_K")
