"""Bounded KV caches (sinks + window, kvlm.kv_policy) in the engine, on tiny random models.

* Geometry: after an eviction, a one-layer model's logits equal (to float32 rounding) recomputing
  [sinks + kept tokens] from scratch at positions 0 .. n - 1, as the policy defines them; with one layer a
  token's K/V depend on that token and its position only, so the comparison is exact in meaning.
* Exactness: bit for bit alone vs batch, chunked vs whole, prefix hit vs miss, preempted vs not, 1 vs 2
  threads, for float and int8 K/V (a request's rows attend a function of their position only).
* Flat memory: a generation many times the budget never holds more than the budget's blocks, runs past
  the context (positions past the RoPE table) and gives every block back.
* Bad settings get a ParameterError naming the field; without the flags, the context still ends a request.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deps import need_native
from engine_runs import assert_identical, chat_turns, random_prompts, run_engine
from tiny_models import tiny_config, write_tiny_gguf

from kvlm import EngineConfig, SamplingParams
from kvlm.engine.engine import Engine
from kvlm.errors import ParameterError, PromptTooLongError
from kvlm.kv_cache.block_manager import EVICTED

LONG = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
BOUNDED = dict(block_size=4, max_kv_tokens=32, sink_tokens=4, max_model_len=64)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    need_native()
    return write_tiny_gguf(tmp_path_factory.mktemp("bounded") / "tiny-Q8_0.gguf",
                           tiny_config(head_dim=32, tie_word_embeddings=False), tensor_type="Q8_0")


def run(path: Path, prompts: list[list[int]], params: SamplingParams = LONG, **cfg) -> tuple[dict, dict]:
    return run_engine(Engine(path, EngineConfig(**{**BOUNDED, **cfg}), quiet=True), prompts, params)


def test_one_layer_logits_equal_recomputing_sinks_plus_window(tmp_path: Path) -> None:
    """float32 K/V (an int8 / int4 cache quantizes a re-rotated sink key differently from one computed
    at its new position: that is the format's rounding, not the geometry's)."""
    cfg = tiny_config(head_dim=32, tie_word_embeddings=False, num_hidden_layers=1)
    path = write_tiny_gguf(tmp_path / "one-layer.gguf", cfg, tensor_type="F32")
    common = dict(block_size=4, dtype="float32", max_model_len=64)
    eng = Engine(path, EngineConfig(max_kv_tokens=32, sink_tokens=4, **common), quiet=True)
    ref = Engine(path, EngineConfig(enable_prefix_caching=False, **common), quiet=True)
    req = eng.add_request(list(range(10, 30)), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    pol, checked, worst = req.kv_policy, 0, 0.0
    while eng.has_unfinished:
        eng.step(keep_logits=True)
        p = req.num_computed_tokens - 1
        if pol.kept_start(p) == 0:
            continue
        kept = req.token_ids[: pol.num_sinks] + req.token_ids[pol.kept_start(p) : p + 1]
        ref.add_request(kept, SamplingParams(temperature=0, max_tokens=1))
        while ref.has_unfinished:
            ref.step(keep_logits=True)
        worst = max(worst, (eng.last_result.logits[0] - ref.last_result.logits[0]).abs().max().item())
        checked += 1
    assert checked > 60 and req.num_tokens > 64  # many evictions, and positions past the RoPE table
    assert worst < 1e-4, worst


@pytest.mark.parametrize(("kv", "sinks"), [("auto", 4), ("int8", 4), ("int8", 0)])
def test_equivalences_bit_for_bit(model: Path, kv: str, sinks: int) -> None:
    prompts = random_prompts(4, 21, lo=3, hi=70)
    ref = run(model, prompts, kv_cache_dtype=kv, sink_tokens=sinks)
    assert_identical(ref, run(model, prompts, kv_cache_dtype=kv, sink_tokens=sinks, max_num_batched_tokens=7),
                     "chunked (7 a step)")
    for i, p in enumerate(prompts):
        t, lg = run(model, [p], kv_cache_dtype=kv, sink_tokens=sinks)
        assert_identical(({i: ref[0][i]}, {i: ref[1][i]}), ({i: t[0]}, {i: lg[0]}), f"alone vs batch ({i})")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert_identical(ref, run(model, prompts, kv_cache_dtype=kv, sink_tokens=sinks), "1 vs 2 threads")
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_fused_decode_past_the_context_equals_the_module_path(model: Path, kv: str) -> None:
    """Decode rows past the RoPE table (positions up to 190 in a 64-token context) read rope_rows' cos / sin
    from the table's scratch rows in the fused native step: the same bits as the module path."""
    prompts = random_prompts(3, 22, lo=3, hi=70)
    fused = Engine(model, EngineConfig(**BOUNDED, kv_cache_dtype=kv), quiet=True)
    module = Engine(model, EngineConfig(**BOUNDED, kv_cache_dtype=kv), quiet=True)
    assert fused.runner.fused is not None
    module.runner.fused = None
    assert_identical(run_engine(fused, prompts), run_engine(module, prompts), "fused vs module past the context")


