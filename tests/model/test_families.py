"""Phi-3 / Phi-4-mini, SmolLM3 and Granite against Hugging Face transformers, from both formats.

Each family is a tiny random model the test writes as a GGUF file (the names and metadata llama.cpp's
converter writes: Phi-3's fused `attn_qkv` / `ffn_up`, its LongRoPE factor tensors and `rope.dimension_count`;
SmolLM3's permuted Q/K and llama.cpp's fixed NoPE step of 4; Granite's `*_scale` keys) and as an HF
safetensors folder, and the same weights in transformers (float32, eager attention): every step's logits
within 1e-4 and identical greedy tokens. The bit-exact engine equivalences of these families are in
tests/engine/test_exact_families.py. Malformed configs of the new families fail with one line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from deps import need
from engine_runs import random_prompts, run_engine
from tiny_models import VOCAB, longrope, random_state_dict, tiny_config, write_tiny_gguf, write_tiny_hf_dir

from kvlm import EngineConfig, SamplingParams
from kvlm.engine.engine import Engine
from kvlm.errors import KvlmError, UnsupportedModelError
from kvlm.loader import load_checkpoint, load_config

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
CONFIGS: dict[str, dict[str, Any]] = {
    "phi3": tiny_config("phi3", tie_word_embeddings=False),  # LongRoPE, original context 64 of 256
    "phi4mini": tiny_config("phi3", partial_rotary_factor=0.5, rope_scaling=longrope(8, 64)),
    "smollm3": tiny_config("smollm3"),  # 4 layers, the last without RoPE
    "granite": tiny_config("granite"),
}
STATES = {name: random_state_dict(cfg) for name, cfg in CONFIGS.items()}
PAD = VOCAB - 1  # never in the byte prompts: transformers must not mask any prompt token as padding


@pytest.fixture(scope="module", params=[f"{n}-{fmt}" for n in CONFIGS for fmt in ("gguf", "safetensors")])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    name, fmt = request.param.split("-")
    root = tmp_path_factory.mktemp(name)
    if fmt == "gguf":
        return name, write_tiny_gguf(root / "tiny.gguf", CONFIGS[name], STATES[name])
    return name, write_tiny_hf_dir(root / "hf", CONFIGS[name], STATES[name])


_HF: dict[str, Any] = {}


def hf_model(name: str) -> Any:
    need("transformers")
    from tiny_models import hf_reference_model

    if name not in _HF:
        _HF[name] = hf_reference_model(CONFIGS[name], STATES[name])
    return _HF[name]


def test_config_from_both_formats(model: tuple[str, Path]) -> None:
    name, path = model
    c = load_config(path)
    cfg = CONFIGS[name]
    assert c.model_type == cfg["model_type"] and c.architecture == cfg["architectures"][0]
    if cfg["model_type"] == "phi3":
        rs = c.rope_scaling or {}
        assert rs["rope_type"] == "longrope" and rs["original_max_position_embeddings"] == 64
        for key in ("short_factor", "long_factor"):  # float32 in the GGUF file, as transformers takes them too
            assert torch.equal(torch.tensor(rs[key], dtype=torch.float32),
                               torch.tensor(cfg["rope_scaling"][key], dtype=torch.float32))
        assert c.rotary_dim == (8 if name == "phi4mini" else 16) and c.sliding_window is None
    if name == "smollm3":
        assert c.no_rope_layers == (1, 1, 1, 0) and [c.uses_rope(i) for i in range(4)] == [True] * 3 + [False]
    if name == "granite":
        assert (c.embedding_multiplier, c.attention_multiplier, c.residual_multiplier, c.logits_scaling) == (
            12.0, pytest.approx(0.2), pytest.approx(0.22), 3.0)  # float32 in GGUF metadata


def test_fused_tensors_load_as_stored(model: tuple[str, Path]) -> None:
    """Phi-3's q/k/v and gate/up stay the one stored tensor each (no per-part copies concatenated)."""
    name, path = model
    if CONFIGS[name]["model_type"] != "phi3":
        pytest.skip("fused tensors are Phi-3's")
    _, state, _ = load_checkpoint(path)
    assert "model.layers.0.self_attn.qkv_proj.weight" in state and "model.layers.0.mlp.gate_up_proj.weight" in state
    assert not any(".q_proj." in k or ".gate_proj." in k for k in state)
    key = "model.layers.1.mlp.gate_up_proj.weight"
    assert torch.equal(state[key], STATES[name][key])


