"""Per-layer cache policies (kvlm.kv_cache.layer_groups) on a tiny random Gemma 3: its sliding layers keep
their K/V in a pool of their own that follows the window, while the engine's equivalences hold bit for bit
(tests/model/test_gemma3.py runs those on every path; here: preemption, and memory)."""

from __future__ import annotations

from pathlib import Path

import pytest
from deps import need_native
from engine_runs import assert_identical, chat_turns, random_prompts, run_engine
from tiny_gemma import WINDOW, gemma3_config, gemma3_state, write_gemma3_gguf

from kvlm import EngineConfig, SamplingParams
from kvlm.engine.engine import Engine
from kvlm.errors import ParameterError, SnapshotError
from kvlm.kv_cache.block_manager import EVICTED
from kvlm.kv_cache.layer_groups import LayerGroups
from kvlm.kv_cache.spec import FullAttention, SlidingWindow

LONG = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    need_native()
    cfg = gemma3_config()
    return write_gemma3_gguf(tmp_path_factory.mktemp("groups") / "tiny-Q8_0.gguf", cfg, gemma3_state(cfg),
                             tensor_type="Q8_0")


def test_groups_from_the_layer_pattern() -> None:
    g = LayerGroups.of((8, 8, None, 8, None), 5)
    assert g.group_of == (1, 1, 0, 1, 0) and g.windows == (None, 8) and g.layers(1) == [0, 1, 3]
    assert g.chunk_cap == 8 and LayerGroups.of(None, 3).num_groups == 1 and LayerGroups.of(None, 3).chunk_cap is None
    assert g.specs(4) == (FullAttention(4), SlidingWindow(4, 8))
    assert [g.specs(4)[1].evict_upto(p) for p in (0, 7, 8, 11, 12)] == [0, 0, 0, 1, 1]


def test_sliding_pool_follows_the_window(model: Path) -> None:
    """A sliding group's blocks held never exceed its window (plus a chunk), every evicted entry is
    before the window of the next token, and all blocks of every group come back."""
    eng = Engine(model, EngineConfig(block_size=4, max_num_seqs=2), quiet=True)
    sched = eng.scheduler
    gbm, = sched.groups
    assert gbm.spec == SlidingWindow(4, WINDOW) and sched.kv.chunk_cap == WINDOW
    reqs = [eng.add_request(p, LONG) for p in random_prompts(2, 31, lo=20, hi=40)]
    per_seq = LayerGroups.of(eng.model_config.layer_windows, eng.model_config.num_hidden_layers).blocks_per_seq(1, 4)
    while eng.has_unfinished:
        eng.step()
        sched.check()
        for r, n in zip(eng.last_batch.requests, eng.last_batch.num_new_tokens):
            t = r.group_tables[0]
            assert len(t) - t.count(EVICTED) <= per_seq
            # before the step: given back up to the window of its first row
            assert all(b == EVICTED for b in t[: gbm.spec.evict_upto(r.num_computed_tokens - n)])
    assert all(r.metrics.kv_bytes_held < len(r.token_ids) * eng.kv_bytes_per_token for r in reqs)
    assert gbm.num_free_blocks == gbm.num_blocks and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_preempted_equals_not(model: Path) -> None:
    prompts = random_prompts(3, 32, lo=10, hi=30)
    ref = run_engine(Engine(model, EngineConfig(block_size=4), quiet=True), prompts, LONG)
    # 3 seats: the sliding layers get their windows (3 x 6 blocks x 5 layers), the full layer 40 blocks
    small = Engine(model, EngineConfig(block_size=4, max_num_seqs=3, kv_cache_memory=3 * 6 * 5 * 1024 + 40 * 1024),
                   quiet=True)
    reqs: list = []
    got = run_engine(small, prompts, LONG, requests=reqs)
    assert sum(r.metrics.num_preemptions for r in reqs) > 0
    assert_identical(ref, got, "preempted vs not")


def test_pool_bytes_follow_the_per_layer_formula(model: Path) -> None:
    """One sequence at the full 256-token context: the pool holds the full layer's 256 tokens and, per
    sliding layer, its window plus a chunk (blocks_per_seq) and the null block, counted from the tensors;
    every layer full would be more. (At Gemma 3 270M's 32k context and 512-token window the same rule is
    within 1.08x of 3 full + 15 windowed layers: `kvlm bench long`, and the slow test on the real file.)"""
    eng = Engine(model, EngineConfig(block_size=4, max_num_seqs=1, max_model_len=256), quiet=True)
    mc = eng.model_config
    per_layer = mc.kv_bytes_per_token(4) / mc.num_hidden_layers
    groups = LayerGroups.of(mc.layer_windows, mc.num_hidden_layers)
    sliding_tokens = (groups.blocks_per_seq(1, 4) + 1) * 4
    assert eng.kv_cache.nbytes == (256 * 1 + sliding_tokens * 5) * per_layer
    assert eng.kv_cache.nbytes < 0.5 * mc.num_hidden_layers * 256 * per_layer
    assert eng.kv_bytes_per_token == round(mc.kv_bytes_per_token(4))  # the per-token cost is counted per layer


