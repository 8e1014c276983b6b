"""kvlm: a small, exact LLM inference engine built around the KV cache.

    from kvlm import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(out[0].outputs[0].text)

`import kvlm` is light: the names below are imported on first use (PEP 562), so a command that never
builds an engine (`kvlm kv-size`, `kvlm --help`) does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "kvlm.llm", "SamplingParams": "kvlm.sampling_params", "RequestOutput": "kvlm.outputs",
    "CompletionOutput": "kvlm.outputs", "StreamDelta": "kvlm.outputs", "Engine": "kvlm.engine.engine",
    "EngineConfig": "kvlm.config", "ModelConfig": "kvlm.config", "KvlmError": "kvlm.errors",
    "ModelLoadError": "kvlm.errors", "UnsupportedModelError": "kvlm.errors", "PromptTooLongError": "kvlm.errors",
    "StructuredOutputsParams": "kvlm.sampling_params", "LoRARequest": "kvlm.lora",
}
__all__ = [  # = list(_EXPORTS), spelled out for linters and type checkers
    "LLM",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "KvlmError",
    "LoRARequest",
    "ModelConfig",
    "ModelLoadError",
    "PromptTooLongError",
    "RequestOutput",
    "SamplingParams",
    "StreamDelta",
    "StructuredOutputsParams",
    "UnsupportedModelError",
]

if TYPE_CHECKING:  # for type checkers; at run time __getattr__ imports each name on first use
    from kvlm.config import EngineConfig, ModelConfig
    from kvlm.engine.engine import Engine
    from kvlm.errors import (
        KvlmError,
        ModelLoadError,
        PromptTooLongError,
        UnsupportedModelError,
    )
    from kvlm.llm import LLM
    from kvlm.lora import LoRARequest
    from kvlm.outputs import CompletionOutput, RequestOutput, StreamDelta
    from kvlm.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'kvlm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
