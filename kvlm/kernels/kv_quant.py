"""Quantized K/V formats: int8 and int4 codes with a float16 scale per 32 values along head_dim.

The KV cache stores each token's K or V head row (D floats) as D / 32 groups, one group = 32
consecutive values of that row:

* `int8` (34 bytes per group, q8_0-like): float16 scale d = amax / 127 (little-endian, bytes 0-1),
  then 32 int8 codes q_i = round_half_even(x_i * (1 / d)), clamped to [-127, 127]. x_i ~ q_i * d.
  Error bound: |x_i - q_i d| <= d / 2 + amax * 2^-10 + 2^-18 (half a step, plus the float16 rounding of
  d, relative and, where d is a float16 subnormal, absolute).
* `int4` (18 bytes per group, q4_0's size): float16 scale d, then 16 bytes: byte j holds code c_j in its
  low nibble and c_{j+16} in its high nibble, codes c_i in 0..15, x_i ~ Q4_LEVELS[c_i] d. The 16 levels
  are not uniform: `Q4_LEVELS` (integers -127..111) are Lloyd-Max levels for groups of 32 Gaussian values
  under this scale search (`scripts/kv_int4_levels.py` fits them; rotated K/V rows are close
  to Gaussian), finer near 0 where most values are. The scale is the best of `Q4_CANDIDATES` (an
  error-minimizing search, llama.cpp's make_qx_quants idea): candidate 0 is the plain rule,
  d = m / Q4_LEVELS[0] (m the group's signed value of largest magnitude, the positive one on a tie), so m
  decodes to level 0; each value's code is its nearest level, c_i = the number of midpoints between
  consecutive levels below y_i = x_i * (1 / d) (a tie goes to the lower level); candidate k >= 1 takes
  the codes of d_k = m / (Q4_LEVELS[0] t_k / 8) (t_k = 7.5, 8, 8.5) the same way, then refits the scale to
  those codes by least squares, d = sum(x l) / sum(l^2) (float64, l the codes' levels). The group keeps
  the candidate of smallest squared error sum((x_i - l_i d)^2) (d as stored, in float16; float64 sums,
  the first on a tie). Sums run in a fixed tree (halves added, 32 -> 16 -> ... -> 1: `_tree_sum`), so the
  native twin finds the same bits. Error bound: the group's squared error is at most candidate 0's, whose
  values are within `Q4_HALF_GAP` |d_0| of their level (half the widest gap between levels, or the
  distance from the top level to 127), so |x_i - l_i d| <= sqrt(32) (Q4_HALF_GAP |d_0| + amax * 2^-10 +
  2^-18), d_0 = amax / 127. Measured on the default model (docs/kv_quant.md): the search took int4's
  mean KLD from 7.5e-2 to 6.0e-2, the levels (against -8..7, with both K centers) from 3.7e-2 to 3.2e-2.

A zero group (amax = 0, -0.0 included) gets d = 0 and codes 0 (int8) or 8 (int4): it decodes to +0.0.
Scales saturate at float16's largest value 65504, so values beyond 127 * 65504 (int8, and int4 whose
extreme level is -127) are clipped; K/V are orders of magnitude smaller. NaN and inf are not representable.

Both formats quantize Hadamard-rotated rows: a head row x is stored as the codes of x H (H a normalized
Hadamard matrix, blocks of the largest power of two dividing D: 64 for SmolLM2), which spreads an
outlier channel over the block so one group's scale no longer has to cover it (llama.cpp does the same
since 2026, PR #21038). H is orthonormal and symmetric: attention rotates q (q H . k H = q . k) and
rotates its output back ((p V H) H = p V). The error bounds above hold for the rotated values x H.
docs/kv_quant.md has the measurements behind the choice.

Why per token and along head_dim (not KIVI's per-channel K): a token's stored codes then depend only on
that token's K/V, so writing a token is the same whoever else shares the step, a prefix block computed
by one request is the same bytes for any other, and a recompute stores exactly what the cache holds: the
engine's equivalences (cache == no cache, alone == batch, chunked == whole, prefix hit == miss) hold bit
for bit. Grouping across tokens would tie a token's codes to its neighbours'.

Dequantization is one float32 multiply, code * d (int4: level * d, the level an integer of at most 7 bits,
so the product is exact), the same in this reference and in the native kernel
(`kernels_attn_quant.h`), so the kernel reading codes in place computes what the float32 kernel computes
over `dequantize`'s values, bit for bit.

`quantize_ref` is the pure-PyTorch reference of the formats; `quantize` runs the native twin
(`csrc/kv_quantize.h`, the same bits, also what the fused decode step stores) where it is built.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvlm.kernels import native
from kvlm.kernels.backend import native_isa

GROUP = 32  # values per group along head_dim
F16_MAX = 65504.0
# int4's scale candidates, as divisors of the group's signed extreme m: d_k = m / -t_k (csrc/kv_quantize.h
# Q4_CANDIDATES has the same list). 8.0 first: the plain q4_0 rule, not refitted; then 7.5, 8, 8.5, refitted
# (ten candidates, 7 to 9 by quarters, measured no better on the default model: docs/kv_quant.md).
Q4_CANDIDATES = (8.0, 7.5, 8.0, 8.5)
# int4's 16 levels in code order (csrc/kv_quantize.h has the same table, which the quantizer and the
# kernel read): Lloyd-Max levels for Gaussian groups under the scale search, scaled so the extreme is -127
# and rounded to integers (`scripts/kv_int4_levels.py`). The extreme negative level is the
# plain rule's target.
Q4_LEVELS = (-127, -102, -82, -66, -51, -38, -25, -12, 0, 13, 25, 39, 53, 69, 87, 111)
# Half the widest gap between consecutive levels, or 127 - the top level (values past it are clipped to it),
# in units of d_0 = amax / 127: the plain rule's worst per-value error.
Q4_HALF_GAP = max(max(b - a for a, b in zip(Q4_LEVELS, Q4_LEVELS[1:])) / 2, 127 - Q4_LEVELS[-1])
_Q4_LUT = torch.tensor(Q4_LEVELS, dtype=torch.float32)
_Q4_MIDS = (_Q4_LUT[1:] + _Q4_LUT[:-1]) / 2  # exact: integers / 2


@dataclass(frozen=True, slots=True)
class KVQuantFormat:
    """One quantized K/V format: its name (`--kv-cache-dtype`), code bits and the kernel's type id."""

    name: str
    bits: int
    type_id: int  # kernels.h: KV_Q8 / KV_Q4
    rotate: bool = True  # head rows Hadamard-rotated before quantizing (csrc/kv_quantize.h: kv_rotates)

    @property
    def group_bytes(self) -> int:
        """Bytes of one group: the float16 scale plus 32 codes."""
        return 2 + GROUP * self.bits // 8

    @property
    def bytes_per_value(self) -> float:
        return self.group_bytes / GROUP

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one token's head row of `head_dim` values (head_dim % 32 == 0)."""
        if head_dim % GROUP:
            raise ValueError(f"the {self.name} KV cache needs head_dim % {GROUP} == 0, got {head_dim}")
        return head_dim // GROUP * self.group_bytes

    def __str__(self) -> str:
        return self.name


