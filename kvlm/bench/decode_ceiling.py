"""The decode ceiling of `kvlm bench compare`: each engine's batch-1 decode against the memory bandwidth
timed next to it.

Just before and just after each engine's measurement `compare.py` times a read-only pass over 1 GiB
(`latency.read_bandwidth`), and the engine's row keeps the higher of the two from the round of its best decode
(a shared host's bandwidth moves within minutes: a 2-core Zen 5 VM read 48 GB/s and 80 GB/s in turn, so only a
figure taken next to the decode it bounds says anything). A decode step at batch 1 reads every weight once, so
an engine keeping the file's blocks decodes at about that bandwidth over the bytes a step reads (the file's
tensors, less the input embedding table unless the output matrix is tied to it) at best. Each engine's decode
is given as GB/s of its own weights and as a fraction of its bandwidth, and llama.cpp's row says how far over
its decode an engine reading at that rate would be (`ceiling_over_this`). Not a hard limit: the pass is the
better of two read patterns (`latency.read_bandwidth`), and a CPU may stream another pattern faster (on a
2-core Xeon, 2026-12-05, kvlm's BF16 decode on `avx512-amx` read its weights at 1.13x the one-stream sum's
rate, before the 16-stream pass was added). The K/V read at these short contexts is left out (under 1% of
the weights at 32 tokens on a 1B).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def file_decode_bytes(path: Path) -> int | None:
    """Bytes of a GGUF file's tensors that one decode step reads: all of them but the input embedding table
    (a lookup reads one row), which counts when no output.weight is stored (the output matrix is tied to
    it). None for a file that is not GGUF."""
    if path.suffix != ".gguf":
        return None
    from gguf import GGUFReader

    tensors = GGUFReader(path).tensors
    tied = "output.weight" not in {t.name for t in tensors}
    return sum(int(t.n_bytes) for t in tensors if t.name != "token_embd.weight" or tied)


def add_ceiling(results: dict[str, dict[str, Any]], file_bytes: int | None) -> dict[str, Any]:
    """Each engine's decode as GB/s and as a share of the read bandwidth timed next to it, and llama.cpp's
    ceiling (module docstring)."""
    if file_bytes:
        results.get("llama_cpp", {}).setdefault("decode_weight_bytes", file_bytes)  # the file's own blocks
    for r in results.values():
        if r.get("status") == "ok" and r.get("decode_weight_bytes") and r.get("decode_tokens_per_s"):
            gbs = r["decode_weight_bytes"] * r["decode_tokens_per_s"]
            r["decode_gb_per_s"] = gbs / 1e9
            r["decode_fraction_of_read_bandwidth"] = gbs / (r["read_bandwidth_gb_per_s"] * 1e9)
    peer = results.get("llama_cpp", {})
    if file_bytes and peer.get("status") == "ok" and peer.get("decode_tokens_per_s"):
        peer["decode_ceiling_tokens_per_s"] = peer["read_bandwidth_gb_per_s"] * 1e9 / file_bytes
        peer["ceiling_over_this"] = peer["decode_ceiling_tokens_per_s"] / peer["decode_tokens_per_s"]
    return {"file_decode_bytes": file_bytes}


def ceiling_lines(d: dict[str, Any]) -> list[str]:
    """The table's lines for a compare document: each engine's decode GB/s and share, llama.cpp's ceiling."""
    out: list[str] = []
    shares = [f"{r['name']} {r['decode_gb_per_s']:.1f} GB/s ({100 * r['decode_fraction_of_read_bandwidth']:.0f}% of "
              f"{r['read_bandwidth_gb_per_s']:.1f})" for r in d["engines"].values() if "decode_gb_per_s" in r]
    if shares:
        out.append("decode reads its weights at (GB/s, and the share of a read-only pass timed next to it): "
                   + ", ".join(shares))
    peer = d["engines"].get("llama_cpp", {})
    if "ceiling_over_this" in peer:
        out.append(f"decode ceiling next to llama.cpp's decode: {peer['read_bandwidth_gb_per_s']:.1f} GB/s / "
                   f"{d['file_decode_bytes'] / 1e9:.3f} GB read per token = "
                   f"{peer['decode_ceiling_tokens_per_s']:.1f} tok/s, "
                   f"{peer['ceiling_over_this']:.2f}x llama.cpp's decode (an engine reading at the pass's rate)")
    return out
