"""The `kvlm` command line: pull, generate, chat, info, kv-size, cache, serve, bench.

Only a consumer of the library (`LLM`, `Engine`, `SamplingParams`): each command lives in its own module
of this package (`generate.py`, `chat.py`, `info.py`, `snapshot.py`, `serve.py`; the benchmarks in
`kvlm.bench`) with an `add_parser` and a `cmd_*`. User mistakes (bad flags, unknown models, broken files,
prompts that do not fit) print one line on stderr and exit 2 (usage) or 1 (runtime); there is no
traceback for them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, NoReturn

from kvlm.args import DefaultsHelpFormatter
from kvlm.cli import chat, generate, info, serve, snapshot
from kvlm.errors import KvlmError


class _Parser(argparse.ArgumentParser):
    """argparse with our error contract: one line `kvlm: error: ...` on stderr and exit 2 (no usage dump;
    `--help` still shows it), and every option's default in `--help`. Subcommand parsers inherit the class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)  # every flag's help shows its default
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        print(f"kvlm: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser. `argv` (default: the command line) only decides whether the `bench` subcommands
    are built: several import torch at module level, which `kvlm --help` or `kvlm generate` need not pay
    for while parsing (generate imports torch later, with the engine)."""
    p = _Parser(prog="kvlm", description="A small, exact LLM inference engine built around the KV cache.")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress or cache log on stderr")
    sub = p.add_subparsers(dest="command", required=True)
    info.add_pull_parser(sub)
    generate.add_parser(sub)
    chat.add_parser(sub)
    info.add_parsers(sub)
    serve.add_parser(sub)
    snapshot.add_parser(sub)
    from kvlm.bench import BENCH_HELP, add_bench_parser

    words = [w for w in (sys.argv[1:] if argv is None else argv) if not w.startswith("-")]
    if words[:1] == ["bench"]:
        add_bench_parser(sub)
    else:  # listed in `kvlm --help`; its subcommands are built when the command line asks for them
        sub.add_parser("bench", help=BENCH_HELP)
    return p


def main(argv: list[str] | None = None, *, freeze_after_load: bool = False) -> int:
    """Parse `argv` (default: the command line) and run its command; returns the exit code.
    freeze_after_load: this process only runs the command (see `loading`)."""
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    # argparse takes a command's positional words in one run, so `generate MODEL --max-tokens 3 PROMPT`
    # leaves PROMPT over: words after options belong to the same positional list.
    if extra and isinstance(getattr(args, "inputs", None), list) and not any(x.startswith("-") for x in extra):
        args.inputs += extra
    elif extra:
        print(f"kvlm: error: unrecognized arguments: {' '.join(extra)} (see `kvlm {args.command} --help`)",
              file=sys.stderr)
        return 2
    args.freeze_after_load = freeze_after_load
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except KvlmError as e:
        flag = {"num_threads": "--threads: "}.get(getattr(e, "param", ""), "")  # where the flag's name differs
        print(f"kvlm: error: {flag}{e}", file=sys.stderr)
        return e.exit_code
    except (ValueError, OverflowError) as e:  # invalid values, bad prompts: usage errors
        print(f"kvlm: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"kvlm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def run() -> None:
    """The `kvlm` command: `main()`, then exit without the interpreter's teardown.

    Tearing down a process that imported torch takes about 0.4 s (module and extension finalizers, the
    thread pool); a command has nothing left to clean up once `main` returns (files are closed, the
    server has drained), so it flushes its streams and leaves with `os._exit`."""
    try:
        code = main(freeze_after_load=True)
    except SystemExit as e:  # argparse's --help / usage errors
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (e.g. `kvlm ... | head`)
            pass
    os._exit(code)
