"""ThreadGovernor: fewer threads while other processes keep cores busy, back when they leave, hands off
when the caller sets the thread count itself; and the real /proc reader sees a competing process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvlm.engine.threads import CpuSample, ThreadGovernor, read_cpu_sample


class FakeMachine:
    """Two CPUs; each `advance(others, own)` adds that many busy cores of other processes and of ours
    over one 0.5 s interval (100 jiffies a second per CPU)."""

    def __init__(self) -> None:
        self.busy = self.total = self.own = 0
        self.t = 0.0
        self.threads = 2

    def sample(self) -> CpuSample:
        return CpuSample(self.busy, self.total, self.own)

    def advance(self, others: float, own: float) -> None:
        self.t += 0.5
        self.total += 2 * 50
        self.busy += int((others + own) * 50)
        self.own += int(own * 50)

    def governor(self) -> ThreadGovernor:
        return ThreadGovernor(2, cpus=2, read=self.sample, get_threads=lambda: self.threads,
                              set_threads=self._set, clock=lambda: self.t)

    def _set(self, n: int) -> None:
        self.threads = n


def test_drops_to_the_free_cores_and_comes_back() -> None:
    m = FakeMachine()
    g = m.governor()
    m.advance(others=0.05, own=2.0)  # quiet: our two threads
    assert g.tick() is None and m.threads == 2
    m.advance(others=1.0, own=1.0)  # another process holds a core
    assert g.tick() == 1 and m.threads == 1
    m.advance(others=1.0, own=1.0)
    assert g.tick() is None and m.threads == 1
    m.advance(others=0.1, own=1.0)  # it left
    assert g.tick() == 2 and m.threads == 2


def test_waits_for_its_interval() -> None:
    m = FakeMachine()
    g = m.governor()
    m.advance(others=1.0, own=1.0)
    m.t -= 0.3  # not half a second yet
    assert g.tick() is None and m.threads == 2


def test_never_below_one_nor_above_its_maximum() -> None:
    m = FakeMachine()
    g = m.governor()
    m.advance(others=2.0, own=0.2)  # both cores taken by others
    assert g.tick() == 1
    m.advance(others=0.0, own=1.0)
    assert g.tick() == 2
    m.advance(others=0.0, own=2.0)
    assert g.tick() is None and m.threads == 2


def test_steps_aside_when_the_caller_sets_threads() -> None:
    m = FakeMachine()
    g = m.governor()
    m.threads = 1  # torch.set_num_threads(1) by the caller
    m.advance(others=0.0, own=1.0)
    assert g.tick() is None and m.threads == 1 and not g.active
    m.advance(others=0.0, own=1.0)
    assert g.tick() is None and m.threads == 1


@pytest.mark.skipif(read_cpu_sample() is None, reason="no /proc here")
def test_real_reader_sees_a_competing_process() -> None:
    """With one CPU-bound process beside us, /proc shows about a core busy that is not ours."""
    before = read_cpu_sample()
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)
        after = read_cpu_sample()
    finally:
        hog.kill()
        hog.wait()
    assert before is not None and after is not None
    cpus = os.cpu_count() or 1
    others = (after.busy - before.busy - (after.own - before.own)) / (after.total - before.total) * cpus
    assert others > 0.5, others
    assert after.own >= before.own


def test_engine_flag(tiny_gguf) -> None:
    from kvlm import EngineConfig
    from kvlm.engine.engine import Engine

    assert Engine(tiny_gguf, EngineConfig(), quiet=True).governor is not None
    assert Engine(tiny_gguf, EngineConfig(adaptive_threads=False), quiet=True).governor is None
    with pytest.raises(ValueError, match="adaptive_threads"):
        EngineConfig(adaptive_threads="yes")  # type: ignore[arg-type]
