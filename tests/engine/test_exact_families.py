"""Bit-exact engine equivalences for every model family kvlm runs, on tiny random models the tests write.

`test_exact.py` holds the Llama shape to them in every weight format; here each family (Llama 3.1 RoPE
scaling, Qwen2's q/k/v bias, Qwen3's q/k norms, Mistral, Gemma 3's sliding layers, Phi-3's fused tensors and
LongRoPE, Phi-4-mini's partial rotary, SmolLM3's layers without RoPE, Granite's multipliers) runs one set of
engines on the default path (`--dtype auto`): cache vs none, alone vs batch, chunked vs whole, prefix hit
vs miss, preempted vs not, 1 vs 2 threads, and the fused decode step vs the module path (or the fused step
refused, for the reason the model gives). Every step's float32 logits are compared with `torch.equal`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from deps import need_native
from engine_runs import assert_engine_equivalences, assert_identical, run_engine
from tiny_gemma import gemma3_config, gemma3_state, write_gemma3_gguf
from tiny_models import longrope, tiny_config, write_tiny_gguf, write_tiny_hf_dir

from kvlm import EngineConfig, SamplingParams
from kvlm.engine.engine import Engine

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}
# family -> (how the test writes it, the fused step's refusal or None where it runs)
FAMILIES: dict[str, tuple[str, str | None]] = {
    "llama31": ("safetensors", None),
    "qwen2": ("Q8_0", None),
    "qwen3": ("Q8_0", None),
    "mistral": ("safetensors", None),
    "gemma3": ("Q8_0", "Llama layer only"),
    "phi3": ("Q8_0", None),
    "phi4mini": ("Q8_0", None),
    "smollm3": ("Q8_0", None),
    "granite": ("Q8_0", None),
}


def family_config(family: str) -> dict[str, Any]:
    """The tiny HF config of a family (see tiny_models.tiny_config; Gemma 3: tiny_gemma)."""
    if family == "llama31":
        return tiny_config(rope_scaling=LLAMA31_ROPE, tie_word_embeddings=False)
    if family == "phi4mini":  # RoPE on half of each head, LongRoPE factors for those 8 values
        return tiny_config("phi3", partial_rotary_factor=0.5, rope_scaling=longrope(8, 64))
    if family == "qwen2":
        return tiny_config("qwen2", attention_bias=True, tie_word_embeddings=False)
    return tiny_config(family, tie_word_embeddings=False)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    need_native()
    name, (fmt, _) = request.param, FAMILIES[request.param]
    root = tmp_path_factory.mktemp(name)
    if name == "gemma3":
        cfg = gemma3_config()
        return name, write_gemma3_gguf(root / "tiny.gguf", cfg, gemma3_state(cfg), tensor_type=fmt)
    if fmt == "safetensors":
        return name, write_tiny_hf_dir(root / "hf", family_config(name))
    return name, write_tiny_gguf(root / "tiny.gguf", family_config(name), tensor_type=fmt)


def test_family_equivalences_bit_for_bit(family: tuple[str, Path]) -> None:
    name, path = family
    main, ref, prompts = assert_engine_equivalences(path, name, GREEDY)

    refusal = FAMILIES[name][1]
    if refusal is None:  # the fused native step ran every decode step of `ref`: the module path gives the same bits
        assert main.runner.fused is not None and main.backend.decode == "fused"
        modules = Engine(path, EngineConfig(block_size=4, enable_prefix_caching=False), quiet=True)
        modules.runner.fused = None
        assert_identical(ref, run_engine(modules, prompts, GREEDY), f"{name}: fused decode vs module path")
    else:
        assert main.runner.fused is None and main.backend.decode == "modules"
        assert refusal in main.backend.reasons[-1], main.backend.reasons