def test_a_window_without_sinks_stops_correcting_the_position0_key(model: Path) -> None:
    """An int8 cache stores position-0 keys centered on k0 (kernels/kv_quant.py, KeyCenter), and attention
    corrects token 0 of what it reads while that is the position-0 key: with sinks always, without them
    until the window leaves it (then token 0 is another key, stored centered on mu)."""
    for sinks, after in ((4, None), (0, [0])):
        eng = Engine(model, EngineConfig(**{**BOUNDED, "sink_tokens": sinks}, kv_cache_dtype="int8"), quiet=True)
        assert eng.k_center is not None and eng.k_center.k0 is not None
        seen, begin, cache = [], eng.kv_cache.begin_step, eng.kv_cache

        def record(meta, begin=begin, seen=seen, cache=cache):  # noqa: ANN001, ANN202
            begin(meta)  # the cache's own record of which blocks start at a position-0 key
            k0_seqs = cache.k0_seqs(0, meta)
            seen.append(None if k0_seqs is None else k0_seqs.tolist())

        eng.kv_cache.begin_step = record
        run_engine(eng, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
        assert seen[0] is None and seen[-1] == after, (sinks, seen[-1])


def test_prefix_hit_and_preemption_bit_for_bit(model: Path) -> None:
    shared = random_prompts(1, 23, lo=24, hi=24)[0]
    prompts = [shared + p for p in random_prompts(3, 24, lo=2, hi=20)]
    ref = run(model, prompts, enable_prefix_caching=False)
    eng = Engine(model, EngineConfig(**BOUNDED), quiet=True)
    run_engine(eng, [shared + [1]], SamplingParams(temperature=0, max_tokens=1))  # warm the cache
    got = run_engine(eng, prompts, LONG)
    assert eng.scheduler.prefix_cache_hits > 0
    assert_identical(ref, got, "prefix hit vs miss")
    # A pool too small for all three at once: requests are preempted and recomputed from position 0.
    reqs: list = []
    small = Engine(model, EngineConfig(**BOUNDED, kv_cache_memory=18 * 4 * _bytes(eng)), quiet=True)
    got = run_engine(small, prompts, LONG, requests=reqs)
    assert sum(r.metrics.num_preemptions for r in reqs) > 0
    assert_identical(ref, got, "preempted vs not")


def _bytes(engine: Engine) -> int:
    return engine.kv_bytes_per_token


def test_memory_stays_within_the_budget_past_the_context(model: Path) -> None:
    """1,000 tokens on a 32-token budget in a 64-token context: blocks held never exceed the budget's
    (plus the one being filled), evicted tokens are counted, and every block comes back."""
    eng = Engine(model, EngineConfig(**BOUNDED), quiet=True)
    req = eng.add_request([5, 6, 7], SamplingParams(temperature=0.8, seed=1, max_tokens=1000, ignore_eos=True))
    most = 0
    while eng.has_unfinished:
        eng.step()
        most = max(most, len(req.block_table) - req.block_table.count(EVICTED))
        eng.block_manager.check(eng.scheduler.running)
    assert req.num_output_tokens == 1000 and req.finish_reason == "length"
    assert most <= 32 // 4 + 1
    assert req.metrics.num_evicted_tokens >= 1003 - 32
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_per_request_policy_and_a_prompt_longer_than_the_context(model: Path) -> None:
    eng = Engine(model, EngineConfig(block_size=4, max_model_len=64), quiet=True)
    long_prompt = random_prompts(1, 25, lo=150, hi=150)[0]
    with pytest.raises(PromptTooLongError):  # unbounded: the context still ends a request
        eng.add_request(long_prompt, SamplingParams(max_tokens=4))
    req = eng.add_request(long_prompt, SamplingParams(temperature=0, max_tokens=8, max_kv_tokens=32, sink_tokens=4))
    other = eng.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=8))
    while eng.has_unfinished:
        eng.step()
    assert req.num_output_tokens == 8 and req.metrics.num_evicted_tokens > 100
    assert other.kv_policy is None and other.metrics.num_evicted_tokens == 0
    assert req.metrics.as_dict()["kv_evicted_tokens"] == req.metrics.num_evicted_tokens


@pytest.mark.parametrize("cfg,field", [(dict(max_kv_tokens=30), "max_kv_tokens"),
                                       (dict(max_kv_tokens=128), "max_kv_tokens"),
                                       (dict(max_kv_tokens=32, enable_kv_cache=False), "max_kv_tokens"),
                                       (dict(max_kv_tokens=32, kv_cache_layout="contiguous"), "max_kv_tokens")])
def test_bad_settings_name_their_field(model: Path, cfg: dict, field: str) -> None:
    with pytest.raises(ParameterError) as e:
        Engine(model, EngineConfig(block_size=4, max_model_len=64, **cfg), quiet=True)
    assert e.value.param == field
    eng = Engine(model, EngineConfig(block_size=4, max_model_len=64), quiet=True)
    with pytest.raises(ParameterError):
        eng.add_request([1, 2], SamplingParams(max_kv_tokens=33))
    with pytest.raises(ParameterError):
        SamplingParams(sink_tokens=-1)


def test_endless_chat_reuses_the_window_across_turns(model: Path) -> None:
    """Past the first eviction, a turn's prefix hit is the previous turn's sinks and kept window (blocks
    registered under the policy's hash): each turn prefills only its new tokens, bit for bit the same as
    recomputing the whole history."""
    hit, cached = chat_turns(model, True, **BOUNDED)
    miss, _ = chat_turns(model, False, **BOUNDED)
    for i, (a, b) in enumerate(zip(hit, miss)):
        assert_identical(a, b, f"turn {i}: prefix hit vs recompute")
    assert cached[-1] > 2 * BOUNDED["max_kv_tokens"] and all(b > a for a, b in zip(cached[1:], cached[2:]))
