"""K centering of the int8 / int4 KV cache (`kv_cache/k_center.py`): the engine's mean key is deterministic,
every write stores the codes of k - mu (prefill, the fused decode step, re-rotated sink keys), keys read
back for re-rotation are uncentered, and snapshots refuse another K center. The equivalences on a centered
cache are `tests/engine/test_exact_kv_quant.py`'s (and on the default model
`tests/model/test_exact_kv_quant_default_model.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_runs import random_prompts
from tiny_models import tiny_config, write_tiny_gguf

from kvlm import EngineConfig, SamplingParams
from kvlm.engine.engine import Engine
from kvlm.errors import SnapshotError
from kvlm.kernels import kv_quant, native
from kvlm.kv_cache.k_center import (
    FIRST_KEY_SEED,
    FIRST_KEY_TOKENS,
    calibration_ids,
    center_digest,
    mean_keys,
    prefill_meta,
)
from kvlm.kv_cache.recompute import NoKVCache
from kvlm.kv_cache.spec import KVCacheConfig
from kvlm.kv_cache.storage import PagedKVCache, kv_format

KV = ["int8", "int4"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_config(head_dim=32, tie_word_embeddings=False)
    return write_tiny_gguf(tmp_path_factory.mktemp("kc") / "tiny-q8-d32.gguf", cfg, tensor_type="Q8_0")


class _Keys(NoKVCache):
    """A float32 NoKVCache that keeps each layer's new keys (T, kv_heads, D)."""

    def __init__(self) -> None:
        super().__init__(torch.float32)
        self.keys: dict[int, torch.Tensor] = {}

    def write(self, layer, k, v, meta) -> None:  # noqa: ANN001
        self.keys[layer] = k.clone()
        super().write(layer, k, v, meta)


def float_keys(eng: Engine, ids: list[int]) -> dict[int, torch.Tensor]:
    in_place = native.active_isa() != "reference"
    meta, cache = prefill_meta(len(ids), torch.device("cpu"), in_place), _Keys()
    with torch.inference_mode():
        eng.model(torch.tensor(ids), meta.positions, cache, meta)
    return cache.keys


def test_k_center_is_the_seeded_mean_key_and_deterministic(model: Path) -> None:
    a = Engine(model, EngineConfig(kv_cache_dtype="int4"), quiet=True)
    assert Engine(model, EngineConfig(kv_cache_dtype="float32"), quiet=True).k_center is None  # float caches: none
    mu, k0 = a.k_center.mu, a.k_center.k0
    mc = a.model_config
    for c in (mu, k0):
        assert c.shape == (mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim) and c.dtype == torch.float32
        assert torch.equal(c, c.half().float()) and c.abs().sum() > 0  # float16 values, not all zero
    # k0: the mean position-0 key of one-token prefills of other seeded ids (a key at position 0 sees only
    # its own token)
    first = calibration_ids(mc.vocab_size, FIRST_KEY_TOKENS, FIRST_KEY_SEED)
    want0 = torch.stack([torch.stack([float_keys(a, [t])[i][0].double() for t in first]).mean(0)
                         for i in range(mc.num_hidden_layers)])
    torch.testing.assert_close(k0.double(), want0, rtol=2**-10, atol=2**-24)
    assert not torch.equal(k0, mu)
    ids = calibration_ids(mc.vocab_size, min(1024, a.max_model_len))
    assert ids == calibration_ids(mc.vocab_size, len(ids)) and len(set(ids)) > len(ids) // 4  # seeded, spread
    keys = float_keys(a, ids)
    want = torch.stack([keys[i].double().mean(0) for i in range(mc.num_hidden_layers)])
    torch.testing.assert_close(mu.double(), want, rtol=2**-10, atol=2**-24)  # the mean, in float16
    # the same bits on every load, at any thread count, and for int8 too (one mean per model and dtype)
    threads = torch.get_num_threads()
    try:
        one = Engine(model, EngineConfig(kv_cache_dtype="int8", num_threads=1), quiet=True).k_center
    finally:
        torch.set_num_threads(threads)
    again = Engine(model, EngineConfig(kv_cache_dtype="int4"), quiet=True).k_center
    for c in (one, again):
        assert torch.equal(c.mu, mu) and torch.equal(c.k0, k0)
    digest = center_digest(a.k_center)
    assert digest == center_digest(kv_quant.KeyCenter(one.mu.clone(), one.k0.clone())) and center_digest(None) == "none"
    assert digest != center_digest(kv_quant.KeyCenter(mu + 1, k0)) != center_digest(kv_quant.KeyCenter(mu, k0 + 1))
    in_place = mean_keys(a.model, ids[:64], native.active_isa() != "reference")
    torch.testing.assert_close(in_place, mean_keys(a.model, ids[:64], False), rtol=2**-9, atol=2**-20)


