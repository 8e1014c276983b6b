"""Bit-exact engine equivalences on the default path (`--dtype auto`), for every weight format with a kernel,
and on the `--dtype float32` path.

A token's logits must have the same bits cached or recomputed, alone or in any batch, chunked or whole,
paged or contiguous, from the prefix cache or computed, preempted or not, at 1 or 2 threads. Here on tiny
random models written in each format (K-quants need 256-wide rows: a wider tiny model, synthetic blocks) and
as a safetensors folder, compared with `torch.equal` on every step's float32 logits. Needs the native
kernels: the reference path (no build) is exact against transformers, not across step shapes.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from deps import need_native
from engine_runs import assert_identical, random_prompts, run_engine
from quantize import can_quantize, synthetic_quantize
from tiny_models import tiny_config, write_tiny_gguf, write_tiny_hf_dir

from kvlm import EngineConfig, SamplingParams
from kvlm.engine.engine import Engine

FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32", "safetensors"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=FORMATS)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    need_native()
    fmt = request.param
    if fmt == "safetensors":  # an HF folder: float32 weights, on the native row kernel under --dtype auto
        return write_tiny_hf_dir(tmp_path_factory.mktemp("exact") / "hf", tiny_config(tie_word_embeddings=False))
    qtype = gguf.GGMLQuantizationType[fmt]
    kquant = fmt.endswith("_K")
    cfg = (tiny_config(hidden_size=256, intermediate_size=256, head_dim=64, tie_word_embeddings=False) if kquant
           else tiny_config(tie_word_embeddings=False))
    path = tmp_path_factory.mktemp("exact") / f"tiny-{fmt}.gguf"
    if can_quantize(qtype):
        return write_tiny_gguf(path, cfg, tensor_type=fmt)
    with pytest.MonkeyPatch.context() as mp:  # gguf's numpy code only dequantizes K-quants
        mp.setattr(gguf.quants, "quantize", synthetic_quantize)
        return write_tiny_gguf(path, cfg, tensor_type=fmt)


def run(path: Path, prompts: list[list[int]], params: SamplingParams = GREEDY, **cfg) -> tuple[dict, dict]:
    return run_engine(Engine(path, EngineConfig(**cfg), quiet=True), prompts, params)


def test_equivalences_bit_for_bit(model: Path) -> None:
    prompts = random_prompts(5, 11, lo=3, hi=70)
    ref = run(model, prompts, block_size=4)
    assert_identical(ref, run(model, prompts, block_size=4, enable_kv_cache=False), "cache vs no cache")
    assert_identical(ref, run(model, prompts, kv_cache_layout="contiguous"), "paged vs contiguous")
    for budget in (7, 64):
        assert_identical(ref, run(model, prompts, block_size=4, max_num_batched_tokens=budget),
                         f"chunked prefill ({budget} tokens a step)")
    alone = {i: run(model, [p], block_size=4) for i, p in enumerate(prompts)}
    for i, (t, lg) in alone.items():
        assert_identical(({i: ref[0][i]}, {i: ref[1][i]}), ({i: t[0]}, {i: lg[0]}), f"alone vs batch (prompt {i})")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert_identical(ref, run(model, prompts, block_size=4), "1 vs 2 threads")
    finally:
        torch.set_num_threads(before)


def test_seeded_sampling_bit_for_bit(model: Path) -> None:
    prompts = random_prompts(4, 12, lo=3, hi=40)
    ref = run(model, prompts, SEEDED, block_size=4)
    assert_identical(ref, run(model, prompts, SEEDED, block_size=4, enable_kv_cache=False), "seeded, no cache")
    assert_identical(ref, run(model, prompts, SEEDED, block_size=4, max_num_batched_tokens=7), "seeded, chunked")


def test_prefix_hit_and_preemption_bit_for_bit(model: Path) -> None:
    shared = random_prompts(1, 13, lo=40, hi=40)[0]
    prompts = [shared + tail for tail in random_prompts(4, 14, lo=2, hi=12)]
    off = run(model, prompts, block_size=4, enable_prefix_caching=False)
    eng = Engine(model, EngineConfig(block_size=4), quiet=True)
    run_engine(eng, [shared + [1, 2, 3]], GREEDY)  # fills the prefix cache with the shared blocks
    reqs: list = []
    hit = run_engine(eng, prompts, GREEDY, requests=reqs)
    assert all(r.metrics.num_cached_tokens >= 40 for r in reqs)
    assert_identical(off, hit, "prefix-cache hit vs caching off")
    per_token = eng.kv_bytes_per_token
    small = Engine(model, EngineConfig(block_size=4, kv_cache_memory=24 * 4 * per_token, enable_prefix_caching=False),
                   quiet=True)  # 96 tokens for four requests of up to 64: preemptions
    reqs = []
    pre = run_engine(small, prompts, GREEDY, requests=reqs)
    assert sum(r.metrics.num_preemptions for r in reqs) > 0
    assert_identical(off, pre, "preempted vs not")


@pytest.mark.parametrize("fmt", ["Q4_1", "Q6_K", "safetensors"])
def test_float32_path_bit_for_bit(fmt: str, tmp_path: Path) -> None:
    """`--dtype float32` on a CPU with the kernels: weights dequantized at load multiply on the row kernel as
    F32 blocks (loader/build.py), attention is the one native computation: exact across step shapes too."""
    need_native()
    if fmt == "safetensors":
        path = write_tiny_hf_dir(tmp_path / "hf", tiny_config(tie_word_embeddings=False))
    else:
        cfg = tiny_config(hidden_size=256, intermediate_size=256, head_dim=64) if fmt == "Q6_K" else tiny_config()
        with pytest.MonkeyPatch.context() as mp:
            if not can_quantize(gguf.GGMLQuantizationType[fmt]):
                mp.setattr(gguf.quants, "quantize", synthetic_quantize)
            path = write_tiny_gguf(tmp_path / f"tiny-{fmt}.gguf", cfg, tensor_type=fmt)
    prompts = random_prompts(5, 15, lo=3, hi=70)
    ref = run(path, prompts, dtype="float32", block_size=4)
    assert_identical(ref, run(path, prompts, dtype="float32", block_size=4, enable_kv_cache=False), "cache vs none")
    assert_identical(ref, run(path, prompts, dtype="float32", block_size=4, max_num_batched_tokens=7), "chunked")
    for i, p in enumerate(prompts):
        t, lg = run(path, [p], dtype="float32", block_size=4)
        assert_identical(({i: ref[0][i]}, {i: ref[1][i]}), ({i: t[0]}, {i: lg[0]}), f"alone vs batch (prompt {i})")
