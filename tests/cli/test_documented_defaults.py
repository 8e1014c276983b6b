"""The defaults the docs and `--help` state are the code's defaults.

The flag paragraph ("`--block-size` (default 16)", in docs/usage.md, where the README's reference moved, read
here with the README and the other pages it split into), docs/server.md's options table and its other
stated numbers are parsed and compared with `kvlm.cli.main.build_parser()`'s defaults, and the parser's
defaults with `EngineConfig()` / `SamplingParams()` field defaults; every flag's `--help` shows its default.
A doc that states a default the code does not have fails here.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kvlm.args import engine_config_from_args, sampling_params_from_args
from kvlm.cli.main import build_parser
from kvlm.config import EngineConfig
from kvlm.sampling_params import SamplingParams
from kvlm.server.protocol import COMPLETION_DEFAULT_MAX_TOKENS
from kvlm.server.serving import ServingOptions

ROOT = Path(__file__).resolve().parents[2]
# The README and the pages its reference sections moved to, read as one text.
README = "\n".join((ROOT / p).read_text() for p in ("README.md", "docs/usage.md", "docs/prefix_cache.md",
                                                     "docs/serving.md"))
SERVER_MD = (ROOT / "docs" / "server.md").read_text()
COMMANDS = ["generate", "chat", "serve", "kv-size", "info", "pull", "cache save"]


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def command(name: str) -> argparse.ArgumentParser:
    parser = _subparsers(build_parser(name.split()))
    words = name.split()
    for w in words[:-1]:
        parser = _subparsers(parser[w])
    return parser[words[-1]]


def action(cmd: str, flag: str) -> argparse.Action:
    return next(a for a in command(cmd)._actions if flag in a.option_strings)


def shown_help(parser: argparse.ArgumentParser, a: argparse.Action) -> str:
    """The action's help as `--help` prints it (defaults filled in), on one line."""
    text = parser._get_formatter()._expand_help(a) if a.help else ""
    return " ".join(text.split())


def same(doc: str, a: argparse.Action, help_text: str) -> bool:
    """Does a default as a doc states it ("16", "2,000,000", "auto", "cuda when available") match the parser?
    A default of None is a phrase: `--help` must say the same."""
    if a.default is None:
        return doc.lower() in help_text.lower()
    try:
        return float(doc.replace(",", "")) == float(a.default)
    except ValueError:
        return doc == str(a.default)


def readme_defaults() -> dict[str, str]:
    """`--flag ...` (default X...) in README.md: flag -> X, X ending at the first ',', ';', ':' or ')'."""
    out = {}
    parts = re.split(r"`(--[a-z0-9-]+)[^`]*`", README)
    for flag, after in zip(parts[1::2], parts[2::2]):
        m = re.match(r"\s*\(([^)]*)", after)
        d = re.search(r"\bdefault ([^,;:)]+)", m.group(1)) if m else None
        if d:
            out[flag] = d.group(1).strip()
    return out


def server_table() -> list[tuple[str, str]]:
    """(flag, default) from docs/server.md's options table: '| `--host`, `--port` | 127.0.0.1, 8000 |'."""
    rows = []
    for line in SERVER_MD.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        flags = re.findall(r"`(--[a-z-]+)`", cells[0]) if len(cells) >= 2 else []
        if not flags or not cells[1]:
            continue
        values = cells[1].split(", ")  # "2,000,000" has no space: one value
        assert len(values) == len(flags), line
        rows += zip(flags, values)
    return rows


def test_readme_states_defaults_of_the_flags_it_lists() -> None:
    stated = readme_defaults()
    assert {"--max-tokens", "--temperature", "--block-size", "--max-num-seqs", "--dtype", "--kv-cache-dtype",
            "--kv-cache-memory", "--device", "--max-model-len"} <= set(stated)  # the parse found them
    for flag, doc in stated.items():
        a = action("generate", flag)
        assert same(doc, a, shown_help(command("generate"), a)), f"README: {flag} default {doc!r}, code {a.default!r}"
    m = re.search(r"`--max-tokens` \(default \d+;\s+`kvlm chat` (\d+)\)", README)
    assert m and int(m.group(1)) == action("chat", "--max-tokens").default


