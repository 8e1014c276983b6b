"""The engine equivalences bit for bit with an int8 or int4 KV cache, and what the quantized pool holds.

K/V are quantized on write, per token (`kernels/kv_quant.py`), and every attention path reads the codes
as the cache stores them (the no-cache path lays the step's codes out as blocks), so cached == no cache,
paged == contiguous, alone == batch, chunked == whole, prefix hit == miss, preempted == not, the fused
decode step (which quantizes natively, `csrc/kv_quantize.h`) == the module path, and a
snapshot loaded == recomputed, all on `torch.equal` logits (a Q8_0 tiny model with head_dim 32, the
smallest the formats take). Memory is counted: the pool's bytes per token (its tensors) are within 1% of
the formula 2 x layers x kv_heads x head_dim x 34/32 (int8) or 18/32 (int4), and a fixed budget holds
3.76x / 7.1x the tokens of a float32 pool.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deps import need_native
from engine_runs import random_prompts, run_engine
from test_exact import GREEDY, SEEDED, assert_identical
from tiny_models import tiny_config, write_tiny_gguf

from kvlm import LLM, EngineConfig
from kvlm.engine.engine import Engine
from kvlm.errors import ParameterError, SnapshotError

KV = ["int8", "int4"]
PER_VALUE = {"int8": 34 / 32, "int4": 18 / 32}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_config(head_dim=32, tie_word_embeddings=False)
    return write_tiny_gguf(tmp_path_factory.mktemp("kvq") / "tiny-q8-d32.gguf", cfg, tensor_type="Q8_0")


@pytest.fixture
def native_only() -> None:
    need_native()


def run(path: Path, prompts: list[list[int]], params=GREEDY, **cfg) -> tuple[dict, dict]:
    return run_engine(Engine(path, EngineConfig(**cfg), quiet=True), prompts, params)


@pytest.mark.parametrize("kv", KV)
def test_equivalences_bit_for_bit(model: Path, kv: str, native_only: None) -> None:
    prompts = random_prompts(5, 21, lo=3, hi=70)
    ref = run(model, prompts, kv_cache_dtype=kv, block_size=4)
    assert_identical(ref, run(model, prompts, kv_cache_dtype=kv, enable_kv_cache=False), "cache vs no cache")
    assert_identical(ref, run(model, prompts, kv_cache_dtype=kv, kv_cache_layout="contiguous"), "paged vs contiguous")
    assert_identical(ref, run(model, prompts, kv_cache_dtype=kv, block_size=4, max_num_batched_tokens=7),
                     "chunked prefill (7 tokens a step)")
    for i, p in enumerate(prompts[:3]):
        t, lg = run(model, [p], kv_cache_dtype=kv, block_size=4)
        assert_identical(({i: ref[0][i]}, {i: ref[1][i]}), ({i: t[0]}, {i: lg[0]}), f"alone vs batch (prompt {i})")
    fused = Engine(model, EngineConfig(kv_cache_dtype=kv, block_size=4), quiet=True)
    module = Engine(model, EngineConfig(kv_cache_dtype=kv, block_size=4), quiet=True)
    assert fused.runner.fused is not None  # decode steps quantize and attend in the fused native step
    module.runner.fused = None
    assert_identical(run_engine(fused, prompts), run_engine(module, prompts), "fused decode vs module path")
    seeded = run(model, prompts, SEEDED, kv_cache_dtype=kv, block_size=4)
    assert_identical(seeded, run(model, prompts, SEEDED, kv_cache_dtype=kv, enable_kv_cache=False), "seeded, no cache")


@pytest.mark.parametrize("kv", KV)
def test_position0_rows_in_decode_shaped_steps(model: Path, kv: str, native_only: None) -> None:
    """A 1-token prompt, or a prompt fed a token a step, puts a position-0 row into a step of one row per
    sequence: the fused step centers its key on k0 as the module path does, with the same bits."""
    prompts = [[5], [9, 4, 33]] + random_prompts(2, 25, lo=3, hi=30)
    ref = run(model, prompts, kv_cache_dtype=kv, block_size=4, enable_kv_cache=False)
    assert_identical(ref, run(model, prompts, kv_cache_dtype=kv, block_size=4), "cache vs no cache")
    fused = Engine(model, EngineConfig(kv_cache_dtype=kv, block_size=4, max_num_batched_tokens=1), quiet=True)
    module = Engine(model, EngineConfig(kv_cache_dtype=kv, block_size=4, max_num_batched_tokens=1), quiet=True)
    assert fused.runner.fused is not None
    module.runner.fused = None
    assert_identical(run_engine(fused, prompts[:2]), run_engine(module, prompts[:2]), "fused vs module, position 0")
    assert_identical(ref, run(model, prompts, kv_cache_dtype=kv, block_size=4, max_num_batched_tokens=1),
                     "a token a step")
    for i in (0, 1):
        t, lg = run(model, [prompts[i]], kv_cache_dtype=kv, block_size=4)
        assert_identical(({i: ref[0][i]}, {i: ref[1][i]}), ({i: t[0]}, {i: lg[0]}), f"alone (prompt {i})")


@pytest.mark.parametrize("kv", KV)
def test_prefix_hit_preemption_and_snapshot_bit_for_bit(model: Path, kv: str, native_only: None,
                                                         tmp_path: Path) -> None:
    shared = random_prompts(1, 23, lo=40, hi=40)[0]
    prompts = [shared + tail for tail in random_prompts(4, 24, lo=2, hi=12)]
    off = run(model, prompts, kv_cache_dtype=kv, block_size=4, enable_prefix_caching=False)
    eng = Engine(model, EngineConfig(kv_cache_dtype=kv, block_size=4), quiet=True)
    run_engine(eng, [shared + [1, 2, 3]], GREEDY)  # fills the prefix cache with the shared blocks
    reqs: list = []
    assert_identical(off, run_engine(eng, prompts, GREEDY, requests=reqs), "prefix-cache hit vs caching off")
    assert all(r.metrics.num_cached_tokens >= 40 for r in reqs)
    small = Engine(model, EngineConfig(kv_cache_dtype=kv, block_size=4, enable_prefix_caching=False,
                                       kv_cache_memory=24 * 4 * eng.kv_bytes_per_token), quiet=True)
    reqs = []
    assert_identical(off, run_engine(small, prompts, GREEDY, requests=reqs), "preempted vs not")
    assert sum(r.metrics.num_preemptions for r in reqs) > 0
    # a snapshot of quantized blocks: the pool's bytes, loaded == recomputed; another KV dtype refuses it
    snap = tmp_path / "p.safetensors"
    LLM(model, kv_cache_dtype=kv, block_size=4).save_prefix({"prompt_token_ids": shared}, snap)
    loaded = Engine(model, EngineConfig(kv_cache_dtype=kv, block_size=4), quiet=True)
    assert loaded.load_prefix(snap).blocks_loaded == 10
    reqs = []
    assert_identical(off, run_engine(loaded, prompts, GREEDY, requests=reqs), "snapshot loaded vs recomputed")
    assert all(r.metrics.num_cached_tokens >= 40 for r in reqs)
    other = "int4" if kv == "int8" else "int8"
    for dtype in (other, "float32"):
        with pytest.raises(SnapshotError, match="another KV cache dtype"):
            Engine(model, EngineConfig(kv_cache_dtype=dtype, block_size=4), quiet=True).load_prefix(snap)


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_bytes_per_token_are_counted_from_the_pool(model: Path, layout: str) -> None:
    budget = 1 << 20
    f32 = Engine(model, EngineConfig(kv_cache_memory=budget, kv_cache_layout=layout), quiet=True)
    mc = f32.model_config
    for kv in KV:
        eng = Engine(model, EngineConfig(kv_cache_dtype=kv, kv_cache_memory=budget, kv_cache_layout=layout),
                     quiet=True)
        cache = eng.kv_cache
        assert all(t.dtype == torch.uint8 for t in cache.k + cache.v)
        counted = sum(t.numel() for t in cache.k + cache.v) / (cache.num_blocks * cache.block_size)
        formula = mc.kv_bytes_per_token(PER_VALUE[kv])
        assert abs(counted - formula) <= 0.01 * formula and eng.kv_bytes_per_token == round(counted)
        assert f"({eng.kv_bytes_per_token} B/token)" in eng.describe_cache()
        if layout == "paged":  # the same budget holds 4 / bytes per value times the float32 pool's tokens
            ratio = eng.block_manager.num_blocks / f32.block_manager.num_blocks
            assert ratio >= (3.5 if kv == "int8" else 6.5)


def test_head_dim_must_fit_the_groups(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "d16.gguf", tiny_config(tie_word_embeddings=False), tensor_type="Q8_0")
    with pytest.raises(ParameterError, match="head_dim % 32") as e:
        Engine(path, EngineConfig(kv_cache_dtype="int8"), quiet=True)
    assert e.value.param == "kv_cache_dtype"
