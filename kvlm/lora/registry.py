"""`LoRARegistry`: the adapters an engine serves, by name (plain Python bookkeeping, no tensors touched).

Names are unique; ids count up from 1 and are never reused within an engine (0 means "the base"). A
request holds its adapter object itself, so unloading an adapter refuses new requests for it while
requests already running finish under it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvlm.errors import LoRAError, UnknownLoRAError
from kvlm.lora.adapter import LoRAAdapter


class LoRARegistry:
    def __init__(self) -> None:
        self.adapters: dict[str, LoRAAdapter] = {}
        self._next_id = 1
        self._lock = threading.Lock()

    def check_new(self, name: str) -> None:
        """A `LoRAError` line if `name` cannot be a new adapter's name."""
        if not name or any(c.isspace() for c in name):
            raise LoRAError(f"LoRA adapter name {name!r} must be non-empty with no spaces")
        if name in self.adapters:
            raise LoRAError(f"a LoRA adapter named {name!r} is already loaded ({self.adapters[name].path})")

    def next_id(self) -> int:
        """A fresh id, never handed out before (two adapters loading at once on server threads get two)."""
        with self._lock:
            self._next_id += 1
            return self._next_id - 1

    def add(self, adapter: LoRAAdapter) -> LoRAAdapter:
        with self._lock:  # checked again: another thread may have taken the name while this one loaded
            self.check_new(adapter.name)
            self.adapters[adapter.name] = adapter
            self._next_id = max(self._next_id, adapter.id + 1)
        return adapter

    def remove(self, name: str) -> LoRAAdapter:
        if name not in self.adapters:
            raise UnknownLoRAError(name)
        return self.adapters.pop(name)

    def get(self, name: str) -> LoRAAdapter:
        if name not in self.adapters:
            raise UnknownLoRAError(name)
        return self.adapters[name]

    def __contains__(self, name: object) -> bool:
        return name in self.adapters

    def __len__(self) -> int:
        return len(self.adapters)

    def names(self) -> list[str]:
        return list(self.adapters)


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's handle for an adapter a request runs under: loaded from `lora_path` under `lora_name` on first
    use (`LLM.generate(..., lora=LoRARequest(...))`); a plain name of a loaded adapter works as well."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


def parse_lora_spec(spec: str) -> tuple[str, str, float]:
    """`--lora NAME=PATH[:SCALE]` -> (name, path, scale); a `LoRAError` line says what is wrong. A path that
    itself holds a colon works when what follows the last colon is not a number."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise LoRAError(f"--lora {spec!r}: expected NAME=PATH[:SCALE]")
    head, colon, tail = rest.rpartition(":")
    if colon and head:
        try:
            return name, head, float(tail)
        except ValueError:
            pass
    return name, rest, 1.0
