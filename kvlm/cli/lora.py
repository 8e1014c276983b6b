"""The `--lora NAME=PATH[:SCALE]` flag that `kvlm generate` and `kvlm serve` share: LoRA adapters loaded at
start (PEFT folders or GGUF LoRA files), each a line in the log with its load time."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI builds every subcommand's flags at start: torch is imported only when one runs
    from kvlm.engine.engine import Engine


def add_lora_flag(p: argparse.ArgumentParser, help_use: str) -> None:
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH[:SCALE]",
                   help=f"load a LoRA adapter (PEFT folder or GGUF LoRA file; repeatable); {help_use}")


def load_lora_flags(engine: Engine, specs: list[str], quiet: bool) -> list[str]:
    """Load every `--lora`; their names, in order. A bad one is one `LoRAError` line (the CLI exits)."""
    from kvlm.lora import parse_lora_spec

    names = []
    for spec in specs:
        name, path, scale = parse_lora_spec(spec)
        t0 = time.perf_counter()
        a = engine.load_lora(name, path, scale)
        names.append(name)
        if not quiet:
            print(f"kvlm: LoRA adapter {name} (rank {a.rank}, {', '.join(a.targets)}, scale {scale:g}) loaded in "
                  f"{(time.perf_counter() - t0) * 1e3:.0f} ms", file=sys.stderr)
    return names
