"""How KV tier files hold a pool's K/V: as the pool stores them (the default, lossless), or as int8 codes of
a float pool's K/V (`--kv-tier-dtype int8`, `LLM(kv_tier_dtype="int8")`).

int8 is the int8 KV cache's own row format (`kernels/kv_quant.py`: each head row Hadamard-rotated, then
groups of 32 values with a float16 scale, 34 bytes a group), without its K center: a float pool's keys are
stored as computed, so the tier needs no calibration prefill at load (the int8 cache's measured gain from
centering is small: docs/kv_quant.md). A float32 pool's blocks take 3.8x fewer tier bytes, a float16 or
bfloat16 pool's 1.9x.

Lossy, and defined exactly: a block loaded from an int8 tier holds `round_trip_ref(x)`, the pool dtype of
unrotate(dequantize(quantize(x))) of the K/V x the engine computed, so a tier hit gives the bits of a run
whose loaded blocks went through that round trip once (tests/kv_cache/test_kv_tier_int8.py), not the bits
of recomputing them. The file header records `tier_dtype`, so a reader expecting another one refuses it.

What it knows: tensors and formats. Not files, hashes or the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlm.kernels.kv_quant import GROUP, INT8, dequantize, hadamard_ref, quantize, quantize_ref, unrotated

TIER_DTYPES = ("int8",)  # --kv-tier-dtype choices; None (the default) stores the pool's own format
FLOAT_KV = ("float32", "float16", "bfloat16")  # the pools an int8 tier can hold


@dataclass(frozen=True, slots=True)
class TierCodec:
    """The transform between a pool's K/V (layers, n, block_size, kv_heads, row) and a tier file's."""

    pool_kv_dtype: str  # the pool's KV format by name (a snapshot header's kv_dtype)
    tier_dtype: str  # the files' format by name: pool_kv_dtype itself (lossless), or "int8"
    head_dim: int

    @property
    def lossless(self) -> bool:
        return self.tier_dtype == self.pool_kv_dtype

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Pool K or V (..., head_dim) -> what the file stores: itself, or int8 rows (..., row_bytes) uint8."""
        if self.lossless:
            return x
        return quantize(x.float(), INT8)  # x.float(): exact for every float pool dtype

    def decode(self, s: torch.Tensor) -> torch.Tensor:
        """A file's K or V -> the pool's: itself, or the int8 rows dequantized, rotated back, in the pool dtype."""
        if self.lossless:
            return s
        return unrotated(dequantize(s, INT8, self.head_dim), INT8).to(getattr(torch, self.pool_kv_dtype))


def round_trip_ref(x: torch.Tensor) -> torch.Tensor:
    """What a float pool block x (..., head_dim) holds after an int8 tier stored and loaded it (pure PyTorch:
    the reference `TierCodec.decode(TierCodec.encode(x))` equals bit for bit)."""
    d = x.shape[-1]
    return hadamard_ref(dequantize(quantize_ref(x.float(), INT8), INT8, d)).to(x.dtype)


def make_codec(pool_kv_dtype: str, tier_dtype: str | None, head_dim: int) -> TierCodec:
    """The codec of a pool of `pool_kv_dtype` with `--kv-tier-dtype tier_dtype` (None: lossless). ValueError
    (one line) where int8 does not apply: a pool already quantized, or rows int8 cannot group."""
    if tier_dtype is None or tier_dtype == pool_kv_dtype:
        return TierCodec(pool_kv_dtype, pool_kv_dtype, head_dim)
    if tier_dtype not in TIER_DTYPES:
        raise ValueError(f"--kv-tier-dtype must be one of {', '.join(TIER_DTYPES)}, got {tier_dtype!r}")
    if pool_kv_dtype not in FLOAT_KV:
        raise ValueError(f"--kv-tier-dtype {tier_dtype} is for a float KV cache; this {pool_kv_dtype} cache's "
                         "blocks go to the tier as stored")
    if head_dim % GROUP:
        raise ValueError(f"--kv-tier-dtype {tier_dtype} needs head_dim % {GROUP} == 0; this model's is {head_dim}")
    return TierCodec(pool_kv_dtype, tier_dtype, head_dim)
