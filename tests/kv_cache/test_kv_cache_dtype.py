"""A KV cache narrower than the activations (`kv_cache_dtype` float16 / bfloat16 under float32 compute).

* The pool holds the narrow type (half the bytes per token), the default stays the compute dtype, and a
  bad value is a `ParameterError` naming the field.
* The engine equivalences hold with it: cached == recomputed, paged == contiguous, alone == in a batch,
  fused decode step == module path: the same greedy tokens, logits within a float16 ulp budget (both
  paths round K/V to the cache's type, but where their float32 K differ by rounding, float16 can round
  them one ulp apart; float32 caches keep the 1e-4 budget of test_engine.py). The logit checks run on
  the float32-activation tiny model: on a Q8_0 one, int8 activations amplify such an ulp into ~2e-2.
* The fused step runs on such caches (its step-level checks: test_fused_decode.py, parametrized by
  kv_cache_dtype); a KV snapshot of one KV dtype is refused by an engine of another.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deps import need_native
from engine_runs import assert_same_logits, random_prompts, run_engine
from tiny_models import tiny_config, write_tiny_gguf

from kvlm import EngineConfig
from kvlm.engine.engine import Engine
from kvlm.errors import ParameterError
from kvlm.kernels import native

# logits budget per cache type: a few ulps of the K/V type, carried through two tiny layers
ATOL = {"float16": 5e-3, "bfloat16": 5e-2}


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_config("llama", tie_word_embeddings=False)
    return write_tiny_gguf(tmp_path_factory.mktemp("kvdtype") / "tiny-q8.gguf", cfg, tensor_type="Q8_0")


def test_kv_cache_dtype_is_validated() -> None:
    with pytest.raises(ParameterError) as e:
        EngineConfig(kv_cache_dtype="int2")  # type: ignore[arg-type]
    assert e.value.param == "kv_cache_dtype"


def test_half_pool_holds_half_the_bytes(tiny_gguf: Path) -> None:
    full = Engine(tiny_gguf, EngineConfig(kv_cache_memory=1 << 20), quiet=True)
    half = Engine(tiny_gguf, EngineConfig(kv_cache_memory=1 << 20, kv_cache_dtype="float16"), quiet=True)
    assert full.kv_cache_dtype == torch.float32 and full.kv_cache.k[0].dtype == torch.float32  # auto: compute dtype
    assert half.kv_cache_dtype == torch.float16 and half.kv_cache.k[0].dtype == torch.float16
    assert 2 * half.kv_bytes_per_token == full.kv_bytes_per_token
    assert half.block_manager.num_blocks == 2 * full.block_manager.num_blocks  # same budget, twice the tokens
    assert "float16" in str(half.kv_cache_dtype) and f"({half.kv_bytes_per_token} B/token)" in half.describe_cache()


def _logits_close(a: dict, b: dict, atol: float) -> None:
    """Every path reads K/V as the cache stores them, so with the native kernels the bits agree; on the
    reference path a float32 rounding difference between step shapes becomes a half-precision ulp."""
    for i, rows in a.items():
        if native.active_isa() == "reference":
            torch.testing.assert_close(torch.stack(rows), torch.stack(b[i]), atol=atol, rtol=0)
        else:
            assert_same_logits(rows, b[i])


@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_cached_equals_recomputed(tiny_gguf: Path, kv: str) -> None:
    prompts = random_prompts(3, 4, lo=2, hi=40)
    cached, lc = run_engine(Engine(tiny_gguf, EngineConfig(kv_cache_dtype=kv), quiet=True), prompts)
    full, lf = run_engine(Engine(tiny_gguf, EngineConfig(kv_cache_dtype=kv, enable_kv_cache=False), quiet=True),
                          prompts)
    assert cached == full
    _logits_close(lc, lf, ATOL[kv])


@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_paged_equals_contiguous_and_alone_equals_batch(tiny_gguf: Path, kv: str) -> None:
    prompts = random_prompts(6, 5, lo=2, hi=60)
    paged, lp = run_engine(Engine(tiny_gguf, EngineConfig(kv_cache_dtype=kv, block_size=8), quiet=True), prompts)
    contiguous, lc = run_engine(
        Engine(tiny_gguf, EngineConfig(kv_cache_dtype=kv, kv_cache_layout="contiguous"), quiet=True), prompts)
    assert paged == contiguous
    _logits_close(lp, lc, ATOL[kv])
    batched_engine = Engine(tiny_gguf, EngineConfig(kv_cache_dtype=kv, block_size=8, max_num_batched_tokens=32),
                            quiet=True)
    batched, lb = run_engine(batched_engine, prompts)
    assert batched_engine.mixed_steps > 0
    for i in range(len(prompts)):
        alone, la = run_engine(Engine(tiny_gguf, EngineConfig(kv_cache_dtype=kv, block_size=8), quiet=True),
                               [prompts[i]])
        assert batched[i] == alone[0] == paged[i]
        _logits_close({0: lb[i]}, {0: la[0]}, ATOL[kv])


@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_fused_step_runs_on_a_half_cache(q8_gguf: Path, kv: str) -> None:
    """It runs on float16 / bfloat16 caches and gives the module path's tokens (its step-level check on
    random caches: test_fused_decode.py, parametrized by kv_cache_dtype)."""
    need_native("the fused decode step is native")
    assert Engine(q8_gguf, EngineConfig(kv_cache_dtype=kv), quiet=True).runner.fused is not None
    cfg = EngineConfig(kv_cache_dtype=kv, block_size=4, max_num_batched_tokens=32)
    prompts = random_prompts(4, 12, lo=2, hi=40)
    out_tokens, lf = run_engine(Engine(q8_gguf, cfg, quiet=True), prompts)
    module = Engine(q8_gguf, cfg, quiet=True)
    module.runner.fused = None
    ref_tokens, lm = run_engine(module, prompts)
    assert out_tokens == ref_tokens
    _logits_close(lf, lm, ATOL[kv])


def test_snapshot_of_another_kv_dtype_is_refused(q8_gguf: Path, tmp_path: Path) -> None:
    from kvlm.kv_cache.snapshot import SnapshotError

    prompt = list(range(3, 40))
    half = Engine(q8_gguf, EngineConfig(kv_cache_dtype="float16", block_size=8), quiet=True)
    path = tmp_path / "p.safetensors"
    half.save_prefix(prompt, path)
    full = Engine(q8_gguf, EngineConfig(block_size=8), quiet=True)
    with pytest.raises(SnapshotError) as e:
        full.load_prefix(path)
    assert "KV cache dtype" in str(e.value) and "float16" in str(e.value)
    Engine(q8_gguf, EngineConfig(kv_cache_dtype="float16", block_size=8), quiet=True).load_prefix(path)
