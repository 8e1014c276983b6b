"""On the default model with an int8 or int4 KV cache: token ids and top-5 logprobs bit-identical alone vs
inside a batch, chunked vs whole, prefix hit vs miss and cache vs no cache (a short version of
test_exact_default_model.py: 6 prompts, one over 1,000 tokens, 24 greedy tokens; no cache: 8 tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlm import LLM, SamplingParams
from kvlm.exactness import first_difference

pytestmark = pytest.mark.slow

PLAIN = ["The capital of France is", "def quicksort(arr):\n", "Once upon a time, in a land far away, there lived"]
LONG = ("The history of the city begins with a small settlement by the river, where fishermen traded salt "
        "and grain with travellers from the hills. ") * 40 + "Summarize the history above in one sentence:"
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)


def _check(path: str, ref: list, outs: list) -> None:
    d = first_difference(path, ref, outs)
    assert d is None, str(d)


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_paths_bit_identical_with_a_quantized_cache(smollm2_gguf: Path, kv: str) -> None:
    llm = LLM(str(smollm2_gguf), num_threads=2, kv_cache_dtype=kv)
    assert llm.llm_engine.kv_bytes_per_token == {"int8": 12240, "int4": 6480}[kv]
    long_ids = llm.tokenizer.encode(LONG)
    assert len(long_ids) > 1000
    prompts = [{"prompt_token_ids": llm.tokenizer.encode(p)} for p in PLAIN] + [
        {"prompt_token_ids": llm.render_chat([{"role": "user", "content": "What is a KV cache?"}])},
        {"prompt_token_ids": long_ids}, {"prompt_token_ids": long_ids[:300]}]
    ref = []
    for p in prompts:
        llm.llm_engine.reset_prefix_cache()
        ref += llm.generate([p], GREEDY, use_tqdm=False)
    llm.llm_engine.reset_prefix_cache()
    _check("inside a batch", ref, llm.generate(prompts, GREEDY, use_tqdm=False))
    _check("prefix-cache hit", ref, llm.generate(prompts, GREEDY, use_tqdm=False))
    chunked = LLM(str(smollm2_gguf), num_threads=2, kv_cache_dtype=kv, max_num_batched_tokens=64,
                  enable_prefix_caching=False)
    _check("chunked prefill (64)", ref, chunked.generate(prompts, GREEDY, use_tqdm=False))
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    nocache = LLM(str(smollm2_gguf), num_threads=2, kv_cache_dtype=kv, enable_kv_cache=False)
    cached = LLM(str(smollm2_gguf), num_threads=2, kv_cache_dtype=kv, enable_prefix_caching=False)
    _check("no KV cache", cached.generate(prompts[:4], short, use_tqdm=False),
           nocache.generate(prompts[:4], short, use_tqdm=False))
