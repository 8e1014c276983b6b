"""A decode step's weight walk alone, the file's layout against 16-row panels, taking turns in one process.

    PYTHONPATH=. python scripts/weight_walk_ab.py FILE [--rounds 8] [--threads 2] [--format Q4_K]

Every 2-D matrix of a GGUF file but the embedding table (of `--format`, or all), in file order, each times
one row of x (`qmatmul`, M = 1), as a decode step walks them: the file is far larger than the caches, so each
matrix comes from memory. One walk per layout per round, the order alternating; prints each layout's median
and best GB/s (weight bytes per second). Matrices that cannot be packed (`kernels.panels.packable`) are the
same objects in both walks. Only on a path whose kernel reads panels (`kernels.backend.panel_kernel`: the
AVX-512 and AVX2 units); elsewhere qmatmul would unpack a packed matrix at every call, so the script refuses.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvlm.kernels import qmatmul
from kvlm.kernels.backend import isa_name, native_isa, panel_kernel
from kvlm.kernels.panels import pack, packable
from kvlm.loader.gguf import file_bytes, quant_tensor, read_gguf


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--format", help="only matrices of this GGUF type (e.g. Q4_K)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if not panel_kernel(native_isa()):
        raise SystemExit(f"weight_walk_ab: the {isa_name()} path reads no panels: nothing to compare")
    reader, _ = read_gguf(a.file)
    mapped = file_bytes(reader)
    plain = [quant_tensor(t, mapped) for t in reader.tensors if len(t.shape) == 2 and t.name != "token_embd.weight"
             and t.tensor_type.name not in ("F32", "F16", "BF16") and a.format in (None, t.tensor_type.name)]
    if not plain:
        raise SystemExit("weight_walk_ab: no quantized 2-D matrix of that format in the file")
    layouts = {"file": plain, "panels": [pack(w) if packable(w) else w for w in plain]}
    total = sum(w.nbytes for w in plain)
    xs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in plain}
    outs = [torch.empty(1, w.shape[0]) for w in plain]
    gbs: dict[str, list[float]] = {k: [] for k in layouts}
    for r in range(a.rounds):
        for name in list(layouts) if r % 2 == 0 else list(layouts)[::-1]:
            ws = layouts[name]
            for w, o in zip(ws, outs):  # one walk untimed: the other layout's walk evicted this one's lines
                qmatmul(xs[w.shape[1]], w, out=o)
            t = time.perf_counter()
            for w, o in zip(ws, outs):
                qmatmul(xs[w.shape[1]], w, out=o)
            gbs[name].append(total / (time.perf_counter() - t) / 1e9)
    print(f"{len(plain)} matrices, {total / 1e9:.3f} GB, {a.threads} threads, {a.rounds} rounds")
    for name, v in gbs.items():
        print(f"{name:>7}: median {statistics.median(v):.1f} GB/s, best {max(v):.1f}")
    print(f"panels / file (medians): {statistics.median(gbs['panels']) / statistics.median(gbs['file']):.2f}x")


if __name__ == "__main__":
    main()
