"""How many CPU threads the engine's steps use while other programs share the machine.

The kernels run on torch's OpenMP pool, whose idle threads spin at each barrier. When another program
holds a core, a step's worker is descheduled while the others spin waiting for it, and decode falls
by 2x to 30x (measured on a 2-core machine with one competing process: 112 tok/s at 2 threads, 250 at
1). No OpenMP wait policy fixes both sides: a passive pool loses a quarter of the quiet speed. So the
engine adapts instead: every `interval` seconds `ThreadGovernor` reads how much CPU time other
processes took (`/proc/stat` busy time minus this process's own, `/proc/self/stat`), and runs on the
cores left to it, `max_threads` at most and 1 at least; when the others leave, it goes back.

The thread count never changes a token's bits (every kernel fixes each output's order), so switching
between steps is safe. A governor whose thread count someone else changed (`torch.set_num_threads`
by the caller) steps aside for good: the caller took control. Plain Python; the readers are
injectable, so the policy is testable without a busy machine.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CpuSample:
    busy: int  # jiffies all CPUs spent busy (user, nice, system, irq, softirq, steal)
    total: int  # jiffies all CPUs spent, idle included
    own: int  # jiffies this process spent (user + system, all its threads)


def read_cpu_sample() -> CpuSample | None:
    """The machine's and this process's CPU time now, from /proc; None where there is no /proc."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
        with open("/proc/self/stat") as f:
            stat = f.read()
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    # /proc/self/stat: the command name may hold spaces; fields after it start at ")"
    after = stat[stat.rindex(")") + 2:].split()
    own = int(after[11]) + int(after[12])  # utime, stime (fields 14 and 15)
    busy = user + nice + system + irq + softirq + steal
    return CpuSample(busy, busy + idle + iowait, own)


class ThreadGovernor:
    """Sets torch's thread count to the cores other processes leave free (see the module docstring)."""

    def __init__(self, max_threads: int, *, interval: float = 0.5, cpus: int | None = None,
                 read: Callable[[], CpuSample | None] = read_cpu_sample,
                 get_threads: Callable[[], int] | None = None, set_threads: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if get_threads is None or set_threads is None:
            import torch

            get_threads, set_threads = torch.get_num_threads, torch.set_num_threads
        self.max_threads = max(1, max_threads)
        self.cpus = cpus or os.cpu_count() or 1
        self.interval = interval
        self._read, self._get, self._set, self._clock = read, get_threads, set_threads, clock
        self.threads = self.max_threads  # what the governor last asked for
        self.active = True
        self._last = read()
        self._next = clock() + interval
        if self._last is None:  # no /proc: nothing to measure
            self.active = False

    def tick(self) -> int | None:
        """Called once per engine step; returns the new thread count when it changed."""
        if not self.active or self._clock() < self._next:
            return None
        if self._get() != self.threads:  # somebody else set the thread count: theirs to keep
            self.active = False
            return None
        self._next = self._clock() + self.interval
        now = self._read()
        if now is None or self._last is None:
            return None
        prev, self._last = self._last, now
        d_total, d_busy, d_own = now.total - prev.total, now.busy - prev.busy, now.own - prev.own
        if d_total <= 0:
            return None
        others = max(0.0, (d_busy - d_own) / d_total * self.cpus)  # cores other processes kept busy
        want = max(1, min(self.max_threads, self.cpus - math.floor(others + 0.25)))
        if want == self.threads:
            return None
        self.threads = want
        self._set(want)
        return want
