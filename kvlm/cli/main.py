"""The `kvlm` command line: pull, generate, chat, info, kv-size, cache, serve, bench.

Only a consumer of the library (`LLM`, `Engine`, `SamplingParams`): each command lives in its own module
of this package (`generate.py`, `chat.py`, `info.py`, `snapshot.py`, `serve.py`; the benchmarks in
`kvlm.bench`) with an `add_parser` and a `cmd_*`. User mistakes (bad flags, unknown models, broken files,
prompts that do not fit) print one line on stderr and exit 2 (usage) or 1 (runtime); there is no
traceback for them, and a bad value is named by the flag the user typed (`--max-tokens`), not the
library's field (`max_tokens`). The global `-q` / `-v` work before or after the subcommand.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, NoReturn

from kvlm.args import DefaultsHelpFormatter
from kvlm.cli import chat, generate, info, serve, snapshot
from kvlm.errors import KvlmError, ParameterError

# Library fields whose flag is not `--` + the field with dashes (the rest are found on the parser).
_FLAG_OF = {"num_threads": "--threads", "enable_kv_cache": "--no-kv-cache",
            "enable_prefix_caching": "--no-prefix-caching", "adaptive_threads": "--no-adaptive-threads"}


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
    _add_global_flags(p, False)
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
    for sp in _subparsers(p):  # the global flags work after the subcommand too
        _add_global_flags(sp, argparse.SUPPRESS)
    return p


def _add_global_flags(p: argparse.ArgumentParser, default: Any) -> None:
    """-q / -v. On a subcommand's parser their default is SUPPRESS: argparse copies a subparser's values over
    the main parser's, so a default there would undo `kvlm -q generate ...`."""
    p.add_argument("-q", "--quiet", action="store_true", default=default,
                   help="no progress or log lines on stderr (default: off)")
    p.add_argument("-v", "--verbose", action="store_true", default=default,
                   help="also log the KV pool's size and other engine details on stderr (default: off)")


def _subparsers(p: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every subcommand's parser under `p`, nested ones (`cache save`, `bench ...`) included."""
    out = []
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                out += [sp, *_subparsers(sp)]
    return out


def _flag_for(parser: argparse.ArgumentParser, command: str | None, param: str) -> str | None:
    """The flag a user typed for the library field `param` (`max_tokens` -> `--max-tokens`), if the command has one."""
    flags = {o for sp in [parser, *_subparsers(parser)] if command is None or sp.prog.split()[1:2] == [command]
             for a in sp._actions for o in a.option_strings}
    flag = _FLAG_OF.get(param, "--" + param.replace("_", "-"))
    return flag if flag in flags else None


def error_line(e: KvlmError, parser: argparse.ArgumentParser, command: str | None) -> str:
    """A library error as the CLI says it: a ParameterError's field becomes the flag the user typed
    ("--max-tokens must be a positive integer, got 0"), and "or None" (a library-only value) is dropped."""
    msg = str(e)
    param = getattr(e, "param", None) if isinstance(e, ParameterError) else None
    flag = _flag_for(parser, command, param) if param else None
    if flag is None or msg.startswith(flag):
        return msg
    msg = msg.replace(" or None", "")
    if msg.startswith(param):
        return flag + msg[len(param):]
    return f"{flag}: {msg}"


def main(argv: list[str] | None = None, *, freeze_after_load: bool = False) -> int:
    """Parse `argv` (default: the command line) and run its command; returns the exit code.
    freeze_after_load: this process only runs the command (see `loading`)."""
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    # argparse takes a command's positional words in one run, so `generate MODEL --max-tokens 3 PROMPT`
    # leaves PROMPT over: words after options belong to the same positional list.
    flags = [x for x in extra if x.startswith("-") and x != "-"]  # a lone "-" is a word: the prompt from stdin
    if extra and isinstance(getattr(args, "inputs", None), list) and not flags:
        args.inputs += extra
    elif extra:
        print(f"kvlm: error: unrecognized arguments: {' '.join(extra)} (see `kvlm {args.command} --help`)",
              file=sys.stderr)
        return 2
    args.freeze_after_load = freeze_after_load
    if args.quiet and args.verbose:
        print("kvlm: error: give -q or -v, not both", file=sys.stderr)
        return 2
    _setup_logging(args.quiet, args.verbose)
    try:
        return int(args.func(args) or 0)
    except KvlmError as e:
        print(f"kvlm: error: {error_line(e, parser, args.command)}", file=sys.stderr)
        return e.exit_code
    except (ValueError, OverflowError) as e:  # invalid values, bad prompts: usage errors
        print(f"kvlm: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"kvlm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _setup_logging(quiet: bool, verbose: bool) -> None:
    """-q: warnings only; default: progress lines (a first kernel build, a download); -v: also what the
    engine says at DEBUG (the KV pool's size, the backend and its reasons, prefix-cache misses)."""
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("kvlm").setLevel(logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO)


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
