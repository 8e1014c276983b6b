"""An int8 KV tier under a float pool (`kv_tier_dtype="int8"`, kvlm.kv_cache.tier_codec): the codec's round
trip is its pure-PyTorch reference's bits; a tier hit gives the bits of a run whose loaded blocks went
through that round trip (a snapshot of the recomputed prefix, round-tripped by the reference, loaded into
a plain engine), not of recomputing; files record their tier dtype and an engine expecting another refuses
them (removed, recomputed); a block loaded from the lossy tier is never stored again; bad settings are
refused in one line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from engine_runs import assert_same_logits, run_alone
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_models import tiny_config, write_tiny_gguf

from kvlm import LLM, SamplingParams
from kvlm.errors import ParameterError
from kvlm.kernels.kv_quant import INT8
from kvlm.kv_cache.snapshot import checksum
from kvlm.kv_cache.tier_codec import make_codec, round_trip_ref

BS = 4
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
PROMPTS = [[(7 * i + j * (i + 3)) % 200 + 3 for j in range(41)] for i in range(6)]  # 10 full blocks each
FLOAT_KV = ["auto", "float16", "bfloat16"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_config(head_dim=32, tie_word_embeddings=False)  # head_dim 32: the smallest int8 takes
    return write_tiny_gguf(tmp_path_factory.mktemp("tier8") / "tiny-q8-d32.gguf", cfg, tensor_type="Q8_0")


def run(llm: LLM, ids: list[int]) -> tuple:
    req, logits = run_alone(llm.llm_engine, ids, PARAMS)
    return req.output_token_ids, req.logprobs, logits, req.metrics


def tier_llm(model: Path, kv: str, d: Path, **kw) -> LLM:
    return LLM(model, block_size=BS, kv_cache_dtype=kv, kv_tier_dir=str(d), kv_tier_dtype="int8", **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_codec_round_trip_is_the_reference(dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    codec = make_codec(name, "int8", 64)
    x = (torch.randn(3, 2, BS, 2, 64, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    x[0, 0, 0, 0, :5] = 40.0  # an outlier channel: the rotation spreads it
    x[1, 1, 1, 1] = 0.0  # a zero row
    stored = codec.encode(x)
    assert stored.dtype == torch.uint8 and stored.shape == (*x.shape[:-1], INT8.row_bytes(64))
    back = codec.decode(stored)
    assert back.dtype == dtype and torch.equal(back, round_trip_ref(x))
    err = (back.float() - x.float()).abs().amax(-1)
    assert torch.all(err <= x.float().abs().amax(-1) / 64 + 1e-6)  # int8: within ~1/254 of a row's scale
    assert torch.equal(back[1, 1, 1, 1], torch.zeros(64, dtype=dtype))
    lossless = make_codec(name, None, 64)
    assert lossless.lossless and lossless.encode(x) is x and lossless.decode(x) is x


def test_codec_refusals() -> None:
    with pytest.raises(ValueError, match="for a float KV cache"):
        make_codec("int4", "int8", 64)
    with pytest.raises(ValueError, match="head_dim % 32"):
        make_codec("float32", "int8", 48)
    assert make_codec("int8", "int8", 64).lossless  # an int8 pool's blocks go down as stored


def snapshot_round_tripped(model: Path, kv: str, ids: list[int], path: Path) -> None:
    """The reference's prefix: the recomputed K/V of `ids`' full blocks, each through `round_trip_ref`."""
    plain = LLM(model, block_size=BS, kv_cache_dtype=kv)
    plain.llm_engine.save_prefix(ids, path)
    with safe_open(str(path), framework="pt") as f:
        meta, t = f.metadata(), {n: f.get_tensor(n) for n in f.keys()}
    t["k"], t["v"] = round_trip_ref(t["k"]), round_trip_ref(t["v"])
    save_file(t, str(path), metadata={**meta, "crc32": checksum(t["k"], t["v"], t["token_ids"])})


@pytest.mark.parametrize("kv", FLOAT_KV)
def test_tier_hit_equals_a_run_over_round_tripped_blocks(model: Path, kv: str, tmp_path: Path) -> None:
    writer = tier_llm(model, kv, tmp_path / "tier", kv_tier_write_through=True)
    exact = run(writer, PROMPTS[0])
    writer.llm_engine.flush_kv_tier()
    files = list((tmp_path / "tier").glob("*.kvb"))
    assert len(files) == 10
    with safe_open(str(files[0]), framework="pt") as f:
        assert f.metadata()["tier_dtype"] == "int8" and f.get_tensor("k").dtype == torch.uint8

    got = run(tier_llm(model, kv, tmp_path / "tier"), PROMPTS[0])  # a restart: the prefix from the tier
    assert got[3].num_tier_tokens == 40

    snapshot_round_tripped(model, kv, PROMPTS[0][:40], tmp_path / "rt.safetensors")
    ref_llm = LLM(model, block_size=BS, kv_cache_dtype=kv)
    assert ref_llm.llm_engine.load_prefix(tmp_path / "rt.safetensors").num_blocks == 10
    ref = run(ref_llm, PROMPTS[0])
    assert ref[3].num_cached_tokens == 40
    assert got[0] == ref[0] and got[1] == ref[1]  # tokens, and logprobs as equal floats
    assert_same_logits(got[2], ref[2])
    assert not torch.equal(got[2], exact[2])  # lossy: not the recomputed bits


def test_files_of_another_tier_dtype_are_refused(model: Path, tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """One directory, an int8-tier engine and a lossless one: each refuses (removes) the other's file, warns
    once, and recomputes: the lossless engine's output stays the recomputed bits."""
    w = tier_llm(model, "auto", tmp_path, kv_tier_write_through=True)
    exact = run(w, PROMPTS[0])
    w.llm_engine.flush_kv_tier()
    lossless = LLM(model, block_size=BS, kv_tier_dir=str(tmp_path), kv_tier_write_through=True)
    with caplog.at_level(logging.WARNING, logger="kvlm"):
        got = run(lossless, PROMPTS[0])
    assert got[3].num_tier_tokens == 0 and lossless.llm_engine.tier.tier.stats.corrupt_files == 1
    assert got[0] == exact[0] and got[1] == exact[1]
    warnings = [r.getMessage() for r in caplog.records if "KV tier" in r.getMessage()]
    assert len(warnings) == 1 and "another KV tier dtype (int8; this engine: float32)" in warnings[0]
    lossless.llm_engine.flush_kv_tier()  # its own (float32) files now
    again = tier_llm(model, "auto", tmp_path)
    assert run(again, PROMPTS[0])[3].num_tier_tokens == 0
    assert again.llm_engine.tier.tier.stats.corrupt_files == 1


