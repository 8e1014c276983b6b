"""Soak the KV tier (kvlm/kv_cache/tier.py): N processes read and write one tier directory for a while,
with a bound so small that LRU eviction runs all the time, and fail on any corrupt load.

    python scripts/tier_soak.py [--procs 4] [--duration 600] [--dir D] [--bound-blocks 24] [--docs 24]

Each worker process opens its own `KVTier` on the directory (as replicas or restarted servers do) and
loops: pick a "document" (a chain of `--blocks` blocks, skewed towards a few hot ones), look its blocks up,
load the leading run the tier has, and offer the rest (as the engine does after prefilling them). Every
block's K/V and token ids are a pure function of (document, block), so each loaded block is compared, bit
for bit, with its recomputation: a mismatch is a corrupt load. Files the tier itself rejects (checksum,
header, name) are counted too, and must stay 0 as well: nothing here corrupts files on purpose (the fault
tests in tests/kv_cache/test_kv_tier.py do). Prints one line per worker, then the totals; exit 1 on any
corrupt load or rejected file, or when a worker failed, loaded nothing or no eviction ran.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time

LAYERS, BS, HEADS, ROW = 4, 16, 2, 64
VOCAB = 1000
BLOCK_BYTES = 2 * LAYERS * BS * HEADS * ROW * 2  # K and V, float16 (the file adds its header and token ids)


def name(doc: int, j: int) -> bytes:
    """A chain hash as the block manager's: covers the document and every earlier block."""
    return hashlib.sha256(f"soak/{doc}/{j}".encode()).digest()


def block(doc: int, j: int):
    """(token ids, K, V) of block j of a document: a pure function of (doc, j)."""
    import torch

    g = torch.Generator().manual_seed(doc * 10_007 + j)
    toks = tuple(int(t) for t in torch.randint(0, VOCAB, (BS,), generator=g))
    k = torch.randn(LAYERS, 1, BS, HEADS, ROW, generator=g).to(torch.float16)
    v = torch.randn(LAYERS, 1, BS, HEADS, ROW, generator=g).to(torch.float16)
    return toks, k, v


def worker(a: argparse.Namespace) -> int:
    import torch

    from kvlm.kv_cache import snapshot
    from kvlm.kv_cache.tier import KVTier

    # the engine's own header for a base-model float16 cache (model "tier-soak"), so a new snapshot field
    # reaches the soak as it reaches the engine
    header = snapshot.snapshot_header("tier-soak", "float16", torch.float16, BS, LAYERS, HEADS, ROW)
    tier = KVTier(a.dir, a.bound_blocks * (BLOCK_BYTES + 1024), header, VOCAB, BLOCK_BYTES)
    rng = random.Random(a.seed)
    end = time.monotonic() + a.duration
    loads = lookups = offered = bad = 0
    while time.monotonic() < end:
        doc = min(int(rng.expovariate(1 / (a.docs / 4))), a.docs - 1)  # skewed: a few hot documents
        names = [name(doc, j) for j in range(a.blocks)]
        blocks = [block(doc, j) for j in range(a.blocks)]
        lookups += 1
        n = tier.lookup(names)
        m = 0
        if n:
            k, v = tier.load_run(names[:n], [b[0] for b in blocks[:n]])
            m = k.shape[1] if k.ndim > 1 else 0
            for j in range(m):
                if not (torch.equal(k[:, j : j + 1], blocks[j][1]) and torch.equal(v[:, j : j + 1], blocks[j][2])):
                    bad += 1
            loads += m
        for j in range(m, a.blocks):  # "prefilled": stored, as the engine stores what it computed
            toks, k, v = blocks[j]
            if a.tamper:  # the check's own test: a valid file (checksum, name, tokens) holding other K/V
                k = block(doc, j + 1)[1]
            if tier.offer(names[j], toks, k, v):
                offered += 1
    tier.flush(timeout=60)
    st = tier.stats
    print(json.dumps({"pid": os.getpid(), "lookups": lookups, "loads": loads, "offered": offered,
                      "stores": st.stored_blocks, "dropped": st.dropped_blocks, "evictions": st.evicted_files,
                      "rejected": st.corrupt_files, "corrupt": bad,
                      "load_mb_s": round(st.hit_bytes / 2**20 / st.load_s, 1) if st.load_s else None,
                      "store_mb_s": round(st.stored_bytes / 2**20 / st.store_s, 1) if st.store_s else None}),
          flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--duration", type=float, default=600.0, help="seconds each worker runs")
    p.add_argument("--dir", default=None, help="the tier directory (default: a new temporary one)")
    p.add_argument("--bound-blocks", type=int, default=24, help="the tier's bound, in blocks")
    p.add_argument("--docs", type=int, default=24, help="documents (of --blocks blocks each)")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tamper", action="store_true", help=argparse.SUPPRESS)  # worker 0 stores wrong K (a test)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    with tempfile.TemporaryDirectory(prefix="kvlm-tier-soak-") as tmp:
        d = a.dir or tmp
        print(f"tier soak: {a.procs} processes x {a.duration:g} s on {d}, bound {a.bound_blocks} blocks, "
              f"{a.docs} documents of {a.blocks} blocks", flush=True)
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--dir", d, "--duration", str(a.duration),
                                   "--bound-blocks", str(a.bound_blocks), "--docs", str(a.docs),
                                   "--blocks", str(a.blocks), "--seed", str(a.seed * 1000 + i),
                                   *(["--tamper"] if a.tamper and i == 0 else [])],
                                  stdout=subprocess.PIPE, text=True) for i in range(a.procs)]
        results, failed = [], 0
        for pr in procs:
            out, _ = pr.communicate()
            line = out.strip().splitlines()[-1] if out.strip() else ""
            if pr.returncode != 0 or not line.startswith("{"):
                failed += 1
                print(f"worker {pr.pid}: exit {pr.returncode}", flush=True)
                continue
            results.append(json.loads(line))
            print("worker " + line, flush=True)
        tot = {k: sum(r[k] for r in results) for k in ("lookups", "loads", "stores", "dropped", "evictions",
                                                        "rejected", "corrupt")}
        print("total " + json.dumps(tot), flush=True)
        problems = [why for bad, why in ((failed, f"{failed} workers failed"), (tot["corrupt"], "corrupt loads"),
                                         (tot["rejected"], "files rejected by validation"),
                                         (not tot["loads"], "nothing loaded"), (not tot["evictions"], "no eviction"))
                    if bad]
        print("FAIL: " + "; ".join(problems) if problems else "OK: corrupt 0", flush=True)
        return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
