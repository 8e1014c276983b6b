"""Matrix products computed on weights kept in their GGUF block formats.

A `QuantTensor` (quant_tensor.py) is a weight matrix of logical shape (N, K) (out x in, Hugging Face
orientation) stored as GGUF stores it: each of the N rows is K / block_elems blocks of `block_bytes` bytes,
so `data` is a (N, row_bytes) uint8 tensor (possibly a view over the memory-mapped file). Row operations
(the RoPE un-permute, stacking q/k/v) are byte-row operations on `data`; nothing is dequantized at load.

`qmatmul(x, w)` computes `x @ dequantize(w).T` on the blocks in place with the native kernels
(`native.py`, `csrc/`) where they are built, else with the reference (`reference.py`). A weight the loader
packed in 16-row panels (`panels.py`: Q4_K where an x86 int8 kernel runs) goes to that kernel as it is;
any other path (float32 activations, another ISA forced later, the reference) unpacks it first.

Numerics. Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K on every native path use int8
activations by default (as llama.cpp does; it quantizes x per 256 for the K-quants, kvlm per 32 for
every format): x is quantized per 32-element block (d = amax / 127, round half to even) and the block
products run on integers; `reference.qmatmul_int8_ref` (fake-quantize x, then float32 matmul) is their
definition. `KVLM_KERNEL_ACT=f32` opts out. F16, BF16, F32 and the reference fallback (no extension) keep
float32 activations (`qmatmul_ref`).

Paths by row count M:
- int8 types: the int8 kernel for M <= INT8_ROW_MAX_ROWS (every M by default: decode, batched
  decode, prefill chunks); on AVX-512 it computes 16 output columns per vector (csrc/kernels_int8_panel.h
  and kernels_kquant.h: weights used in place for up to 4 rows of x, a transposed panel buffer for more),
  on AVX2 (csrc/kernels_int8_avx2.h) 8 per vector, the same way, and on NEON and the scalar path
  (csrc/kernels_int8_portable.h) 4 weight rows at a time, all on the same contract (every path gives
  the same bits, `reference.qmatmul_int8_contract`); each output's arithmetic is fixed, so
  a row's result is bit-identical alone, in a batch or in a prefill chunk. Above the limit: fake-quantize x (the
  same int8 values), dequantize a weight tile, BLAS: the same numerics up to the float32 summation order.
- float32 activations: the row kernel for M <= GEMV_MAX_ROWS (every M by default), whose outputs each
  sum in a fixed order, so rows are bit-identical in any batch or chunk too. Above a lowered limit:
  dequantize a tile of weight rows (TILE_BYTES of float32) and multiply with BLAS (`x @ tile.T`), whose
  rows differ from the row kernel's in the last bits (summation order): then cached and recomputed
  logits agree only to float32 rounding. Prefill on these formats pays for the invariance: the row
  kernel decodes the weights once per 8 rows of x.
"""

from __future__ import annotations

import torch

from kvlm.kernels import native
from kvlm.kernels.backend import INT8_ACT_TYPES, INT8_ISAS, NATIVE_TYPES, native_isa, panel_kernel
from kvlm.kernels.panels import unpack
from kvlm.kernels.quant_tensor import ExpertStack, QuantTensor
from kvlm.kernels.reference import dequantize_ref, qmatmul_ref

_TYPE_IDS = {t: int(t) for t in NATIVE_TYPES}  # ggml type id, as the C++ side takes it
GEMV_MAX_ROWS = 1 << 20  # float32 activations: up to this many rows use the row kernel, more dequantize + BLAS
# Int8 activations: up to this many rows use the int8 kernel, more "fake-quantize x, dequantize a
# tile, BLAS". The AVX-512 panel kernel outruns float32 BLAS at prefill sizes (docs/int8_activations.md
# has the measurement), so it takes every M: a row's bits are the same in any chunk.
INT8_ROW_MAX_ROWS = 1 << 20
TILE_BYTES = 8 << 20  # float32 bytes of one dequantized weight tile: big enough for BLAS to run at full speed


def _native(w: QuantTensor, on_cpu: bool) -> tuple[native.NativeOps, int] | None:
    """(ops, isa id) when w's type has a native kernel on the active path, else None (use the reference)."""
    if not on_cpu or w.qtype not in NATIVE_TYPES or not w.data.is_cpu:
        return None
    isa = native_isa()
    if isa is None:
        return None
    return native.ops(), native.isa_id(isa)


def dequantize(w: QuantTensor) -> torch.Tensor:
    """(N, K) float32."""
    w = unpack(w)
    nat = _native(w, True)
    if nat is None:
        return dequantize_ref(w)
    n, k = w.shape
    out = torch.empty(n, k, dtype=torch.float32)
    nat[0].dequantize(_rows(w), int(w.qtype), k, nat[1], out)
    return out