def test_blocks_loaded_from_the_lossy_tier_are_not_stored_again(model: Path, tmp_path: Path) -> None:
    w = tier_llm(model, "auto", tmp_path, kv_tier_write_through=True)
    run(w, PROMPTS[0])
    w.llm_engine.flush_kv_tier()
    small = tier_llm(model, "auto", tmp_path, kv_cache_memory=24 * BS * 256 * 4)  # ~24 blocks
    assert run(small, PROMPTS[0])[3].num_tier_tokens == 40
    for f in tmp_path.glob("*.kvb"):
        f.unlink()
    for p in PROMPTS[1:]:  # evict PROMPTS[0]'s blocks (and others) from the pool
        run(small, p)
    small.llm_engine.flush_kv_tier()
    names = {h.hex() + ".kvb" for h in small.llm_engine.block_manager.prompt_block_hashes(PROMPTS[0])}
    on_disk = {f.name for f in tmp_path.glob("*.kvb")}
    assert on_disk and not names & on_disk  # the others' evicted blocks went down, PROMPTS[0]'s did not


def test_bad_settings_are_refused(model: Path, tmp_path: Path) -> None:
    with pytest.raises(ParameterError, match="kv_tier_dtype needs kv_tier_dir"):
        LLM(model, block_size=BS, kv_tier_dtype="int8")
    with pytest.raises(ParameterError, match="must be int8 or None"):
        LLM(model, block_size=BS, kv_tier_dir=str(tmp_path), kv_tier_dtype="int4")
    with pytest.raises(ParameterError, match="for a float KV cache"):
        tier_llm(model, "int4", tmp_path)