@pytest.mark.parametrize("kv", KV)
def test_every_write_stores_the_codes_of_the_centered_key(model: Path, kv: str) -> None:
    """Layer 0's keys depend on the tokens only (no attention before them), so the float model's keys of
    prompt + output tokens tell what the cache must hold: quantize(k - mu), prefill rows and decode rows
    (the fused native step where it runs, the module path else) alike."""
    fmt = kv_quant.FORMATS[kv]
    for fused in (True, False):
        eng = Engine(model, EngineConfig(kv_cache_dtype=kv, kv_cache_layout="paged", block_size=64, max_num_seqs=1,
                                         enable_prefix_caching=False), quiet=True)
        assert (eng.runner.fused is not None) == fused or not fused or native.active_isa() == "reference"
        if not fused:
            eng.runner.fused = None
        prompt = random_prompts(1, 31, lo=20, hi=20)[0]
        req = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        block = None
        while not req.is_finished:
            block = req.block_table[0] if req.block_table else block
            eng.step()
        ids = req.token_ids[:-1]  # the last token's K/V was never written
        keys = float_keys(eng, ids)[0]  # (T, kv_heads, D)
        stored = eng.kv_cache.k[0][block, : len(ids)]  # (T, kv_heads, row_bytes) uint8
        c = eng.k_center
        want = keys - c.mu[0]
        want[0] = keys[0] - c.k0[0]  # the position-0 key: centered on k0
        assert torch.equal(stored, kv_quant.quantize(want, fmt)), f"fused={fused}"
        assert not torch.equal(stored, kv_quant.quantize(keys, fmt))  # the center is not a no-op here
        assert not torch.equal(stored[:1], kv_quant.quantize(keys[:1] - c.mu[0], fmt))  # nor is k0


@pytest.mark.parametrize("kv", KV)
def test_sink_keys_are_re_rotated_uncentered(kv: str) -> None:
    """read_keys gives back what the codes stand for (+ mu, + k0 for the first blocks' position-0 key),
    write_keys centers what it stores: a key re-rotated for a bounded cache is rotated in the model's
    basis, then centered."""
    fmt = kv_quant.FORMATS[kv]
    mu = (torch.randn(2, 2, 32) * 4).half().float()
    k0 = (torch.randn(2, 2, 32) * 8).half().float()
    config = KVCacheConfig.full(kv_format(fmt, kv_quant.KeyCenter(mu, k0)), 2, 4, 4, 2, 32)
    cache = PagedKVCache(config, torch.device("cpu"))
    k = torch.randn(8, 2, 32) + mu[1]  # two blocks of 4 tokens: a sequence's sinks, its position-0 key first
    k[0] += k0[1] - mu[1]
    cache.write_keys(1, [2, 0], k)
    want = k - mu[1]
    want[0] = k[0] - k0[1]
    assert torch.equal(cache.k[1][[2, 0]].flatten(0, 1), kv_quant.quantize(want, fmt))
    back = cache.read_keys([2, 0])[1]  # (8, kv_heads, D): layer 1
    codes = kv_quant.unrotated(kv_quant.dequantize(cache.k[1][[2, 0]].flatten(0, 1), fmt, 32), fmt)
    assert torch.equal(back[1:], codes[1:] + mu[1]) and torch.equal(back[0], codes[0] + k0[1])
    assert (back - k).abs().max() < want.abs().max() / (4 if kv == "int4" else 60)


def _rewrite_meta(src: Path, dst: Path, **changes: str | None) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        meta, tensors = dict(f.metadata()), {n: f.get_tensor(n) for n in f.keys()}
    for key, value in changes.items():
        if value is None:
            meta.pop(key)
        else:
            meta[key] = value
    save_file(tensors, str(dst), metadata=meta)


def test_snapshots_record_the_k_center_and_refuse_another(model: Path, tmp_path: Path) -> None:
    cfg = EngineConfig(kv_cache_dtype="int4", block_size=4)
    eng = Engine(model, cfg, quiet=True)
    snap = tmp_path / "p.safetensors"
    eng.save_prefix(random_prompts(1, 7, lo=12, hi=12)[0], snap)
    assert Engine(model, cfg, quiet=True).load_prefix(snap).blocks_loaded == 3
    for name, value in (("other", "0123456789abcdef"), ("old", None)):  # another mean; an uncentered snapshot
        _rewrite_meta(snap, tmp_path / f"{name}.safetensors", k_center=value)
        with pytest.raises(SnapshotError, match="another K center"):
            Engine(model, cfg, quiet=True).load_prefix(tmp_path / f"{name}.safetensors")
    # a float snapshot written before the field existed loads into a float cache (its keys are uncentered)
    f32 = EngineConfig(block_size=4)
    Engine(model, f32, quiet=True).save_prefix(random_prompts(1, 8, lo=12, hi=12)[0], snap)
    _rewrite_meta(snap, tmp_path / "f32-old.safetensors", k_center=None)
    assert Engine(model, f32, quiet=True).load_prefix(tmp_path / "f32-old.safetensors").blocks_loaded == 3