def test_matches_transformers(model: tuple[str, Path]) -> None:
    """Greedy tokens and every step's logits. Context 64 = Phi-3's original one: LongRoPE's short factors,
    as transformers takes them for sequences within it."""
    name, path = model
    hf = hf_model(name)
    prompts = random_prompts(3, 41, lo=4, hi=40)
    tokens, logits = run_engine(Engine(path, EngineConfig(dtype="float32", max_model_len=64), quiet=True),
                                prompts, GREEDY)
    for i, ids in enumerate(prompts):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=PAD)
        assert tokens[i] == out.sequences[0, len(ids):].tolist(), f"prompt {i}"
        for step, (ours, ref) in enumerate(zip(logits[i], out.logits)):
            assert (ours - ref[0]).abs().max().item() < 1e-4, f"prompt {i}, step {step}"


def test_longrope_long_factors_past_the_original_context(model: tuple[str, Path]) -> None:
    """An engine whose context (256) exceeds the original one (64) rotates with the long factors and scales
    cos / sin by sqrt(1 + ln 4 / ln 64), as transformers does for a sequence longer than 64."""
    name, path = model
    if CONFIGS[name]["model_type"] != "phi3":
        pytest.skip("LongRoPE is Phi-3's")
    engine = Engine(path, EngineConfig(dtype="float32"), quiet=True)
    assert engine.max_model_len == 256
    assert engine.model.rope_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))
    ids = random_prompts(1, 42, lo=70, hi=70)[0]
    _, logits = run_engine(engine, [ids], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    with torch.inference_mode():
        ref = hf_model(name)(torch.tensor([ids])).logits[0, -1]
    assert (logits[0][0] - ref).abs().max().item() < 1e-4


def _edit(path: Path, **changes: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("family, changes, words", [
    ("phi3", {"rope_scaling": {**longrope(16, 64), "short_factor": [1.0, 2.0]}}, ["longrope", "8 short and long"]),
    ("phi3", {"rope_scaling": {"type": "longrope", "long_factor": [1.0] * 8}}, ["short_factor"]),
    ("phi3", {"partial_rotary_factor": 0.1, "rope_scaling": None}, ["partial_rotary_factor"]),
    ("smollm3", {"no_rope_layers": [1, 0]}, ["no_rope_layers", "4 layers"]),
    ("smollm3", {"use_sliding_window": True, "sliding_window": 8}, ["use_sliding_window"]),
])
def test_bad_family_configs_are_one_line(tmp_path: Path, family: str, changes: dict[str, Any],
                                         words: list[str]) -> None:
    path = write_tiny_hf_dir(tmp_path / "hf", CONFIGS[family], STATES[family])
    _edit(path, **changes)
    with pytest.raises(KvlmError) as e:
        load_checkpoint(path)
    msg = str(e.value)
    assert msg and "\n" not in msg and all(w in msg for w in words), msg


def test_gguf_longrope_factors_that_do_not_fit(tmp_path: Path) -> None:
    cfg = {**CONFIGS["phi3"], "rope_scaling": {**longrope(16, 64), "short_factor": [1.0] * 3, "long_factor": [1.0] * 3}}
    path = write_tiny_gguf(tmp_path / "bad.gguf", cfg, STATES["phi3"])
    with pytest.raises(UnsupportedModelError) as e:
        load_checkpoint(path)
    assert "\n" not in str(e.value) and "longrope needs 8" in str(e.value)


def test_granite_attention_multiplier_defaults_as_transformers() -> None:
    """A Granite config.json without attention_multiplier scales scores by 1 (GraniteConfig's default)."""
    from kvlm.config import ModelConfig

    cfg = {k: v for k, v in CONFIGS["granite"].items() if k != "attention_multiplier"}
    assert ModelConfig.from_hf_dict(cfg).attention_multiplier == 1.0
