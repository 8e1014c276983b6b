"""`kvlm serve` driven by the real `openai` client (sync and async) on a tiny random model."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch
from tiny_models import hf_reference_model


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture
def aclient(tiny_server) -> openai.AsyncOpenAI:
    """A fresh async client per test: its connection pool belongs to the event loop of one asyncio.run."""
    return openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference_logprobs(tiny_server):
    """Log-softmax over a full forward pass of Hugging Face transformers with the same weights."""
    model = hf_reference_model(tiny_server.cfg, tiny_server.state)

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # (T, vocab)

    return logprobs


def test_models_lists_served_names_with_context(client, tiny_server):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny", "tiny-alias"]
    raw = httpx.get(tiny_server.url + "/v1/models").json()
    assert raw["data"][0]["max_model_len"] == 256
    # The model's file name, never where it lies on the server's disk.
    assert [m["root"] for m in raw["data"]] == ["tiny.gguf", "tiny.gguf"]
    assert str(tiny_server.model_path.parent) not in httpx.get(tiny_server.url + "/v1/models").text
    assert httpx.get(tiny_server.url + "/version").json()["version"]


def test_completion_stream_equals_non_stream(client):
    kw = dict(model="tiny", prompt="hello world", max_tokens=12, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    assert all(c.choices[0].text for c in chunks[:-2] if c.choices), "content chunks are never empty"


def test_completion_without_max_tokens_generates_16(client):
    # OpenAI's and vLLM's default for /v1/completions; the tiny model's context is 256 tokens.
    kw = dict(model="tiny", prompt="hello world", temperature=0, extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_completion_default_max_tokens_shrinks_to_the_room_left(client):
    r = client.completions.create(model="tiny", prompt=[104] * 250, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"


def test_chat_without_max_tokens_runs_to_the_context(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 256 and r.choices[0].finish_reason == "length"


def test_bounded_kv_request_runs_past_the_context(client):
    """max_kv_tokens (sinks + window): a prompt longer than the 256-token context is served, streamed equal
    to non-streamed, with the evicted tokens in usage; without it the same prompt is a 400."""
    prompt = [104 + i % 20 for i in range(300)]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=8)
    assert e.value.code == "context_length_exceeded"
    kw = dict(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
              extra_body={"ignore_eos": True, "max_kv_tokens": 64, "sink_tokens": 4})
    r = client.completions.create(**kw)
    assert r.usage.completion_tokens == 40 and r.choices[0].finish_reason == "length"
    assert r.usage.model_extra["kv_evicted_tokens"] >= 300 + 40 - 64 - 16
    chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**{**kw, "extra_body": {"max_kv_tokens": 60}})
    assert e.value.body["param"] == "max_kv_tokens"
    metrics = httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics").text
    counted = [line for line in metrics.splitlines() if line.startswith("kvlm:kv_evicted_tokens_total")]
    assert counted and float(counted[0].split()[-1]) >= 2 * r.usage.model_extra["kv_evicted_tokens"]


def test_chat_sync_and_async_stream(client, aclient):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    full = client.chat.completions.create(model="tiny-alias", messages=msgs, max_tokens=10, temperature=0)
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 10
    assert full.usage.prompt_tokens_details.cached_tokens == 0

    async def stream() -> list:
        out = await aclient.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                                     stream=True)
        return [c async for c in out]

    chunks = asyncio.run(stream())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_n2_stream_interleaves_choices_like_non_stream(client):
    kw = dict(model="tiny", prompt="hello", max_tokens=8, temperature=1.0, seed=7, n=2)
    full = client.completions.create(**kw)
    assert [c.index for c in full.choices] == [0, 1]
    texts = {0: "", 1: ""}
    for c in client.completions.create(**kw, stream=True):
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == {0: full.choices[0].text, 1: full.choices[1].text}
    assert full.usage.completion_tokens == 16


def test_seed_reproducible_and_different_seeds_differ(client):
    kw = dict(model="tiny", prompt="hello", max_tokens=16, temperature=1.0)
    a, b = (client.completions.create(**kw, seed=42).choices[0].text for _ in range(2))
    others = {client.completions.create(**kw, seed=s).choices[0].text for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1


def test_completion_logprobs_match_reference(client, reference_logprobs):
    prompt = [104, 101, 108, 108, 111, 32, 119, 111]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for tok_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4 and tok_lp == pytest.approx(max(top.values()))  # greedy picks the top
    ref = reference_logprobs(prompt)[-1]
    assert lp.token_logprobs[0] == pytest.approx(ref.max().item(), abs=1e-4)


def test_echo_returns_prompt_logprobs_first_null(client, reference_logprobs):
    prompt = [104, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(prompt) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference_logprobs(prompt)
    want = [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    assert lp.token_logprobs[1 : len(prompt)] == pytest.approx(want, abs=1e-4)
    assert r.choices[0].text.startswith("hello world")
    assert lp.text_offset[:3] == [0, 1, 2]


def test_chat_logprobs_and_top_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) >= 2
        assert e.logprob == pytest.approx(max(t.logprob for t in e.top_logprobs))


def test_stop_string_never_appears_streamed_or_not(client):
    base = client.completions.create(model="tiny", prompt="hello", max_tokens=24, temperature=0).choices[0].text
    assert len(base) >= 6
    stop = base[3:6]
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == base[: base.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="hello", max_tokens=24, temperature=0, stop=stop, stream=True))
    assert streamed == r.choices[0].text and stop not in streamed


def test_tokenize_detokenize_round_trip(tiny_server):
    text = "hello world, héllo"
    t = httpx.post(tiny_server.url + "/tokenize", json={"prompt": text}).json()
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 256
    assert httpx.post(tiny_server.url + "/detokenize", json={"tokens": t["tokens"]}).json()["prompt"] == text
    chat = httpx.post(tiny_server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 3


def test_request_id_echoed_and_created(tiny_server):
    body = {"prompt": "hi", "max_tokens": 2}
    r = httpx.post(tiny_server.url + "/v1/completions", json=body, headers={"X-Request-Id": "my-req-1"})
    assert r.headers["x-request-id"] == "my-req-1" and r.json()["id"] == "cmpl-my-req-1"
    r = httpx.post(tiny_server.url + "/v1/completions", json=body)
    assert len(r.headers["x-request-id"]) >= 16


def test_logit_bias_forces_a_token(client):
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0,
                                  logit_bias={"120": 100})
    assert r.choices[0].text == "xxx"


def test_metrics_use_vllm_names(tiny_server):
    m = tiny_server.metrics()
    for name in ("kvlm:num_requests_running", "kvlm:num_requests_waiting", "kvlm:kv_cache_usage_perc",
                 "kvlm:prompt_tokens_total", "kvlm:generation_tokens_total", "kvlm:num_preemptions_total",
                 "kvlm:time_to_first_token_seconds_count", "kvlm:inter_token_latency_seconds_count",
                 "kvlm:e2e_request_latency_seconds_count", "kvlm:request_queue_time_seconds_count",
                 "kvlm:prefix_cache_queries_total", "kvlm:prefix_cache_hits_total"):
        assert name in m, name
    assert m["kvlm:generation_tokens_total"] > 0
    # the tiny model in float32: 2 (K, V) x 2 layers x 2 kv heads x head_dim 16 x 4 bytes, counted from the pool
    assert m["kvlm:kv_cache_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert m["kvlm:kv_cache_used_bytes"] == m["kvlm:kv_cache_used_blocks"] * 16 * 512
    text = httpx.get(tiny_server.url + "/metrics").text
    assert 'kvlm:request_success_total{finished_reason="length",model_name="tiny"}' in text


def test_32_concurrent_greedy_requests_equal_offline_generate(tiny_server, aclient):
    from kvlm import LLM, SamplingParams

    prompts = [[(7 * i + j) % 250 + 1 for j in range(3 + (i * 37) % 120)] for i in range(32)]
    outs = [4 + (i * 11) % 29 for i in range(32)]

    async def one(p: list[int], n: int):
        return await aclient.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0)

    async def run_all() -> list:
        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, outs)))

    got = asyncio.run(run_all())
    llm = LLM(str(tiny_server.model_path), num_threads=2)
    want = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=n) for n in outs], use_tqdm=False)
    for g, w in zip(got, want):
        assert g.choices[0].text == w.outputs[0].text
        assert g.usage.completion_tokens == len(w.outputs[0].token_ids)
        assert g.choices[0].finish_reason == w.outputs[0].finish_reason


def test_kv_cache_map_agrees_with_metrics(client, tiny_server):
    """GET /kv_cache (the chat page's panel): after a request with a few full blocks, nothing runs, its blocks
    stay cached for reuse, the counts add up to the pool and `used` is /metrics' used-blocks gauge."""
    prompt = "a prompt that fills a few blocks of sixteen tokens, " * 2
    client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                              extra_headers={"X-Request-Id": "kv-map-probe"})
    m = httpx.get(tiny_server.url + "/kv_cache", timeout=10).json()
    assert m["running"] == 0 and m["owners"] == []
    assert len(m["blocks"]) == m["num_blocks"] == tiny_server.metrics()["kvlm:kv_cache_total_blocks"]
    assert m["used"] == tiny_server.metrics()["kvlm:kv_cache_used_blocks"] == sum(s >= 2 for s in m["blocks"])
    assert m["cached"] == m["blocks"].count(1) >= len(prompt) // m["block_size"] // 2  # the prompt, kept for reuse
    assert m["used"] + m["cached"] + m["free"] == m["num_blocks"]
    assert m["freed"] >= m["cached"] and m["bytes_per_block"] > 0
