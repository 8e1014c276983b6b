"""Which pages of a memory-mapped model file stay in the process's resident set.

Weights computed on in place (`--dtype auto`) are views of the mapped GGUF file, and a page of it
becomes resident (counted in RSS) when first read. Loading also reads pages that the model never
reads again: the metadata (the tokenizer's vocabulary is walked at every start), the Q/K/V matrices
that are un-permuted and stacked into a copy, the norms converted to float32. `release_unused`
drops those pages from this process's page tables (`madvise(MADV_DONTNEED)`): ~12 MB of the default
model. For a read-only file mapping that only forgets the mapping (a later read faults the page back
in from the page cache), so it is safe; it is applied only inside mappings of the named file, found
in /proc/self/maps. Elsewhere than Linux it does nothing. It knows nothing about models: callers name
the byte ranges still in use.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4  # Linux


def file_mappings(path: Path) -> list[tuple[int, int]]:
    """[start, end) address ranges where this process maps `path` (from /proc/self/maps)."""
    target = os.path.realpath(path)
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].rstrip("\n") == target:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    out.append((lo, hi))
    except OSError:
        return []
    return out


def _madvise() -> Any:
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


def drop_pages(lo: int, hi: int) -> int:
    """Drop the whole pages inside [lo, hi), addresses in a read-only file mapping, from this process (a
    weight packed into new memory: its file bytes are never read again); returns the bytes released."""
    a, b = -(-lo // _PAGE) * _PAGE, hi // _PAGE * _PAGE
    if not sys.platform.startswith("linux") or b <= a:
        return 0
    return b - a if _madvise()(a, b - a, _MADV_DONTNEED) == 0 else 0


def release_unused(path: Path, used: Iterable[tuple[int, int]]) -> int:
    """Drop the resident pages of `path`'s mappings (those holding some of `used`) outside the `used`
    [start, end) address ranges, widened to whole pages; returns the bytes of address range released."""
    if not sys.platform.startswith("linux"):
        return 0
    keep = sorted((lo // _PAGE * _PAGE, -(-hi // _PAGE) * _PAGE) for lo, hi in used)
    # Only mappings holding some of `used`: another engine in this process may map the same file.
    maps = [(a, b) for a, b in file_mappings(path) if any(a <= lo < b for lo, _ in keep)]
    if not maps:
        return 0
    madvise = _madvise()
    released = 0
    for start, end in maps:
        pos = start
        for lo, hi in keep + [(end, end)]:
            lo, hi = min(max(lo, start), end), min(max(hi, start), end)
            if lo > pos and madvise(pos, lo - pos, _MADV_DONTNEED) == 0:
                released += lo - pos
            pos = max(pos, hi)
            if pos >= end:
                break
    return released
