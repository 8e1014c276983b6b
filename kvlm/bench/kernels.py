"""`kvlm bench kernels` (or `python -m kvlm.bench.kernels`): qmatmul against float32 torch.matmul.

For each weight format and the default model's linear shapes (out x in) and row counts M, it times
`qmatmul` on the quantized weight against `x @ W.T` with W pre-dequantized to float32 (what kvlm did
before the kernels), side by side in one process. Weights are cold, as in a decode step that walks
30 layers: each timed call uses the next of several copies, enough that they do not fit the caches.
Prints GB/s (weight bytes read per second) and the speedup per row, then paged decode attention
(kernel vs gather + SDPA; float32 and float16 caches, or any of `--attention-kv`'s formats: bfloat16,
int8 and int4 codes, which the reference dequantizes first; B 1 and 8, contexts 512 to 4096, 1 and N
threads), cold by default: each call reads the next of up to 30 layers' caches, as a decode step does,
so K/V stream from memory (`--hot` re-reads one cache). KV GB/s = K and V bytes of the context per
second. The last line is one JSON document.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from kvlm.bench.common import Bench, cpu_name, standalone
from kvlm.kernels import kv_quant
from kvlm.kernels.backend import NATIVE_TYPES, isa_name
from kvlm.kernels.paged_attention import paged_decode_attention
from kvlm.kernels.quant import dequantize, qmatmul
from kvlm.kernels.quant_tensor import QuantTensor
from kvlm.kernels.reference import paged_decode_attention_ref

SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576))  # SmolLM2-135M: q/o, k/v, up, down, head
ROWS = (1, 8, 32, 512)
FORMATS = ("Q4_1", "Q8_0")  # the default model's types; --formats takes NATIVE_TYPES, Q2_K and Q3_K
_F16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),  # byte offsets of
               "Q6_K": (208,)}  # a block's float16 scales
COLD_BYTES = 256 << 20  # float32 bytes across the rotated copies (well past any L3 here)


def random_weight(qtype: GGMLQuantizationType, n: int, k: int, gen: torch.Generator) -> QuantTensor:
    """A (n, k) weight of Gaussian values quantized by the gguf package's own quantizer (K-quants, which it
    cannot write: random blocks with sane float16 scales; the kernels' speed does not depend on the values)."""
    w = torch.randn(n, k, generator=gen).numpy()
    if qtype == GGMLQuantizationType.F32:
        raw = w.view(np.uint8)
    elif qtype == GGMLQuantizationType.F16:
        raw = w.astype(np.float16).view(np.uint8)
    elif qtype.name in _F16_FIELDS:  # the gguf package cannot quantize K-quants: random blocks, sane scales
        elems, nbytes = GGML_QUANT_SIZES[qtype]
        rng = np.random.default_rng(n * k)
        blocks = rng.integers(0, 256, (n, k // elems, nbytes), dtype=np.uint8)
        for off in _F16_FIELDS[qtype.name]:
            scales = rng.uniform(1e-3, 1e-2, (n, k // elems)).astype(np.float16)
            blocks[:, :, off:off + 2] = scales.view(np.uint8).reshape(n, k // elems, 2)
        raw = blocks.reshape(n, -1)
    else:
        raw = quants.quantize(w, qtype)
    return QuantTensor(torch.from_numpy(np.ascontiguousarray(raw)), qtype, (n, k))


def _time(fn, copies: int, min_s: float) -> float:
    """Median seconds per call, cycling through `copies` weights."""
    fn(0)
    times: list[float] = []
    start = time.perf_counter()
    i = 0
    while time.perf_counter() - start < min_s or len(times) < 3:
        t = time.perf_counter()
        fn(i % copies)
        times.append(time.perf_counter() - t)
        i += 1
    return float(np.median(times))


def bench_one(qtype: GGMLQuantizationType, n: int, k: int, m: int, min_s: float) -> dict:
    gen = torch.Generator().manual_seed(0)
    copies = max(1, min(512, COLD_BYTES // (4 * n * k)))
    first = random_weight(qtype, n, k, gen)
    ws = [first] + [QuantTensor(first.data.clone(), qtype, (n, k)) for _ in range(copies - 1)]
    wf = [dequantize(w) for w in ws]
    x = torch.randn(m, k, generator=gen)
    t_ref = _time(lambda i: x @ wf[i].T, copies, min_s)
    t_q = _time(lambda i: qmatmul(x, ws[i]), copies, min_s)
    qbytes, fbytes = ws[0].nbytes, 4 * n * k
    return {"format": qtype.name, "n": n, "k": k, "m": m, "path": isa_name(),
            "ms": round(t_q * 1e3, 4), "ref_ms": round(t_ref * 1e3, 4),
            "gbps": round(qbytes / t_q / 1e9, 2), "ref_gbps": round(fbytes / t_ref / 1e9, 2),
            "speedup": round(t_ref / t_q, 3)}


LAYERS = 30  # SmolLM2-135M: a decode step attends over 30 layers' caches in turn
ATTN_CASES = ((1, 512), (1, 2048), (1, 4096), (8, 512), (8, 2048), (8, 4096))  # (batch, context)
ATTN_KV = ("float32", "float16", "bfloat16", "int8", "int4")  # the KV cache formats the attention rows take
ATTN_MAX_BYTES = 1 << 30  # at most this much K/V across the layers' caches (B=8 at 4096 is 50 MB a layer)


@dataclass(frozen=True, slots=True)
class AttentionCase:
    """Inputs of paged decode attention with SmolLM2-135M's heads (9 query, 3 K/V, head_dim 64), block
    size 16, blocks scattered over the pool. `caches` holds one (k, v) pool per layer, sharing the block
    table as layers do: cold, each call reads K/V that the previous calls evicted from the CPU caches."""

    q: torch.Tensor  # (B, 9, 64)
    caches: list[tuple[torch.Tensor, torch.Tensor]]  # (num_blocks, 16, 3, 64) each
    tables: torch.Tensor  # (B, blocks per sequence) int32
    lens: torch.Tensor  # (B,) int32
    kv_bytes: int  # K and V bytes one call reads

    @staticmethod
    def make(b: int, length: int, kv: str, cold: bool) -> AttentionCase:
        """kv: a KV cache format, ATTN_KV (int8 / int4: codes of random values, kv_quant's layout)."""
        gen = torch.Generator().manual_seed(0)
        heads, kv_heads, d, bs = 9, 3, 64, 16
        per_seq = (length + bs - 1) // bs
        num_blocks = b * per_seq + 1
        kc, vc = (torch.randn(num_blocks, bs, kv_heads, d, generator=gen) for _ in range(2))
        if kv in kv_quant.FORMATS:
            kc, vc = kv_quant.quantize(kc, kv_quant.FORMATS[kv]), kv_quant.quantize(vc, kv_quant.FORMATS[kv])
        else:
            kc, vc = kc.to(getattr(torch, kv)), vc.to(getattr(torch, kv))
        layers = max(2, min(LAYERS, ATTN_MAX_BYTES // (2 * kc.nbytes))) if cold else 1
        caches = [(kc, vc)] + [(kc.clone(), vc.clone()) for _ in range(layers - 1)]
        tables = torch.randperm(num_blocks, generator=gen)[: b * per_seq].reshape(b, per_seq).to(torch.int32)
        return AttentionCase(torch.randn(b, heads, d, generator=gen), caches, tables,
                             torch.full((b,), length, dtype=torch.int32),
                             2 * b * length * kc.nbytes // (num_blocks * bs))

    def time(self, attend, min_s: float) -> float:
        """Median seconds per call of attend(q, k, v, tables, lens), the layers' caches taken in turn."""
        return _time(lambda i: attend(self.q, *self.caches[i], self.tables, self.lens), len(self.caches), min_s)


def _attend_kernel(q, k, v, tables, lens):
    return paged_decode_attention(q, k, v, tables, lens, 0.125)


def _attend_ref(q, k, v, tables, lens):
    return paged_decode_attention_ref(q, k, v, tables, lens, 0.125)


def bench_attention(b: int, length: int, kv: str, threads: int, min_s: float, cold: bool) -> dict:
    """Paged decode attention, native kernel vs gather + SDPA (dequantizing int8 / int4 codes first), on
    `threads` threads."""
    case = AttentionCase.make(b, length, kv, cold)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t = case.time(_attend_kernel, min_s)
        t_ref = case.time(_attend_ref, min_s)
    finally:
        torch.set_num_threads(before)
    return {"op": "paged_decode_attention", "batch": b, "context": length,
            "kv_dtype": kv, "threads": threads, "cold": cold, "layers": len(case.caches),
            "ms": round(t * 1e3, 4), "ref_ms": round(t_ref * 1e3, 4), "kv_gbps": round(case.kv_bytes / t / 1e9, 2),
            "ref_kv_gbps": round(case.kv_bytes / t_ref / 1e9, 2), "speedup": round(t_ref / t, 3)}


def run_attention(threads: list[int], min_s: float, cold: bool, kvs: tuple[str, ...] = ATTN_KV[:2]) -> list[dict]:
    print(f"\n{'attention':9} {'B':>3} {'context':>7} {'kv':>8} {'thr':>3} {'kernel ms':>10} {'KV GB/s':>8} "
          f"{'gather+SDPA ms':>15} {'KV GB/s':>8} {'speedup':>8}   ({'cold: ' if cold else 'hot: '}"
          f"{'a cache per layer, taken in turn' if cold else 'one cache, re-read'})")
    rows = []
    for kv in kvs:
        for b, length in ATTN_CASES:
            for n in threads:
                r = bench_attention(b, length, kv, n, min_s, cold)
                rows.append(r)
                print(f"{'paged':9} {b:>3} {length:>7} {r['kv_dtype']:>8} {n:>3} {r['ms']:>10.3f} {r['kv_gbps']:>8.2f} "
                      f"{r['ref_ms']:>15.3f} {r['ref_kv_gbps']:>8.2f} {r['speedup']:>7.2f}x", flush=True)
    return rows


def run(formats: list[str], rows: list[int], threads: int | None, min_s: float,
        attn_threads: list[int] | None = None, cold: bool = True,
        shapes: tuple[tuple[int, int], ...] = SHAPES, attn_kv: tuple[str, ...] = ATTN_KV[:2]) -> dict:
    if threads:
        torch.set_num_threads(threads)
    cpu = cpu_name()
    print(f"# kvlm kernels: path {isa_name()}, {torch.get_num_threads()} threads, {cpu}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    from kvlm.kernels import native

    if isa_name() not in ("reference", native.best_isa()):  # a forced path: torch's matmul is not held to it
        print(f"# f32 = torch.matmul on torch's own kernels, which {native.ENV_ISA} does not restrict: "
              f"'speedup' sets kvlm's {isa_name()} path against this CPU's best float32 matmul")
    print(f"{'format':6} {'N x K':>12} {'M':>4} {'qmatmul ms':>11} {'GB/s':>7} {'f32 ms':>9} {'GB/s':>7} "
          f"{'speedup':>8}")
    results = []
    with torch.inference_mode():
        for name in formats:
            qtype = GGMLQuantizationType[name]
            for n, k in shapes:
                if k % GGML_QUANT_SIZES[qtype][0]:
                    continue
                for m in rows:
                    r = bench_one(qtype, n, k, m, min_s)
                    results.append(r)
                    print(f"{name:6} {f'{n}x{k}':>12} {m:>4} {r['ms']:>11.3f} {r['gbps']:>7.2f} "
                          f"{r['ref_ms']:>9.3f} {r['ref_gbps']:>7.2f} {r['speedup']:>7.2f}x", flush=True)
        attention = run_attention(attn_threads, min_s, cold, attn_kv) if attn_threads else []
    return {"bench": "kernels", "cpu": cpu, "threads": torch.get_num_threads(), "path": isa_name(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": results, "attention": attention}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated GGUF types (default %(default)s)")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="values of M (default %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--min-seconds", type=float, default=0.3, help="time per measurement (default %(default)s)")
    p.add_argument("--attention-threads", default=None,
                   help="comma-separated thread counts for the attention rows (default: 1 and --threads)")
    p.add_argument("--shapes", default=None,
                   help="comma-separated N x K matmul shapes, e.g. 1536x576,49152x576 (default: the model's)")
    p.add_argument("--attention-only", action="store_true", help="skip the matmul rows")
    p.add_argument("--no-attention", action="store_true", help="skip the attention rows")
    p.add_argument("--attention-kv", default=",".join(ATTN_KV[:2]),
                   help=f"comma-separated KV cache formats for the attention rows, of {', '.join(ATTN_KV)} "
                        "(default %(default)s)")
    p.add_argument("--hot", action="store_true",
                   help="attention re-reads one cache (CPU-cache hot) instead of one per layer in turn")


def _positive_ints(text: str, flag: str) -> list[int]:
    """A comma-separated flag value as positive integers; ValueError naming the flag."""
    try:
        ints = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in ints):
        raise ValueError(f"{flag} must be positive")
    return ints


def _shapes(text: str | None) -> tuple[tuple[int, ...], ...]:
    """--shapes (N x K pairs, comma-separated) or, when not given, the default model's."""
    if not text:
        return SHAPES
    try:
        shapes = tuple(tuple(int(v) for v in sh.lower().split("x", 1)) for sh in text.split(","))
    except ValueError:
        raise ValueError(f"--shapes must be comma-separated NxK pairs, got {text!r}") from None
    if any(len(sh) != 2 or min(sh) < 1 for sh in shapes):
        raise ValueError(f"--shapes must be comma-separated NxK pairs of positive integers, got {text!r}")
    return shapes


def run_args(a: argparse.Namespace) -> dict:
    formats = [f.strip().upper() for f in a.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in GGMLQuantizationType.__members__]
    if unknown or not formats:
        raise ValueError(f"--formats: unknown GGUF type(s) {', '.join(unknown) or '(none given)'}")
    # what random_weight can write: gguf's quantizer, or random K-quant blocks (Q2_K and Q3_K have no native
    # kernel: their rows time the reference, which dequantizes the whole matrix per call)
    writable = {t.name for t in NATIVE_TYPES} | set(_F16_FIELDS)
    if bad := [f for f in formats if f not in writable]:
        raise ValueError(f"--formats: no random weights of {', '.join(bad)} here; "
                         f"one of {', '.join(sorted(writable))}")
    rows = _positive_ints(a.rows, "--rows")
    default_attn = ",".join(str(n) for n in sorted({1, a.threads or torch.get_num_threads()}))
    attn_threads = _positive_ints(a.attention_threads or default_attn, "--attention-threads")
    shapes = _shapes(a.shapes)
    kvs = tuple(v.strip() for v in a.attention_kv.split(",") if v.strip())
    if not kvs or any(v not in ATTN_KV for v in kvs):
        raise ValueError(f"--attention-kv must be comma-separated formats of {', '.join(ATTN_KV)}, "
                         f"got {a.attention_kv!r}")
    return run([] if a.attention_only else formats, rows, a.threads, a.min_seconds,
               [] if a.no_attention else attn_threads, cold=not a.hot, shapes=shapes, attn_kv=kvs)


# No print_table: `run` prints each row as it is measured (a full run takes minutes).
BENCH = Bench("kernels", "quantized matmul kernels vs float32 torch.matmul (GB/s, speedup)", add_args, run_args, None,
              description=__doc__.splitlines()[0])

if __name__ == "__main__":
    standalone(BENCH)
