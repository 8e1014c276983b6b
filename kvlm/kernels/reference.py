"""Pure-PyTorch/numpy references for the kernels: slow, obviously right, always available on CPU.

Every native kernel is tested against these, and they are the fallback where the native extension
cannot be built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvlm.kernels import kv_quant

if TYPE_CHECKING:
    from kvlm.kernels.kv_quant import K0Correction
    from kvlm.kernels.quant_tensor import QuantTensor


def dequantize_ref(w: QuantTensor) -> torch.Tensor:
    """(N, K) float32 from the GGUF blocks, decoded by the `gguf` package's numpy code."""
    from gguf import GGMLQuantizationType, quants

    raw = w.data.cpu().numpy()
    if w.qtype == GGMLQuantizationType.F32:
        arr = raw.view(np.float32)
    elif w.qtype == GGMLQuantizationType.F16:
        arr = raw.view(np.float16).astype(np.float32)
    else:
        arr = quants.dequantize(raw, w.qtype).astype(np.float32, copy=False)
    return torch.from_numpy(np.ascontiguousarray(arr).reshape(w.shape))


def qmatmul_ref(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """x (M, K) float32 @ dequantize(w).T -> (M, N) float32."""
    return x.float() @ dequantize_ref(w).to(x.device).T


def quantize_act_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 activation quantization of the int8 kernels: x (M, K) float32, K % 32 == 0, ->
    q (M, K // 32, 32) int8 and d (M, K // 32, 1) float32 with d = amax / 127 per 32-element block,
    q = round_half_even(x * (1 / d)) (q = 0 where d = 0), all in float32 as the kernels compute it."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(blocks * inv).to(torch.int8), d


def fake_quantize_act(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) -> the float32 values the int8 kernels compute with: q * d per block (same shape)."""
    q, d = quantize_act_ref(x)
    return (q.float() * d).reshape(x.shape)


def qmatmul_int8_ref(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """The numerics of the int8-activation kernels (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K):
    fake-quantize x per 32-element block, then x_fq (M, K) @ dequantize(w).T in float32. A min term
    (Q4_1, Q5_1, Q4_K, Q5_K) m * sum(x_fq) is then m * d * sum(q) (llama.cpp's q8_1 convention), which is
    what the kernels compute. The K-quants' x is quantized per 32 too (llama.cpp: per 256, q8_K)."""
    return fake_quantize_act(x) @ dequantize_ref(w).to(x.device).T


def _dense(blocks: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Cache blocks (..., D) of a float type, or (..., row_bytes) uint8 codes of a quantized format ->
    float32 (..., D) values (codes dequantized and, for a rotating format, rotated back)."""
    fmt = kv_quant.format_of(blocks, head_dim)
    if fmt is None:
        return blocks.float()
    return kv_quant.unrotated(kv_quant.dequantize(blocks, fmt, head_dim), fmt)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Gather each sequence's blocks, then SDPA with each K/V head's query heads folded together.

    q (B, H, D); caches (num_blocks, block_size, kv_heads, D) of any float type (or int8 / int4 codes,
    dequantized) -> (B, H, D) in q's dtype,
    computed in float32; zeros for a length-0 sequence.
    """
    import torch.nn.functional as F

    b_size, heads, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(b_size):
        length = int(seq_lens[b])
        if length == 0:
            continue
        blocks = block_tables[b, : (length + block_size - 1) // block_size].long()
        k = _dense(k_cache[blocks], d).reshape(-1, kv_heads, d)[:length].transpose(0, 1)  # (kv_heads, L, D)
        v = _dense(v_cache[blocks], d).reshape(-1, kv_heads, d)[:length].transpose(0, 1)
        qg = q[b].float().reshape(kv_heads, group, d)  # query head h = g * group + i uses K/V head g
        out[b] = F.scaled_dot_product_attention(qg, k, v, scale=scale).reshape(heads, d)
    return out.to(q.dtype)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_ids: torch.Tensor, ctx_lens: torch.Tensor, scale: float, window: int = 0,
                        k0: K0Correction | None = None) -> torch.Tensor:
    """Query rows of any sequences: gather each sequence's blocks once, then SDPA of its rows with a
    per-row key mask (row t sees tokens < ctx_lens[t], and with window > 0 none before ctx_lens[t] -
    window), each K/V head's query heads folded together.

    q (T, H, D); caches (num_blocks, block_size, kv_heads, D) of any float type (or int8 / int4 codes,
    dequantized); block_tables (B,
    max_blocks); seq_ids, ctx_lens (T,) -> (T, H, D) in q's dtype, computed in float32; zeros for a row
    with ctx_lens 0. k0: token 0 of each sequence in k0.seqs (None: all) reads k + k0.delta (a centered
    cache's position-0 key, `kv_quant.KeyCenter`).
    """
    import torch.nn.functional as F

    t_rows, heads, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    seq_ids = seq_ids.to(device=q.device, dtype=torch.long)
    lens = ctx_lens.to(device=q.device, dtype=torch.long)
    for s in torch.unique(seq_ids).tolist():
        rows = torch.nonzero((seq_ids == s) & (lens > 0)).flatten()
        if rows.numel() == 0:
            continue
        length = int(lens[rows].max())
        blocks = block_tables[s, : (length + block_size - 1) // block_size].long()
        k = _dense(k_cache[blocks], d).reshape(-1, kv_heads, d)[:length].transpose(0, 1)  # (kv_heads, L, D)
        v = _dense(v_cache[blocks], d).reshape(-1, kv_heads, d)[:length].transpose(0, 1)
        if k0 is not None and (k0.seqs is None or bool(k0.seqs[s])):
            k = k.clone()
            k[:, 0] += k0.delta.to(k)
        n = rows.numel()
        # (kv_heads, group * n, D): query head h = g * group + i uses K/V head g; row-major (i, row).
        qg = q[rows].float().reshape(n, kv_heads, group, d).permute(1, 2, 0, 3).reshape(kv_heads, group * n, d)
        pos = torch.arange(length, device=q.device)[None, :]
        mask = pos < lens[rows][:, None]  # (n, L)
        if window > 0:
            mask &= pos >= lens[rows][:, None] - window
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask.repeat(group, 1), scale=scale)
        out[rows] = o.reshape(kv_heads, group, n, d).permute(2, 0, 1, 3).reshape(n, heads, d)
    return out.to(q.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * weight (torch's fused rms_norm)."""
    return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)


def moe_route_ref(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixture-of-experts routing, what `moe_route` (csrc/moe.cpp, with its native softmax) computes: router
    logits (T, E) -> (expert ids (T, k) int64, weights (T, k) float32): softmax in float32, the top k by
    descending probability, ties by ascending expert id (a stable sort), divided by their sum if renormalize."""
    probs = torch.softmax(logits.float(), dim=-1)
    top, ids = torch.sort(probs, dim=-1, descending=True, stable=True)  # stable: equal p keep id order
    top, ids = top[:, :k], ids[:, :k]
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return ids, top


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2I) -> silu(first half) * second half."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2I) -> gelu(first half, tanh approximation) * second half (HF's gelu_pytorch_tanh)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def lora_b_add_ref(t: torch.Tensor, bt: torch.Tensor, spans: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y (T, N) float32 += each row's LoRA B product of t (T, R), in place: per span (r0, r, o0, n) of `spans`
    (P, 4), with that part's B transposed (r, n) next in the packed `bt`, u = sum_j t[:, r0 + j] * bt_p[j] in
    increasing j (a multiply, then an add), then y[:, o0:o0 + n] += u. The native kernel's exact arithmetic."""
    off = 0
    for r0, r, o0, n in spans.tolist():
        b = bt[off : off + r * n].view(r, n)
        off += r * n
        if r == 0:
            continue
        u = t[:, r0 : r0 + 1] * b[0]
        for j in range(1, r):
            u = u + t[:, r0 + j : r0 + j + 1] * b[j]
        y[:, o0 : o0 + n] += u
    return y


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE with a signed sin table: x * cos + roll(x, D/2) * sin_signed."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def _f16(b: np.ndarray, off: int) -> np.ndarray:
    """The float16 at byte `off` of each block of b (..., block_bytes) -> float32 (...)."""
    return np.ascontiguousarray(b[..., off:off + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray, shift: int = 0) -> np.ndarray:
    """16 or 32 bytes -> their 4-bit fields at `shift` (16 bytes: low nibbles then high, 32 elements)."""
    if qs.shape[-1] == 16:
        return np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int64)
    return ((qs >> shift) & 15).astype(np.int64)


def _k4_scales(sc: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 6-bit scale and min of sub-block j from the 12 packed bytes (ggml's get_scale_min_k4)."""
    sc = sc.astype(np.int64)
    if j < 4:
        return sc[..., j] & 63, sc[..., j + 4] & 63
    return (sc[..., j + 4] & 15) | ((sc[..., j - 4] >> 6) << 4), (sc[..., j + 4] >> 4) | ((sc[..., j] >> 6) << 4)


def int8_units(w: QuantTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The int8 kernels' view of w (N, K): per unit (the 32 weights meeting x's block ib) the integer
    weights (N, K/32, 32) int64 whose dot product with x's int8 block is the unit's exact sum (Q4_0 /
    Q5_0 offsets and Q6_K's sub-scales included), the float32 scale dw (N, K/32) and the min factor mw
    (N, K/32; None for Q4_0, Q5_0, Q8_0, Q6_K), each computed with the kernels' float32 operations."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    n, k = w.shape
    elems, nbytes = GGML_QUANT_SIZES[w.qtype]
    b = w.data.cpu().numpy().reshape(n, k // elems, nbytes)
    mw = None
    if w.qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        dw = _f16(b, 0)
        if w.qtype == T.Q8_0:
            u = b[..., 2:34].view(np.int8).astype(np.int64)
        elif w.qtype in (T.Q4_0, T.Q4_1):
            u = _nibbles(b[..., 2:18] if w.qtype == T.Q4_0 else b[..., 4:20]) - (8 if w.qtype == T.Q4_0 else 0)
        else:
            qh_at = 2 if w.qtype == T.Q5_0 else 4
            qh = np.ascontiguousarray(b[..., qh_at:qh_at + 4]).view("<u4").astype(np.int64)  # (N, nb, 1)
            u = _nibbles(b[..., qh_at + 4:qh_at + 20]) | (((qh >> np.arange(32)) & 1) << 4)
            u = u - (16 if w.qtype == T.Q5_0 else 0)
        if w.qtype in (T.Q4_1, T.Q5_1):
            mw = _f16(b, 2)
        return u, dw, mw
    us, dws, mws = [], [], []
    for s in range(8):  # sub-block s of each super-block: unit 8 blk + s
        if w.qtype == T.Q6_K:
            hh, c = s // 4, s % 4
            ql = b[..., 64 * hh + (c & 1) * 32:64 * hh + (c & 1) * 32 + 32]
            qh = b[..., 128 + 32 * hh:160 + 32 * hh].astype(np.int64)
            q = _nibbles(ql, (c >> 1) * 4) | (((qh >> (2 * c)) & 3) << 4)
            sc = b[..., 192 + 2 * s:194 + 2 * s].view(np.int8).astype(np.int64)  # elements 0..15, 16..31
            us.append((q - 32) * np.repeat(sc, 16, axis=-1))
            dws.append(_f16(b, 208))
        else:
            q_at = 16 if w.qtype == T.Q4_K else 48
            q = _nibbles(b[..., q_at + 32 * (s // 2):q_at + 32 * (s // 2) + 32], 4 * (s & 1))
            if w.qtype == T.Q5_K:
                q = q | (((b[..., 16:48].astype(np.int64) >> s) & 1) << 4)
            sc, mn = _k4_scales(b[..., 4:16], s)
            us.append(q)
            dws.append(_f16(b, 0) * sc.astype(np.float32))
            mws.append((np.float32(0) - _f16(b, 2)) * mn.astype(np.float32))
    u = np.stack(us, axis=2).reshape(n, k // 32, 32)
    dw = np.stack(dws, axis=2).reshape(n, k // 32)
    if mws:
        mw = np.stack(mws, axis=2).reshape(n, k // 32)
    return u, dw, mw


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c rounded once (the FMA instruction), elementwise, from float64 arithmetic: the
    product is exact in float64, the sum's rounding error is recovered (TwoSum), and the one case where
    rounding through float64 then to float32 differs from rounding once (a float64 sum exactly halfway
    between two float32 values, with a nonzero error) is corrected toward the error's side."""
    with np.errstate(all="ignore"):
        p = a.astype(np.float64) * b.astype(np.float64)
        c64 = c.astype(np.float64)
        s = p + c64
        bb = s - p
        e = (p - (s - bb)) + (c64 - bb)
        r = s.astype(np.float32)
        r64 = r.astype(np.float64)
        other = np.nextafter(r, np.where(s > r64, np.float32(np.inf), np.float32(-np.inf)))
        o64 = other.astype(np.float64)
        tie = (r64 != s) & (s - r64 == o64 - s) & (e != 0)
        toward_other = (e > 0) == (o64 > r64)
        return np.where(tie & toward_other, other, r)


def qmatmul_int8_contract(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """The int8 kernels' exact result, bit for bit (their order contract, csrc/kernels_int8_panel.h and
    kernels_int8_avx2.h): x (M, K) quantized as quantize_act_ref, each unit's integer sum isum_ib exact,
    then in float32 acc = fma(float(isum_ib) * dw_ib, xd_ib, acc) over ib = 0 .. K/32 - 1, the min terms
    mn = fma(mw_ib, xs_ib, mn) likewise (xs = d * sum(q)), y = acc + mn -> (M, N) float32. Slow (numpy,
    a loop over K/32); for tests. Its numbers are qmatmul_int8_ref's up to float32 summation order."""
    q, d = quantize_act_ref(x)
    qn = q.numpy().astype(np.int64)  # (M, nb, 32)
    xd = d[..., 0].numpy()  # (M, nb) float32
    xs = xd * qn.sum(-1).astype(np.float32)
    u, dw, mw = int8_units(w)
    isum = np.einsum("mbk,nbk->mnb", qn, u)  # exact int64, (M, N, nb)
    m, n = x.shape[0], w.shape[0]
    acc = np.zeros((m, n), np.float32)
    mn = np.zeros((m, n), np.float32)
    for ib in range(u.shape[1]):
        f = isum[..., ib].astype(np.float32) * dw[None, :, ib]
        acc = fma32(f, np.broadcast_to(xd[:, ib:ib + 1], (m, n)), acc)
        if mw is not None:
            mn = fma32(np.broadcast_to(mw[None, :, ib], (m, n)), np.broadcast_to(xs[:, ib:ib + 1], (m, n)), mn)
    return torch.from_numpy(acc + mn if mw is not None else acc)


def _flush(t: torch.Tensor) -> torch.Tensor:
    """Denormals to zero, keeping the sign (x86 FTZ / DAZ)."""
    return torch.where(t.abs() < torch.finfo(torch.float32).tiny, t * 0.0, t)


def qmatmul_bf16_contract(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """The native kernels' exact result for BF16 weights, bit for bit (csrc/kernels_bf16.h; AVX-512 BF16's
    vdpbf16ps where the CPU has it): x (M, K) rounded to bf16 (nearest even), x and W zero-padded to a
    multiple of 32; per output 16 lanes, lane l adding, chunk after chunk of 32 elements, the product of
    elements 2l + 1 then of elements 2l (each product exact, each sum rounded once, as an FMA), denormal
    inputs and results flushed to zero; then the kernels' fixed tree over the lanes -> (M, N) float32."""
    m, k = x.shape
    n = w.shape[0]
    kp = -(-k // 32) * 32
    xb = torch.zeros(m, kp)
    xb[:, :k] = _flush(x.float().to(torch.bfloat16).float())
    wb = torch.zeros(n, kp)
    wb[:, :k] = _flush(dequantize_ref(w))
    xr, wr = xb.view(m, 1, kp // 32, 16, 2), wb.view(1, n, kp // 32, 16, 2)
    acc = np.zeros((m, n, 16), np.float32)
    for c in range(kp // 32):
        for e in (1, 0):  # each product exact, the sum rounded once (fma32: also where a product overflows)
            a, b = torch.broadcast_tensors(xr[:, :, c, :, e], wr[:, :, c, :, e])
            acc = _flush(torch.from_numpy(fma32(a.numpy(), b.numpy(), acc))).numpy()
    acc = torch.from_numpy(acc)
    b = _flush(acc[..., :8] + acc[..., 8:])  # hsum: lanes i and i + 8, then i and i + 4, ...
    c4 = _flush(b[..., :4] + b[..., 4:])
    d = _flush(c4[..., :2] + c4[..., 2:])
    return _flush(d[..., 0] + d[..., 1])
