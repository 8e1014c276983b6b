"""Steady resident memory of a model kept in its stored width, against what it has to hold.

    PYTHONPATH=. python scripts/rss_breakdown.py MODEL [--threads 2] [--tokens 32] [--max-model-len N]

MODEL: a GGUF file or a safetensors folder. In one fresh process (Linux: /proc/self/status):
  floor    the runtime with no model: torch, kvlm and the native kernels loaded;
  weights  the bytes of the model's tensors as stored (GGUF tensor data, safetensors payloads);
  pool     the engine's KV cache pool (`Engine.kv_cache.nbytes`), allocated when the engine starts;
  steady   RSS after loading MODEL and generating --tokens greedy tokens after a short prompt, split into
           file-backed pages (the mapped weights) and anonymous ones (heap, pool, any copy).
Prints them, steady / (floor + weights + pool) (issue 36 asks <= 1.15 for bf16 models: no float32 copy) and
steady / (floor + weights), the stricter ratio: a short generation writes few of the pool's pages.
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path


def status_kib() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile of this process in KiB."""
    out: dict[str, int] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(rest.split()[0])
    return out


def weight_bytes(model: Path) -> int:
    """Bytes of the tensors as stored: GGUF tensor data, or safetensors payloads (headers read only)."""
    if model.is_dir():
        total = 0
        for shard in sorted(model.glob("*.safetensors")):
            with open(shard, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
        return total
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(model)).tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=None, help="the engine's context (default: the model's)")
    args = ap.parse_args()

    import torch

    from kvlm import LLM, SamplingParams
    from kvlm.kernels import native

    torch.set_num_threads(args.threads)
    native.available()  # builds or loads the kernels: part of the floor
    floor = status_kib()["VmRSS"] * 1024
    kw = {"num_threads": args.threads}
    if args.max_model_len:
        kw["max_model_len"] = args.max_model_len
    llm = LLM(str(args.model), **kw)
    llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True),
                 use_tqdm=False)
    s = status_kib()
    steady, anon, file = (s[k] * 1024 for k in ("VmRSS", "RssAnon", "RssFile"))
    weights = weight_bytes(args.model)
    pool = int(llm.llm_engine.kv_cache.nbytes)
    bound = floor + weights + pool
    mib = 2**20
    print(f"{args.model.name} ({native.active_isa()}, {args.threads} threads, {args.tokens} tokens)")
    print(f"  floor (torch + kvlm + kernels, no model) {floor / mib:8.0f} MiB")
    print(f"  weights as stored                        {weights / mib:8.0f} MiB")
    print(f"  KV pool                                  {pool / mib:8.0f} MiB")
    print(f"  steady RSS                               {steady / mib:8.0f} MiB "
          f"(file-backed {file / mib:.0f}, anonymous {anon / mib:.0f})")
    print(f"  steady / (floor + weights + pool)        {steady / bound:8.3f}")
    print(f"  steady / (floor + weights)               {steady / (floor + weights):8.3f} "
          "(the pool's pages are resident only once written)")


if __name__ == "__main__":
    main()
