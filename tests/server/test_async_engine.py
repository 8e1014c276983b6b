"""`AsyncEngine` without HTTP: the loop thread, all-or-none submission, abort on close, the queue cap."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from kvlm import Engine, EngineConfig, SamplingParams
from kvlm.errors import PromptTooLongError
from kvlm.server.async_engine import AsyncEngine, QueueFullError


@pytest.fixture
def aengine(tiny_gguf):
    a = AsyncEngine(Engine(str(tiny_gguf), EngineConfig(num_threads=2), quiet=True), max_queued_requests=8)
    a.start()
    yield a
    a.stop()


def wait_until(cond, timeout: float = 2.0) -> bool:
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_streams_equal_offline_generate(aengine, tiny_gguf):
    from kvlm import LLM

    prompts = [[104, 101, 108], [5, 6, 7, 8, 9, 10, 11]]
    params = SamplingParams(temperature=0, max_tokens=9)

    async def go() -> dict[int, list[int]]:
        sub = await aengine.submit([(p, params, f"r{i}") for i, p in enumerate(prompts)])
        got: dict[int, list[int]] = {0: [], 1: []}
        async for i, d in sub:
            got[i] += d.token_ids
        return got

    got = asyncio.run(go())
    want = LLM(str(tiny_gguf), num_threads=2).generate([{"prompt_token_ids": p} for p in prompts], params,
                                                        use_tqdm=False)
    assert [got[0], got[1]] == [w.outputs[0].token_ids for w in want]


def test_close_aborts_and_frees_blocks(aengine):
    bm = aengine.engine.block_manager

    async def go() -> None:
        sub = await aengine.submit([([104] * 20, SamplingParams(max_tokens=200, ignore_eos=True), "long")])
        async for _ in sub:
            break
        sub.close()

    asyncio.run(go())
    assert wait_until(lambda: bm.num_used_blocks == 0 and not aengine.engine.has_unfinished)


def test_submission_is_all_or_none(aengine):
    ok = ([1, 2, 3], SamplingParams(max_tokens=4), "a")
    too_long = ([1] * 300, SamplingParams(max_tokens=4), "b")

    async def go() -> None:
        await aengine.submit([ok, too_long])

    with pytest.raises(PromptTooLongError):
        asyncio.run(go())
    assert wait_until(lambda: not aengine.engine.has_unfinished and aengine.num_waiting == 0)
    assert aengine.engine.block_manager.num_used_blocks == 0


def test_reserve_caps_the_queue(aengine):
    aengine.reserve(8)
    with pytest.raises(QueueFullError):
        aengine.reserve(1)
    aengine.release(8)
    aengine.reserve(1)
    aengine.release(1)


def test_speculative_streams_several_tokens_a_step_and_counts_them(tiny_gguf):
    """With speculative decoding a step may deliver several deltas of one request: the stream still equals
    offline generation without it, and /metrics counts drafts under vLLM's spec-decode names."""
    from kvlm import LLM
    from kvlm.server.metrics import ServerMetrics

    spec = {"method": "suffix", "num_speculative_tokens": 3}
    a = AsyncEngine(Engine(str(tiny_gguf), EngineConfig(num_threads=2, speculative_config=spec), quiet=True))
    metrics = ServerMetrics(a, "tiny")
    a.start()
    prompt, params = [104, 105] * 6, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def go() -> list[int]:
        got: list[int] = []
        async for _, d in await a.submit([(prompt, params, "s")]):
            got += d.token_ids
        return got

    def accepted() -> float:
        m = re.search(r'kvlm:spec_decode_num_accepted_tokens_total\{model_name="tiny"\} (\S+)',
                      metrics.render().decode())
        return float(m.group(1)) if m else 0.0

    try:
        got = asyncio.run(go())
        assert wait_until(lambda: accepted() > 0)  # counted when the request finishes (on the loop thread)
        text = metrics.render().decode()
    finally:
        a.stop()
    want = LLM(str(tiny_gguf), num_threads=2).generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert got == want[0].outputs[0].token_ids
    assert 'kvlm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in text
