"""On the default model with default flags (Q4_1 / Q8_0 weights, int8 activations): token ids and top-5
logprobs are bit-identical along every path the engine can take, for 12 prompts (plain and chat, short
and over 1,000 tokens) x 64 greedy tokens, and for seeded sampling (no KV cache: 16 tokens, 3 on the long
prompts, since every recomputed step re-runs the whole sequence); speculative decoding among the paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvlm import LLM, SamplingParams
from kvlm.exactness import first_difference

pytestmark = pytest.mark.slow

PLAIN = ["The capital of France is", "Hello", "The three primary colors are", "def quicksort(arr):\n",
         "日本の首都は東京です。The weather today is", "Once upon a time, in a land far away, there lived a dragon",
         "Question: what is 12 times 12? Answer:"]
CHAT = ["What is a KV cache?", "Write a haiku about caches", "Translate to French: cat"]
LONG = ("The history of the city begins with a small settlement by the river, where fishermen traded salt "
        "and grain with travellers from the hills. ") * 40 + "Summarize the history above in one sentence:"
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=5)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=64, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def setup(smollm2_gguf: Path):
    llm = LLM(str(smollm2_gguf), num_threads=2)
    chats = [{"prompt_token_ids": llm.render_chat([{"role": "user", "content": c}])} for c in CHAT]
    long_ids = llm.tokenizer.encode(LONG)
    assert len(long_ids) > 1000
    prompts = [{"prompt_token_ids": llm.tokenizer.encode(p)} for p in PLAIN] + chats + [
        {"prompt_token_ids": long_ids},
        {"prompt_token_ids": llm.render_chat([{"role": "system", "content": LONG}, {"role": "user", "content": "Hi"}])}]
    assert len(prompts) == 12
    return llm, prompts


def _alone(llm: LLM, prompts: list, params: SamplingParams) -> list:
    outs = []
    for p in prompts:
        llm.llm_engine.reset_prefix_cache()
        outs += llm.generate([p], params, use_tqdm=False)
    return outs


def _check(path: str, ref: list, outs: list) -> None:
    d = first_difference(path, ref, outs)
    assert d is None, str(d)


def test_every_path_bit_identical(setup, smollm2_gguf: Path, tmp_path: Path) -> None:
    llm, prompts = setup
    ref = _alone(llm, prompts, GREEDY)
    fillers = [{"prompt_token_ids": [(5 * j + i) % 300 + 20 for j in range(40 + 30 * i)]} for i in range(4)]
    llm.llm_engine.reset_prefix_cache()
    _check("inside a 16-prompt batch", ref, llm.generate(prompts + fillers, GREEDY, use_tqdm=False)[:12])
    for budget in (7, 64, 512):
        chunked = LLM(str(smollm2_gguf), num_threads=2, max_num_batched_tokens=budget)
        _check(f"chunked prefill ({budget})", ref, chunked.generate(prompts, GREEDY, use_tqdm=False))
    # Prefix-cache hits (the batch above left every prompt's blocks cached) vs caching off.
    _check("prefix-cache hit", ref, llm.generate(prompts, GREEDY, use_tqdm=False))
    off = LLM(str(smollm2_gguf), num_threads=2, enable_prefix_caching=False)
    _check("prefix caching off", ref, off.generate(prompts, GREEDY, use_tqdm=False))
    contiguous = LLM(str(smollm2_gguf), num_threads=2, kv_cache_layout="contiguous", max_num_seqs=12)
    _check("contiguous cache", ref, contiguous.generate(prompts, GREEDY, use_tqdm=False))
    # A snapshot of the long prompt's blocks, loaded into a fresh engine, vs computing them.
    snap = tmp_path / "long.safetensors"
    llm.save_prefix(prompts[10], snap)
    fresh = LLM(str(smollm2_gguf), num_threads=2)
    assert fresh.load_prefix(snap).blocks_loaded > 0
    _check("snapshot loaded", ref[10:11], fresh.generate([prompts[10]], GREEDY, use_tqdm=False))
    # Preempted (a pool too small for everyone at once) vs not.
    per_token = llm.llm_engine.kv_bytes_per_token
    small = LLM(str(smollm2_gguf), num_threads=2, kv_cache_memory=1400 * per_token, enable_prefix_caching=False)
    outs = small.generate(prompts, GREEDY, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    _check("preempted", ref, outs)
    # Speculative decoding (ngram; draft_rows 64 without the cost rule: up to 4 drafts each in this batch
    # of 12) vs off.
    spec = LLM(str(smollm2_gguf), num_threads=2, speculative_config={
        "method": "ngram", "num_speculative_tokens": 5, "draft_rows": 64, "cost_rule": False})
    _check("speculative ngram, in one batch", ref, spec.generate(prompts, GREEDY, use_tqdm=False))
    assert spec.llm_engine.speculator.stats.num_accepted_tokens > 0
    before = torch.get_num_threads()
    try:  # 1 thread and inside one batch at once, against 2 threads alone
        torch.set_num_threads(1)
        llm.llm_engine.reset_prefix_cache()
        _check("1 thread, in one batch", ref, llm.generate(prompts, GREEDY, use_tqdm=False))
    finally:
        torch.set_num_threads(before)
    # Without a cache every step recomputes the whole sequence: 16 tokens on the short prompts, 3 (two
    # decode steps over 1,000+ tokens of context) on the long ones, whose recompute costs seconds a step.
    nocache = LLM(str(smollm2_gguf), num_threads=2, enable_kv_cache=False)
    short = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    _check("no KV cache", [_truncate(o, 16) for o in ref[:10]], nocache.generate(prompts[:10], short, use_tqdm=False))
    three = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=5)
    _check("no KV cache, long prompts", [_truncate(o, 3) for o in ref[10:]],
           nocache.generate(prompts[10:], three, use_tqdm=False))


def _truncate(o, n: int):
    c = o.outputs[0]
    c.token_ids, c.logprobs = c.token_ids[:n], (c.logprobs or [])[:n]
    return o


def test_seeded_sampling_bit_identical(setup, smollm2_gguf: Path) -> None:
    llm, prompts = setup
    ref = _alone(llm, prompts[:6], SEEDED)
    llm.llm_engine.reset_prefix_cache()
    _check("seeded, in a batch", ref, llm.generate(prompts[:6], SEEDED, use_tqdm=False))
    chunked = LLM(str(smollm2_gguf), num_threads=2, max_num_batched_tokens=7)
    _check("seeded, chunked", ref, chunked.generate(prompts[:6], SEEDED, use_tqdm=False))
    spec = LLM(str(smollm2_gguf), num_threads=2,  # (without the cost rule: drafts in this batch of 6 too)
               speculative_config={"method": "suffix", "num_speculative_tokens": 5, "cost_rule": False})
    _check("seeded, speculative suffix", ref, spec.generate(prompts[:6], SEEDED, use_tqdm=False))
    assert spec.llm_engine.speculator.stats.num_accepted_tokens > 0
    nocache = LLM(str(smollm2_gguf), num_threads=2, enable_kv_cache=False)
    short = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True, logprobs=5)
    _check("seeded, no KV cache", [_truncate(o, 16) for o in ref], nocache.generate(prompts[:6], short, use_tqdm=False))


def test_bounded_cache_paths_bit_identical(setup, smollm2_gguf: Path) -> None:
    """--max-kv-tokens 96 (sinks + window): the 12 prompts, two over 1,000 tokens (evicting while they
    prefill), and 130 greedy tokens, past the budget for every prompt: alone, in one batch, chunked (7 and 64
    tokens a step) and preempted, bit for bit."""
    _, prompts = setup
    bounded = SamplingParams(temperature=0, max_tokens=130, ignore_eos=True, logprobs=5, max_kv_tokens=96)
    llm = LLM(str(smollm2_gguf), num_threads=2, enable_prefix_caching=False)
    ref = [llm.generate([p], bounded, use_tqdm=False)[0] for p in prompts]
    assert all(o.metrics.num_evicted_tokens > 0 for o in ref)
    _check("bounded, in one batch", ref, llm.generate(prompts, bounded, use_tqdm=False))
    for budget in (7, 64):
        chunked = LLM(str(smollm2_gguf), num_threads=2, max_num_batched_tokens=budget)
        _check(f"bounded, chunked ({budget})", ref, chunked.generate(prompts, bounded, use_tqdm=False))
    per_token = llm.llm_engine.kv_bytes_per_token
    small = LLM(str(smollm2_gguf), num_threads=2, kv_cache_memory=800 * per_token, enable_prefix_caching=False)
    outs = small.generate(prompts, bounded, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    _check("bounded, preempted", ref, outs)
