"""`kvlm cache save MODEL "prompt" FILE` and the `--prefix-snapshot FILE` flag that `generate`, `chat`
(and the server's `serve`) share: save a prompt's K/V to a safetensors snapshot, load one at start.

Only a consumer of the library (`LLM.save_prefix` / `LLM.load_prefix`); errors are `SnapshotError`
lines, turned into `kvlm: error: ...` and exit code 1 by `kvlm.cli.main.main`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from kvlm.args import add_engine_args, engine_kwargs_from_args
from kvlm.cli.lora import add_lora_flag, load_lora_flags
from kvlm.errors import ParameterError

if TYPE_CHECKING:
    from kvlm.engine.engine import Engine


def add_prefix_snapshot_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix-snapshot", metavar="FILE", default=None,
                   help="load a KV snapshot (from `kvlm cache save`) into the prefix cache before serving prompts "
                        "(default: none)")


def load_prefix_snapshot(engine: Engine, path: str | None, quiet: bool = False) -> None:
    """Load `path` (if given) into the engine's prefix cache and say so on stderr."""
    if path is None:
        return
    info = engine.load_prefix(path)
    if not quiet:
        print(f"kvlm: prefix snapshot {info.path}: {info.num_tokens} tokens in {info.num_blocks} blocks "
              f"({info.blocks_loaded} loaded, the rest already cached)", file=sys.stderr)


def cmd_cache_save(a: argparse.Namespace) -> int:
    from kvlm.llm import LLM

    if len(a.lora) > 1:
        raise ParameterError("lora", "--lora: a snapshot holds one adapter's K/V: give --lora once")
    llm = LLM(a.model, quiet=a.quiet, **engine_kwargs_from_args(a))
    lora = (load_lora_flags(llm.llm_engine, a.lora, a.quiet) or [None])[0]
    prompt: Any = a.prompt
    if a.chat:
        prompt = {"prompt_token_ids": llm.render_chat([{"role": "system", "content": a.prompt}],
                                                      add_generation_prompt=False)}
    info = llm.save_prefix(prompt, a.file, lora=lora)
    print(json.dumps({"file": info.path, "tokens": info.num_tokens, "blocks": info.num_blocks, "lora": lora}))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cache", help="KV snapshots: save a prompt's K/V to a file (load with --prefix-snapshot)")
    csub = p.add_subparsers(dest="cache_command", required=True)
    s = csub.add_parser("save", help="compute a prompt's K/V and write its full blocks to a safetensors file")
    s.add_argument("model", help="model alias or path")
    s.add_argument("prompt", help="the prefix to save (text)")
    s.add_argument("file", help="output .safetensors file")
    s.add_argument("--chat", action="store_true", help="save the prompt rendered as a chat system message")
    add_lora_flag(s, "the K/V are computed under it and the file records it (at most one; load the snapshot "
                     "with the same adapter loaded)")
    add_engine_args(s)
    s.set_defaults(func=cmd_cache_save)
