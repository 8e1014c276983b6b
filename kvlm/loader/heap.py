"""The C heap (glibc) between a model's load and its steps: what it gives back, and what it keeps.

**After the load, give back.** Loading leaves tens of megabytes free but resident in glibc's heap: the
tokenizer's JSON parse (the Rust side builds ~20 MB of temporary strings for a 49k-token vocabulary and
its merges), the GGUF header parse and the load's small copies. glibc keeps freed memory for reuse and
gives back only the top of the heap, so without a trim that memory stays in the process's RSS for its
whole life. `malloc_trim(0)` releases every free page (measured: ~25 MB at start, ~10 MB off the peak of a
chat turn with the default model).

**Between steps, keep.** A step allocates its activations as tensors of 1 to 32 MiB (a 512-token prefill
of Llama-3.2-1B's shape: about 0.5 GB of them) and frees them when it ends. glibc's defaults hand much of
that back to the kernel: blocks above an adaptive threshold are mmap'd and unmapped at free, and the
heap's top is trimmed once its free part passes twice that threshold. The next step then takes a page
fault for every 4 KiB and the kernel zeroes each page again. The threshold adapts to the order blocks
were freed in, so the same prefill ran at one of two speeds from process to process (the default model,
512 tokens: 0.16-0.18 s with ~6,000 faults, or 0.26-0.32 s with 80,000-120,000). `keep_freed_memory`
fixes the thresholds once per process: blocks below 32 MiB (glibc's largest mmap threshold) come from the
heap, the heap grows in 64 MiB steps and is trimmed only past 512 MiB free at its top (`trim_heap` still
releases everything when called). The rerunnable measure is `kvlm bench compare` with `KVLM_MALLOC=default`
and without (docs/startup.md: Zen 5, AVX-512 VNNI path, 1B Q4_K_M prefill 512 252 -> 366 tok/s). A one-off
script (a 512-token prefill, 5 repeats, fresh processes, the same machine and path) also counted the
faults: the 1B Q4_0 ~120,000 -> ~10,000 per prefill, 1.20-1.43 s -> 1.04-1.07 s, peak RSS 1,225 ->
1,256-1,286 MiB; the default model 0.18-0.26 s -> 0.157-0.166 s. The cost: memory a step freed stays in
the process (up to 512 MiB of free heap) instead of going back between steps. No arithmetic changes, so
no bit does. KVLM_MALLOC=default keeps glibc's own thresholds.

Elsewhere (macOS, musl) both are no-ops. This module knows nothing about models.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

# mallopt's parameters (malloc.h) and the values keep_freed_memory sets
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
KEEP = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 512 << 20), (M_TOP_PAD, 64 << 20))
ENV = "KVLM_MALLOC"


@functools.cache
def _glibc(name: str) -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        # The process's own symbols, libc's among them (ctypes.util.find_library would spawn ldconfig).
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):  # not glibc
        return None


def trim_heap() -> bool:
    """Give the heap's free pages back to the OS; True where glibc did it."""
    trim = _glibc("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def keep_freed_memory() -> bool:
    """Set KEEP through glibc's mallopt, once per process; True where they are in effect."""
    mallopt = _glibc("mallopt")
    if mallopt is None or os.environ.get(ENV, "") == "default":
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in KEEP)
