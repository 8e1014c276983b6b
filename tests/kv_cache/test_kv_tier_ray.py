"""The KV tier on a Ray cluster (`--kv-tier-dir ray://NAME`, kvlm.kv_cache.tier_ray): a named, detached
actor holds the block files, so a new engine in another process of the cluster (here: a new engine after
the first) starts warm with the same bits as recomputing; a bad block in the store is removed and
recomputed; the store's LRU holds its byte bound; without Ray connected the flag is refused in one line.
One local Ray instance for the module (no dashboard, a small object store)."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest
from deps import need
from test_kv_tier import BS, PROMPTS, check_same, model, reference, run  # noqa: F401 - `model` is a fixture

from kvlm import LLM
from kvlm.errors import ParameterError
from kvlm.kv_cache.tier_ray import TierStore


def test_store_is_an_lru_bounded_in_bytes() -> None:
    s = TierStore(max_bytes=30)
    for i in range(3):
        assert s.put(bytes([i]), b"x" * 10) == (True, 0, 10 * (i + 1))
    assert s.get([bytes([0])]) == [b"x" * 10]  # block 0 is now the most recently used
    assert s.put(bytes([3]), b"y" * 10) == (True, 1, 30)  # over the bound: block 1, the oldest, goes
    assert s.lookup([bytes([0]), bytes([2]), bytes([3])]) == 3 and s.lookup([bytes([1])]) == 0
    assert s.put(bytes([3]), b"z" * 10) == (False, 0, 30) and s.size() == 30  # stored once
    s.remove(bytes([3]))
    assert s.size() == 20 and s.names(1, 10) == [bytes([0]), bytes([2])]  # most recently used first


def test_without_ray_connected_it_is_refused(model: Path) -> None:  # noqa: F811
    ray = need("ray")
    if ray.is_initialized():
        pytest.skip("Ray is connected in this process")
    with pytest.raises(ParameterError, match="Ray is not connected here"):
        LLM(model, block_size=BS, kv_tier_dir="ray://nothing")


@pytest.fixture(scope="module")
def ray_local():
    ray = need("ray")
    ray.init(address="local", num_cpus=1, include_dashboard=False, object_store_memory=80 << 20,
             log_to_driver=False, namespace="kvlm", logging_level=logging.WARNING)
    yield ray
    ray.shutdown()


def test_a_new_engine_starts_warm_from_the_ray_store(model: Path, ray_local, caplog) -> None:  # noqa: F811
    url = f"ray://test-{uuid.uuid4().hex[:8]}"
    ref = reference(model, "auto")
    a = LLM(model, block_size=BS, kv_tier_dir=url, kv_tier_write_through=True)
    run(a, PROMPTS[0])
    a.llm_engine.flush_kv_tier()
    tier = a.llm_engine.tier.tier
    assert tier.stats.stored_blocks == 10 and tier.stats.size_bytes > 0
    assert len(tier.names()) == 10 and tier.tier_id.startswith(url + "@")

    b = LLM(model, block_size=BS, kv_tier_dir=url)
    got = run(b, PROMPTS[0])
    assert got[3].num_tier_tokens == 40
    check_same(got[:3], ref[0])
    st = b.llm_engine.tier.tier.stats
    assert st.hit_blocks == 10 and st.corrupt_files == 0 and st.size_bytes > 0

    # a block whose bytes are not its file (here: another block's, under its name) is removed and recomputed
    names = b.llm_engine.block_manager.prompt_block_hashes(PROMPTS[1])
    run(a, PROMPTS[1])
    a.llm_engine.flush_kv_tier()
    other = ray_local.get(tier.actor.get.remote([names[1]]))[0]
    ray_local.get(tier.actor.remove.remote(names[0]))
    ray_local.get(tier.actor.put.remote(names[0], other))
    c = LLM(model, block_size=BS, kv_tier_dir=url)
    with caplog.at_level(logging.WARNING, logger="kvlm"):
        got = run(c, PROMPTS[1])
    assert got[3].num_tier_tokens == 0 and c.llm_engine.tier.tier.stats.corrupt_files == 1
    assert "removed an unusable file" in caplog.text
    check_same(got[:3], ref[1])
    assert ray_local.get(tier.actor.lookup.remote(names)) == 0  # it is gone from the store
    ray_local.kill(tier.actor)


def test_int8_tier_in_the_ray_store(model: Path, ray_local) -> None:  # noqa: F811
    """`--kv-tier-dtype int8` over the Ray store: the actor holds int8 files (1/3.8 of float32's bytes
    here), and a new engine loads them as the directory tier would (the round trip's bits: tested in
    test_kv_tier_int8.py); an engine expecting the pool's own format refuses them."""
    url = f"ray://test-{uuid.uuid4().hex[:8]}"
    a = LLM(model, block_size=BS, kv_tier_dir=url, kv_tier_write_through=True, kv_tier_dtype="int8")
    run(a, PROMPTS[2])
    a.llm_engine.flush_kv_tier()
    b = LLM(model, block_size=BS, kv_tier_dir=url, kv_tier_dtype="int8")
    got = run(b, PROMPTS[2])
    assert got[3].num_tier_tokens == 40 and b.llm_engine.tier.tier.stats.corrupt_files == 0
    assert b.llm_engine.tier.tier.stats.hit_bytes < 10 * BS * b.llm_engine.kv_bytes_per_token / 2
    c = LLM(model, block_size=BS, kv_tier_dir=url)
    assert run(c, PROMPTS[2])[3].num_tier_tokens == 0 and c.llm_engine.tier.tier.stats.corrupt_files == 1