INT8 = KVQuantFormat("int8", 8, 1008)
INT4 = KVQuantFormat("int4", 4, 1004)
FORMATS: dict[str, KVQuantFormat] = {f.name: f for f in (INT8, INT4)}


def format_of(cache: torch.Tensor, head_dim: int) -> KVQuantFormat | None:
    """The format of a (..., row_bytes) uint8 cache holding rows of `head_dim` values, else None (a float cache)."""
    if cache.dtype != torch.uint8 or head_dim % GROUP:
        return None
    for f in FORMATS.values():
        if cache.shape[-1] == f.row_bytes(head_dim):
            return f
    return None


def hadamard_ref(x: torch.Tensor) -> torch.Tensor:
    """x H along the last dimension D: a normalized Hadamard matrix, block-diagonal with blocks of n, the
    largest power of two dividing D. Per block, butterflies (a, b) -> (a + b, a - b) at strides 1, 2, 4, ...,
    then times float32(1 / sqrt(n)): exact IEEE operations in a fixed order, the native op's bits. H is
    symmetric and H H = I, so the same call rotates back (to float32 rounding)."""
    *lead, D = x.shape
    n = D & -D
    y = x.float().reshape(-1, D // n, n)
    h = 1
    while h < n:
        y = y.reshape(y.shape[0], D // n, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).reshape(-1, D // n, n)
        h *= 2
    s = 1.0 / torch.tensor(float(n), dtype=torch.float32).sqrt()
    return (y * s).reshape(*lead, D)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """`hadamard_ref`'s result, by the native op where it takes x (CPU float32)."""
    if native_isa(x) is None:
        return hadamard_ref(x)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    native.ops().hadamard(x.contiguous(), out)
    return out


def _scale_and_inverse(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """d (float32) -> its float16 (saturated; a zero scale is +0.0, so a zero group decodes to +0.0) and
    the float32 inverse of that (0 where d is 0)."""
    d16 = torch.where(d == 0, 0.0, d.clamp(-F16_MAX, F16_MAX)).to(torch.float16)
    df = d16.float()
    inv = torch.where(df != 0, 1.0 / df, torch.zeros_like(df))
    return d16, inv


def _tree_sum(e: torch.Tensor) -> torch.Tensor:
    """(..., 32) -> (..., 1): halves added (32 -> 16 -> 8 -> 4 -> 2 -> 1), the native quantizer's order."""
    while e.shape[-1] > 1:
        h = e.shape[-1] // 2
        e = e[..., :h] + e[..., h:]
    return e


def _q4_search(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g (..., 32) float32 groups -> (float16 scale (..., 1), codes (..., 32) in 0..15, int64): the
    candidate of `Q4_CANDIDATES` with the smallest squared error (module docstring, `int4`)."""
    hi, lo = g.amax(-1, keepdim=True), g.amin(-1, keepdim=True)
    m = torch.where(hi >= -lo, hi, lo)  # signed value of largest magnitude, the positive one on a tie
    gd = g.double()
    lut, mids = _Q4_LUT.to(g.device), _Q4_MIDS.to(g.device)
    best: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    for k, t in enumerate(Q4_CANDIDATES):
        d16, inv = _scale_and_inverse(m / (Q4_LEVELS[0] * t / 8))
        c = torch.bucketize(g * inv, mids)  # the nearest level: midpoints below y (a tie: the lower level)
        lv = lut[c]
        if k > 0:  # least-squares scale for these levels: sum(x l) / sum(l^2), exact products in float64
            ld = lv.double()
            sxl, sll = _tree_sum(gd * ld), _tree_sum(ld * ld)
            d16, _ = _scale_and_inverse(torch.where(sll > 0, sxl / sll.clamp(min=1), 0.0).float())
        e = (g - lv * d16.float()).double()  # l * d is exact in float32 (11 + 7 significant bits)
        err = _tree_sum(e * e)
        if best is None:
            best = (err, d16, c)
        else:
            better = err < best[0]
            best = (torch.where(better, err, best[0]), torch.where(better, d16, best[1]),
                    torch.where(better, c, best[2]))
    assert best is not None
    return best[1], best[2]


def quantize(x: torch.Tensor, fmt: KVQuantFormat) -> torch.Tensor:
    """x (..., D) float -> (..., D / 32 * group_bytes) uint8, the format's groups in order: the native
    kernel where it takes x (a CPU float32 tensor), else `quantize_ref`; the same bits either way."""
    if native_isa(x) is None:
        return quantize_ref(x, fmt)
    *lead, D = x.shape
    if D % GROUP:
        raise ValueError(f"the {fmt.name} KV cache needs head_dim % {GROUP} == 0, got {D}")
    out = torch.empty(*lead, D // GROUP * fmt.group_bytes, dtype=torch.uint8)
    native.ops().kv_quantize(x.contiguous(), fmt.bits, out)
    return out


def quantize_ref(x: torch.Tensor, fmt: KVQuantFormat) -> torch.Tensor:
    """x (..., D) float -> (..., D / 32 * group_bytes) uint8, the format's groups in order (pure PyTorch);
    rotated first where the format rotates."""
    *lead, D = x.shape
    if D % GROUP:
        raise ValueError(f"the {fmt.name} KV cache needs head_dim % {GROUP} == 0, got {D}")
    if fmt.rotate:
        x = hadamard_ref(x)
    g = x.float().reshape(*lead, D // GROUP, GROUP)  # (..., G, 32)
    if fmt.bits == 8:
        d16, inv = _scale_and_inverse(g.abs().amax(-1, keepdim=True) / 127.0)
        codes = torch.round(g * inv).clamp(-127, 127).to(torch.int8).view(torch.uint8)  # (..., G, 32)
    else:
        d16, c = _q4_search(g)
        c = c.to(torch.uint8)  # (..., G, 32) in 0..15
        codes = c[..., :16] | (c[..., 16:] << 4)  # byte j: value j low, value j + 16 high
    scale = d16.view(torch.uint8)  # (..., G, 2), little-endian float16
    return torch.cat([scale, codes], dim=-1).reshape(*lead, D // GROUP * fmt.group_bytes)


def dequantize(raw: torch.Tensor, fmt: KVQuantFormat, head_dim: int) -> torch.Tensor:
    """raw (..., row_bytes) uint8 -> (..., head_dim) float32: code * d per value (one float32 multiply), the
    values the attention kernel reads: still rotated where the format rotates (`unrotated` undoes it)."""
    *lead, _ = raw.shape
    g = raw.reshape(*lead, head_dim // GROUP, fmt.group_bytes)
    d = g[..., :2].contiguous().view(torch.float16).float()  # (..., G, 1)
    if fmt.bits == 8:
        q = g[..., 2:].contiguous().view(torch.int8).float()  # (..., G, 32)
    else:
        b = g[..., 2:]
        q = _Q4_LUT.to(raw.device)[torch.cat([b & 15, b >> 4], dim=-1).long()]  # values 0..15 then 16..31
    return (q * d).reshape(*lead, head_dim)


@dataclass(frozen=True, eq=False)
class KeyCenter:
    """What a centered int8 / int4 cache subtracts from each key before quantizing it (`kv_cache/k_center.py`):
    mu, the model's mean key, from every key but a sequence's first; k0, the mean position-0 key, from the
    keys at position 0, which attention sinks make both atypical (far from mu) and heavily weighted. Exact
    in exact arithmetic: q . (k - mu) shifts every score of a row alike, which softmax ignores, and
    attention adds q . (k0 - mu) back to the score of a sequence's position-0 key (`delta`; the native
    kernel reads rotated rows and takes `delta_rot` = delta H: kernels.h, KvlmPagedAttn.k0_delta).
    mu, k0: (layers, kv_heads, D) float32 (float16 values); k0 None: position 0 is centered on mu too."""

    mu: torch.Tensor
    k0: torch.Tensor | None = None

    @functools.cached_property
    def delta(self) -> torch.Tensor | None:
        """(layers, kv_heads, D) float32 k0 - mu, or None."""
        return None if self.k0 is None else (self.k0 - self.mu).contiguous()

    @functools.cached_property
    def delta_rot(self) -> torch.Tensor | None:
        """`delta` Hadamard-rotated (the basis the kernel reads codes in), contiguous; or None."""
        return None if self.delta is None else hadamard(self.delta).contiguous()


class K0Correction(NamedTuple):
    """One layer's position-0 key correction for attention over a cache centered by a `KeyCenter` with k0."""

    delta: torch.Tensor  # (kv_heads, D) float32 k0 - mu: what the references add to the fetched key
    delta_rot: torch.Tensor  # (kv_heads, D) float32 delta H: what the native kernel dots with rotated q
    seqs: torch.Tensor | None  # (B,) uint8: the sequences whose token 0 is their position-0 key; None: all

    @classmethod
    def of(cls, center: KeyCenter | None, layer: int, seqs: torch.Tensor | None) -> K0Correction | None:
        if center is None or center.k0 is None:
            return None
        return cls(center.delta[layer], center.delta_rot[layer], seqs)  # type: ignore[index]


def centered(k: torch.Tensor, center: KeyCenter | None, layer: int,
             positions: torch.Tensor | None = None) -> torch.Tensor:
    """Keys k (T, kv_heads, D) as a centered cache stores them: k - mu[layer], and k - k0[layer] for the rows
    at position 0 (positions (T,) int64; None: no row is); one float32 subtraction per value (the fused
    decode step's too, `csrc/decode.cpp`, which centers a position-0 row on k0 the same way). k
    itself where center is None."""
    if center is None:
        return k
    out = k.float() - center.mu[layer]
    if center.k0 is not None and positions is not None:
        first = positions == 0
        if bool(first.any()):
            out[first] = k[first].float() - center.k0[layer]
    return out


def unrotated(values: torch.Tensor, fmt: KVQuantFormat) -> torch.Tensor:
    """`dequantize`'s values back in the model's basis (x H H = x): what the codes stand for."""
    return hadamard(values) if fmt.rotate else values


def error_bound(x: torch.Tensor, fmt: KVQuantFormat) -> torch.Tensor:
    """The documented per-value bound on |x' - dequantize(quantize(x))|, x' = x rotated where the format
    rotates (the values the codes hold; x (..., D), same shape)."""
    *lead, D = x.shape
    if fmt.rotate:
        x = hadamard_ref(x)
    g = x.float().reshape(*lead, D // GROUP, GROUP)
    amax = g.abs().amax(-1, keepdim=True)
    if fmt.bits == 8:
        bound = amax / 127.0 / 2 + amax * 2.0**-10 + 2.0**-18
    else:  # the plain rule's bound over the group's 32 values (module docstring, `int4`)
        bound = (amax / 127.0 * Q4_HALF_GAP + amax * 2.0**-10 + 2.0**-18) * GROUP**0.5
    return bound.expand_as(g).reshape(x.shape)
