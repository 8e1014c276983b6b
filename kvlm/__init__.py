"""kvlm: a small, exact LLM inference engine built around the KV cache.

    from kvlm import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(out[0].outputs[0].text)
"""

from kvlm.config import EngineConfig, ModelConfig
from kvlm.engine import Engine
from kvlm.errors import KvlmError, ModelLoadError, PromptTooLongError, UnsupportedModelError
from kvlm.llm import LLM
from kvlm.request import CompletionOutput, RequestOutput, StreamDelta
from kvlm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "StreamDelta", "Engine", "EngineConfig",
    "ModelConfig", "KvlmError", "ModelLoadError", "UnsupportedModelError", "PromptTooLongError",
]