def test_sinks_and_window_on_sliding_layers_bit_for_bit(model: Path) -> None:
    """--max-kv-tokens on Gemma: the full layer keeps sinks + window, the sliding ones their own window (the
    kept tokens cover it); alone == batch, chunked == whole, preempted == not, and memory stays flat."""
    bounded = dict(block_size=4, max_kv_tokens=24, sink_tokens=4, max_model_len=64)
    prompts = random_prompts(3, 33, lo=10, hi=80)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    reqs: list = []
    eng = Engine(model, EngineConfig(**bounded), quiet=True)
    ref = run_engine(eng, prompts, params, requests=reqs)
    assert all(r.metrics.num_evicted_tokens > 0 for r in reqs)
    eng.scheduler.check()
    assert_identical(ref, run_engine(Engine(model, EngineConfig(**bounded, max_num_batched_tokens=5), quiet=True),
                                     prompts, params), "chunked")
    for i, p in enumerate(prompts):
        t, lg = run_engine(Engine(model, EngineConfig(**bounded), quiet=True), [p], params)
        assert_identical(({i: ref[0][i]}, {i: ref[1][i]}), ({i: t[0]}, {i: lg[0]}), f"alone vs batch ({i})")
    reqs = []
    small = Engine(model, EngineConfig(**bounded, max_num_seqs=3, kv_cache_memory=3 * 6 * 5 * 1024 + 14 * 1024),
                   quiet=True)
    assert_identical(ref, run_engine(small, prompts, params, requests=reqs), "preempted vs not")
    assert sum(r.metrics.num_preemptions for r in reqs) > 0


def test_max_kv_tokens_must_cover_the_window(model: Path) -> None:
    eng = Engine(model, EngineConfig(block_size=4), quiet=True)
    with pytest.raises(ParameterError) as e:  # the kept tokens must cover the sliding layers' window
        eng.add_request([1, 2, 3], SamplingParams(max_kv_tokens=12, sink_tokens=4))
    assert e.value.param == "max_kv_tokens" and "at least 16" in str(e.value)


def test_snapshot_holds_every_groups_part(model: Path, tmp_path: Path) -> None:
    """A snapshot of a 30-token prompt saves the full layer's blocks and the sliding layers' window blocks;
    loaded into a fresh engine, the next request takes them all from the cache and computes the same bits
    as without it. Another model's engine refuses it."""
    prompt = random_prompts(1, 34, lo=30, hi=30)[0]
    eng = Engine(model, EngineConfig(block_size=4), quiet=True)
    info = eng.save_prefix(prompt, tmp_path / "s.safetensors")
    assert info.num_blocks == 7
    fresh = Engine(model, EngineConfig(block_size=4), quiet=True)
    assert fresh.load_prefix(tmp_path / "s.safetensors").blocks_loaded == 7
    fresh.scheduler.check()
    reqs: list = []
    got = run_engine(fresh, [prompt + [3, 4]], LONG, requests=reqs)
    assert reqs[0].metrics.num_cached_tokens == 28
    ref = run_engine(Engine(model, EngineConfig(block_size=4, enable_prefix_caching=False), quiet=True),
                     [prompt + [3, 4]], LONG)
    assert_identical(ref, got, "snapshot loaded vs computed")
    other = write_gemma3_gguf(tmp_path / "other.gguf", gemma3_config(layer_types=["full_attention"] * 6),
                              gemma3_state(gemma3_config()), tensor_type="Q8_0")
    with pytest.raises(SnapshotError):
        Engine(other, EngineConfig(block_size=4), quiet=True).load_prefix(tmp_path / "s.safetensors")


def test_endless_chat_on_sliding_layers(model: Path) -> None:
    """The multi-turn chat of tests/engine/test_bounded.py on Gemma: each sliding group serves its window
    of the previous turn, and the turns are bit for bit those of recomputing the history."""
    cfg = dict(block_size=4, max_kv_tokens=24, sink_tokens=4, max_model_len=64)
    hit, cached = chat_turns(model, True, **cfg)
    miss, _ = chat_turns(model, False, **cfg)
    for i, (a, b) in enumerate(zip(hit, miss)):
        assert_identical(a, b, f"turn {i}: prefix hit vs recompute")
    assert cached[-1] > 48