def qmatmul(x: torch.Tensor, w: QuantTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) float32 -> (..., N) float32 = x @ dequantize(w).T.

    `out`, if given, is a contiguous float32 tensor of the result's shape that receives it (a decode
    step can then reuse its buffers instead of allocating per layer); it is also returned.
    """
    n, k = w.shape
    if out is not None and (out.dtype != torch.float32 or not out.is_contiguous() or out.dim() != x.dim()
                            or out.shape[-1] != n or out.numel() * k != x.numel() * n):
        raise ValueError(f"out must be a contiguous float32 tensor of shape {(*x.shape[:-1], n)}")
    nat = _native(w, x.is_cpu)
    if nat is None:
        y = qmatmul_ref(x, unpack(w))
        return y if out is None else out.copy_(y)
    ops, isa = nat
    if w.panels and not (int8_path(w, isa) and panel_kernel(native.ISAS[isa])):
        w = unpack(w)  # packed for a path this call does not take (same bytes, the file's order)
    # The common decode call is already (M, K) contiguous float32: skip each conversion when not needed
    # (each costs microseconds, and a decode step makes ~120 of these calls).
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if x2.dtype != torch.float32:
        x2 = x2.float()
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m = x2.shape[0]
    int8 = int8_path(w, isa)
    if m <= (INT8_ROW_MAX_ROWS if int8 else GEMV_MAX_ROWS):
        y = torch.empty(m, n, dtype=torch.float32) if out is None else out.view(m, n)
        (ops.qmatmul_i8 if int8 else ops.qmatmul)(x2, _rows(w), w.type_id, k, isa, y)
    else:
        w = unpack(w)
        if int8:  # the int8 kernels' activations, as float32 for BLAS
            xf = torch.empty_like(x2)
            ops.fake_quantize_act(x2, isa, xf)
            x2 = xf
        y = _tiled_matmul(x2, w, ops, isa)
        if out is not None:
            y = out.view(m, n).copy_(y)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)


MAX_PARTS = 4  # parts of one qmatmul_parts call (csrc/drivers.h MAX_PARTS)


def qmatmul_parts(x: torch.Tensor, parts: list[QuantTensor]) -> torch.Tensor | None:
    """x (M, K) float32 contiguous -> (M, sum of N) = torch.cat([qmatmul(x, w) for w in parts], -1), bit for bit,
    in one native call: x quantized once, one parallel loop over every part's panels, each part's columns written
    in place. For a layer's q / k / v or gate / up kept apart (they need not be next to each other in the file,
    nor of one type). None where the call would not go to one native kernel per part the same way (the caller
    then runs the parts one by one)."""
    m, k = x.shape
    if not 1 < len(parts) <= MAX_PARTS or x.dtype != torch.float32 or not x.is_contiguous():
        return None
    nats = [_native(w, x.is_cpu) for w in parts]
    if any(nat is None for nat in nats):
        return None
    ops, isa = nats[0]
    int8 = {int8_path(w, isa) for w in parts}
    if len(int8) != 1:
        return None
    i8 = int8.pop()
    if m > (INT8_ROW_MAX_ROWS if i8 else GEMV_MAX_ROWS) or any(
            w.panels and not (i8 and panel_kernel(native.ISAS[isa])) for w in parts):
        return None
    out = torch.empty(m, sum(w.shape[0] for w in parts), dtype=torch.float32)
    ops.qmatmul_parts(x, [_rows(w) for w in parts], [w.type_id for w in parts], k, isa, i8, out)
    return out


def expert_qmatmul(x: torch.Tensor, w: ExpertStack, counts: list[int],
                   counts_t: torch.Tensor | None = None) -> torch.Tensor:
    """Mixture-of-experts (llama.cpp's mul_mat_id): x (R, K) float32 rows grouped by expert in ascending id,
    counts[e] rows of expert e -> (R, N), each group times its expert's weight (`counts_t`: the same counts
    as an (E,) int64 tensor, if the caller has it). Natively one call: x
    quantized once and the threads split over (expert, column panel) items, each row with the bits
    `qmatmul(rows, w.expert(e))` gives it (the same kernel, whose outputs do not depend on M or the
    split). Without the native path (or above the row kernels' limits): a `qmatmul` per expert."""
    _, n, k = w.shape
    nat = _native(w.expert(0), x.is_cpu)
    x2 = x.float().contiguous()
    m = x2.shape[0]
    int8 = nat is not None and w.qtype in INT8_ACT_TYPES and native.ISAS[nat[1]] in INT8_ISAS \
        and native.int8_activations()
    if nat is None or w.data.stride(2) != 1 or m > (INT8_ROW_MAX_ROWS if int8 else GEMV_MAX_ROWS):
        out = torch.empty(m, n, dtype=torch.float32)
        start = 0
        for e, c in enumerate(counts):
            if c:
                qmatmul(x2[start:start + c], w.expert(e), out=out[start:start + c])
                start += c
        return out
    ops, isa = nat
    out = torch.empty(m, n, dtype=torch.float32)
    if counts_t is None:
        counts_t = torch.tensor(counts, dtype=torch.int64)
    ops.expert_qmatmul(x2, w.data, counts_t, _TYPE_IDS[w.qtype], k, isa, int8, out)
    return out


def int8_path(w: QuantTensor, isa: int) -> bool:
    """Whether qmatmul of w on ISA path id `isa` quantizes activations to int8 (module docstring)."""
    return w.qtype in INT8_ACT_TYPES and native.ISAS[isa] in INT8_ISAS and native.int8_activations()


def _tiled_matmul(x: torch.Tensor, w: QuantTensor, ops: native.NativeOps, isa: int) -> torch.Tensor:
    """x (M, K) @ W.T for many rows: dequantize a tile of weight rows, then one BLAS call per tile."""
    n, k = w.shape
    data = _rows(w)
    tile = max(16, min(n, TILE_BYTES // (4 * k)))
    buf = torch.empty(tile, k, dtype=torch.float32)  # (tile, K) dequantized rows, reused
    if tile == n:
        ops.dequantize(data, _TYPE_IDS[w.qtype], k, isa, buf)
        return x @ buf.T
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    for n0 in range(0, n, tile):
        rows = min(tile, n - n0)
        ops.dequantize(data[n0:n0 + rows], _TYPE_IDS[w.qtype], k, isa, buf[:rows])
        out[:, n0:n0 + rows] = x @ buf[:rows].T
    return out


def _rows(w: QuantTensor) -> torch.Tensor:
    """w.data with contiguous bytes in each row (the kernels allow any row stride)."""
    d = w.data
    return d if d.stride(1) == 1 else d.contiguous()
