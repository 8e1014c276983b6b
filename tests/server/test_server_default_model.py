"""`kvlm serve` on the real default model (SmolLM2-135M-Instruct): HTTP equivalence with offline `LLM.generate`,
the real chat template, UTF-8-safe streaming."""

from __future__ import annotations

import asyncio

import openai
import pytest
from server_utils import ServerProcess

PROMPTS = ["The capital of France is", "Write a haiku about caches.", "1, 2, 3, 4,", "Translate to French: cat",
           "def fibonacci(n):", "Once upon a time, in a land far away, there lived a small dragon who",
           "Explain what a KV cache is in one sentence:", "Q: What is 17 + 25?\nA:"]


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    with ServerProcess(smollm2_gguf, "--max-num-seqs", "16", "--served-model-name", "smollm2-135m") as s:
        s.model_path = smollm2_gguf
        yield s


def test_concurrent_greedy_http_equals_offline(server):
    """8 concurrent requests here (the 32-request version runs on the tiny model in test_server_api: the
    shared 2-core CI machine makes 32 real-model requests twice too slow for the suite). Both sides on
    the default path (quantized weights, int8 activations)."""
    from kvlm import LLM, SamplingParams

    prompts = PROMPTS
    max_tokens = [3 + (i * 3) % 4 for i in range(len(prompts))]

    async def run_all() -> list:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        return await asyncio.gather(*(client.completions.create(model="smollm2-135m", prompt=p, max_tokens=n,
                                                                temperature=0) for p, n in zip(prompts, max_tokens)))

    got = asyncio.run(run_all())
    offline = LLM(str(server.model_path), num_threads=2)
    want = offline.generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens],
                                use_tqdm=False)
    tok = offline.tokenizer
    for p, g, w in zip(prompts, got, want):
        assert g.usage.completion_tokens == len(w.outputs[0].token_ids)
        if g.choices[0].text == w.outputs[0].text:
            continue
        # Concurrent arrivals put some decode rows into mixed prefill + decode steps, whose attention
        # takes another path (per-sequence SDPA) than a pure decode step (the paged kernel): equal up to
        # float32 rounding, which int8 activations can amplify into a flipped near-tie (2026-12-01:
        # "Translate to French: cat", margin 0.09 to 0.14 between two tokens depending on the path). So
        # where the texts part, the offline path's top-2 margin there must be a near-tie (test_quantized's
        # NEAR_TIE for int8 activations).
        ids, got_ids = list(w.outputs[0].token_ids), tok.encode(g.choices[0].text)
        k = next(i for i in range(len(ids)) if i >= len(got_ids) or got_ids[i] != ids[i])
        prefix = {"prompt_token_ids": tok.encode(p) + ids[:k]}
        top = offline.generate([prefix], SamplingParams(temperature=0, max_tokens=1, logprobs=2), use_tqdm=False)
        lp = sorted(top[0].outputs[0].logprobs[0].values(), reverse=True)
        assert lp[0] - lp[1] < 0.5, f"{p!r} parts at token {k} with a margin of {lp[0] - lp[1]:.3f} (not a near-tie)"


def test_chat_stream_is_utf8_safe_and_equals_non_stream(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Write the word 'thanks' in Chinese, then three emoji: 谢谢 🌶️"}]
    full = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=24, temperature=0)
    deltas = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2-135m", messages=msgs, max_tokens=24, temperature=0, stream=True) if c.choices]
    assert "".join(deltas) == full.choices[0].message.content
    assert not any("\ufffd" in d for d in deltas)
    assert full.usage.prompt_tokens > 20  # the model's own template wrapped the message