def test_readme_other_stated_defaults() -> None:
    host, port = re.search(r"binds ([0-9.]+):(\d+) by default", README).groups()
    assert (host, int(port)) == (action("serve", "--host").default, action("serve", "--port").default)
    assert re.search(r"\(`--block-size`, (\d+) tokens\)", README).group(1) == str(EngineConfig().block_size)
    assert "`auto` (the default) is the compute dtype, float32 on CPU" in README
    assert EngineConfig().kv_cache_dtype == "auto" and EngineConfig().kv_cache_dtype_name == "float32"
    t, n = re.search(r"`SamplingParams\(\)` in Python keeps vLLM's defaults \(temperature (\S+), max_tokens\s+(\d+)\)",
                     README).groups()
    assert (float(t), int(n)) == (SamplingParams().temperature, SamplingParams().max_tokens)


def test_server_md_options_table() -> None:
    rows = server_table()
    assert {f for f, _ in rows} >= {"--host", "--port", "--max-logprobs", "--max-n", "--max-body-bytes",
                                    "--served-model-name", "--api-key", "--max-queued-requests"}
    serve = command("serve")
    for flag, doc in rows:
        a = action("serve", flag)
        assert same(doc, a, shown_help(serve, a)), f"docs/server.md: {flag} default {doc!r}, code {a.default!r}"


def test_server_md_other_stated_defaults() -> None:
    m = re.search(r"Without `max_tokens`, `/v1/completions` generates (\d+) tokens", SERVER_MD)
    assert m and int(m.group(1)) == COMPLETION_DEFAULT_MAX_TOKENS
    opts = ServingOptions(["m"])
    stops, chars = re.search(r"At most (\d+) stop strings of at most (\d+) characters", SERVER_MD).groups()
    assert (int(stops), int(chars)) == (opts.max_stop, opts.max_stop_len)
    assert (action("serve", "--max-logprobs").default, action("serve", "--max-n").default) == (opts.max_logprobs,
                                                                                              opts.max_n)
    m = re.search(r"default engine flags \(`--max-num-seqs (\d+)`\)", SERVER_MD)
    assert m and int(m.group(1)) == EngineConfig().max_num_seqs


@pytest.mark.parametrize("cmd", ["generate", "chat", "serve", "cache save"])
def test_engine_flag_defaults_are_engine_config_defaults(cmd: str) -> None:
    words = {"generate": ["hi"], "chat": [], "serve": [], "cache save": ["m", "p", "f"]}[cmd]
    args = build_parser(cmd.split()).parse_args([*cmd.split(), *words])
    assert engine_config_from_args(args) == EngineConfig()


@pytest.mark.parametrize("cmd", ["generate", "chat"])
def test_sampling_flag_defaults_are_sampling_params_defaults_but_greedy(cmd: str) -> None:
    args = build_parser([cmd]).parse_args([cmd, "hi"] if cmd == "generate" else [cmd])
    cli, lib = sampling_params_from_args(args), SamplingParams()
    differ = {f for f in SamplingParams.__dataclass_fields__ if getattr(cli, f) != getattr(lib, f)}
    assert differ == {"temperature", "max_tokens"}  # what README says the command line changes
    assert cli.temperature == 0


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_flag_help_shows_its_default(cmd: str) -> None:
    parser = command(cmd)
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction) or (not a.option_strings and a.nargs not in ("?", "*")):
            continue
        text = shown_help(parser, a)
        name = a.option_strings[0] if a.option_strings else a.dest
        assert "default" in text.lower(), f"kvlm {cmd} --help: {name} shows no default: {text!r}"
        if a.default is not None and a.nargs != 0:
            assert str(a.default) in text, f"kvlm {cmd} --help: {name} says {text!r}, default is {a.default!r}"
