"""The benchmark scaffold (`kvlm/bench/common.py`): every command registers one `Bench`, `main` prints the
table and then one JSON line (with the plot's path when one was drawn), `python -m kvlm.bench.NAME` takes
the same flags, and dtype choices come from `kvlm.config.KV_DTYPES`."""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvlm.bench import COMMANDS
from kvlm.bench.common import KV_CACHE_DTYPES, Bench, dtype_choices, main, register
from kvlm.config import KV_DTYPES

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_is_one_bench(name: str) -> None:
    b = importlib.import_module(f"kvlm.bench.{name}").BENCH
    assert isinstance(b, Bench) and b.name == name and b.help
    p = argparse.ArgumentParser()
    b.add_args(p)
    has_plot = any("--plot" in a.option_strings for a in p._actions)
    assert has_plot == (b.plot is not None), name  # a --plot flag exactly when the Bench can draw


def _fake(plot_path: str | None, drawn: list[str]) -> Bench:
    """A Bench whose plot records the --plot it was given and returns plot_path."""
    def add_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--plot", default=None)

    def plot(d: dict[str, Any], path: str) -> str | None:
        drawn.append(path)
        return plot_path

    return Bench("fake", "a fake", add_args, lambda a: {"bench": "fake", "n": 1},
                 lambda d: print(f"table {sorted(d)}"), plot)


@pytest.mark.parametrize("plot_path", ["out.png", None])
def test_main_prints_the_table_then_one_json_line(plot_path: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    drawn: list[str] = []
    sub = argparse.ArgumentParser().add_subparsers(dest="bench")
    b = _fake(plot_path, drawn)
    register(sub, b)
    args = sub.choices["fake"].parse_args(["--plot", "x.png"])
    assert args.func(args) == 0
    out = capsys.readouterr().out.splitlines()
    doc = json.loads(out[-1])
    assert drawn == ["x.png"]
    if plot_path is None:  # nothing to draw: no "plot" key
        assert doc == {"bench": "fake", "n": 1} and out[0] == "table ['bench', 'n']"
    else:  # the plot is drawn before the table, so the table sees its path
        assert doc == {"bench": "fake", "n": 1, "plot": "out.png"} and out[0] == "table ['bench', 'n', 'plot']"
    drawn.clear()
    assert main(b, sub.choices["fake"].parse_args([])) == 0 and not drawn  # no --plot: plot is not called


def test_dtype_choices_are_dtypes() -> None:
    assert set(KV_CACHE_DTYPES) == set(KV_DTYPES)
    assert dtype_choices("float32", "bfloat16") == ("float32", "bfloat16")
    with pytest.raises(ValueError, match="int2"):
        dtype_choices("float32", "int2")


def test_standalone_has_the_same_flags_and_error_contract() -> None:
    from concurrent.futures import ThreadPoolExecutor

    def run(argv: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=120, cwd=ROOT)

    helps = [(f"kvlm.bench.{name}", "--help") for name in ("waste", "prefix", "serve")]
    bad_args = [("kvlm.bench.kernels", "--rows", "x"), ("kvlm", "bench", "kernels", "--rows", "x")]
    with ThreadPoolExecutor(max_workers=len(helps) + len(bad_args)) as pool:  # ~2 s of imports each: at once
        *helped, bad, bad_cli = pool.map(run, [*helps, *bad_args])
    for (module, _), done in zip(helps, helped):
        assert f"usage: python -m {module}" in done.stdout
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "kvlm: error: --rows must be comma-separated integers, got 'x'")
    assert bad_cli.stderr == bad.stderr


def test_background_load_runs_and_stops_its_processes() -> None:
    import os

    from kvlm.bench.common import background_load
    from kvlm.engine.threads import read_cpu_sample

    def children() -> set[str]:
        return {p for p in os.listdir("/proc") if p.isdigit() and _parent(p) == os.getpid()}

    others = children()  # a session server another test file started, if any: not background_load's
    before = read_cpu_sample()
    with background_load(2):
        kids = children() - others
        assert len(kids) >= 2
    after = read_cpu_sample()
    assert before is not None and after is not None and after.busy > before.busy
    assert all(not os.path.exists(f"/proc/{k}") or _state(k) == "Z" for k in kids)


def _parent(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _state(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
