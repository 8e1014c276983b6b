"""Weights in 2 MiB pages (Linux transparent huge pages), so that a decode step's stream of them misses the TLB
512 times less often.

A decode step reads every weight matrix once, front to back. In 4 KiB pages a 3B Q4_K_M model's 1.8 GB span
~450,000 pages, and a core's TLB holds a few thousand entries, so each new 4 KiB of a stream costs a page
walk. In a virtual machine (KVM, any cloud host) a walk is two-dimensional, the guest's tables through the
host's, and costs several memory reads. 2 MiB pages cut the walks 512-fold. Measured on a 2-core Intel Xeon
under KVM (2026-12-06, docs/results/xeon_session27.txt): the same decode kernels on the same bytes
(`KVLM_AB_PAGES=huge scripts/kernel_ab/gbs.sh`) ran 1.35-2.26x (`avx512-amx`) and 1.62-4.49x (`avx2`) faster
from 2 MiB pages in their least disturbed rounds; `kvlm bench compare`'s read pass was 14-15 GB/s in 4 KiB
pages (`KVLM_HUGE_PAGES=0`) and 22-23 in 2 MiB ones in the same hour.

`empty(nbytes)` is anonymous memory, 2 MiB aligned and advised MADV_HUGEPAGE (under the kernel's default
`madvise` policy nothing else gets them). The loader puts the weight matrices a decode step reads there
(loader/gguf.py `_place_weights`), and `kvlm bench latency` / `compare` time their read pass there.

Nothing here changes a byte, so no bit of any result. KVLM_HUGE_PAGES=0 turns it off (plain torch.empty);
elsewhere than Linux, or where /sys/kernel/mm/transparent_hugepage/enabled says [never], it is off too. This
module knows nothing about models.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys

import torch

HUGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD size
MIN_BYTES = HUGE  # below this, `worth` says no: one partly used 2 MiB page gains nothing
ENV = "KVLM_HUGE_PAGES"


@functools.cache
def _kernel_allows() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def enabled() -> bool:
    """Whether this process asks for 2 MiB pages (Linux, THP not [never], KVLM_HUGE_PAGES not 0)."""
    return sys.platform.startswith("linux") and os.environ.get(ENV, "1") != "0" and _kernel_allows()


def worth(nbytes: int) -> bool:
    """Whether a buffer of nbytes should go in 2 MiB pages: `enabled()` and at least MIN_BYTES."""
    return nbytes >= MIN_BYTES and enabled()


def empty(nbytes: int) -> torch.Tensor:
    """An uninitialized (zero-filled) uint8 tensor of nbytes in anonymous memory starting on a 2 MiB boundary,
    advised MADV_HUGEPAGE; torch.empty where `enabled()` is False. Pages become resident when first
    written, 2 MiB at a time; the memory is unmapped when the last tensor viewing it is freed."""
    if not enabled():
        return torch.empty(nbytes, dtype=torch.uint8)
    size = -(-nbytes // HUGE) * HUGE
    m = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -_address(m) % HUGE  # the first 2 MiB boundary inside the mapping
    m.madvise(mmap.MADV_HUGEPAGE, start, size)
    return torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=start)  # keeps m alive


def _address(m: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(m)  # a buffer export for one call: released when `view` is collected
    try:
        return ctypes.addressof(view)
    finally:
        del view
