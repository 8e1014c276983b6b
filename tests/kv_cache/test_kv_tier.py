"""The KV tier (kvlm.kv_cache.tier, tier_pool): a prompt whose blocks come back from disk gives the tokens,
logprobs and logits bits of recomputing it, for every KV format; a restarted engine and another process
start warm from the same directory; the bound holds; faults never load a bad block: a corrupt, truncated,
renamed or foreign file is removed with one warning and recomputed, a file removed mid-load is recomputed,
a dead writer's temp file is never read, and a failing disk turns storing off with one warning."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from engine_runs import assert_same_logits, run_alone
from tiny_models import tiny_config, write_tiny_gguf

from kvlm import LLM, SamplingParams
from kvlm.errors import ParameterError

BS = 4
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
PROMPTS = [[(7 * i + j * (i + 3)) % 200 + 3 for j in range(41)] for i in range(6)]  # 10 full blocks each
KV = ["auto", "float16", "bfloat16", "int8", "int4"]
PER_VALUE = {"auto": 4, "float16": 2, "bfloat16": 2, "int8": 34 / 32, "int4": 18 / 32}  # bytes, scales included


def pool(kv: str) -> int:
    """~24 blocks of the tiny model's K/V (256 values a token): six prompts of 10 blocks do not fit."""
    return int(24 * BS * 256 * PER_VALUE[kv])


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_config(head_dim=32, tie_word_embeddings=False)  # head_dim 32: the smallest int8 / int4 take
    return write_tiny_gguf(tmp_path_factory.mktemp("tier") / "tiny-q8-d32.gguf", cfg, tensor_type="Q8_0")


def run(llm: LLM, ids: list[int]):
    """(tokens, logprobs, stacked logits rows, metrics) of one greedy request run alone."""
    req, logits = run_alone(llm.llm_engine, ids, PARAMS)
    return req.output_token_ids, req.logprobs, logits, req.metrics


def reference(model: Path, kv: str) -> list[tuple]:
    ref = LLM(model, block_size=BS, enable_prefix_caching=False, kv_cache_dtype=kv)
    return [run(ref, p)[:3] for p in PROMPTS]


def check_same(got: tuple, ref: tuple) -> None:
    assert got[0] == ref[0]
    assert got[1] == ref[1]  # logprobs: equal floats
    assert_same_logits(got[2], ref[2])


@pytest.mark.parametrize("kv", KV)
def test_tier_hit_equals_recompute(model: Path, kv: str, tmp_path: Path) -> None:
    """Evicted blocks come back from the tier in the same engine, and a new engine on the same directory
    (a restart) starts warm; both bit-identical to recomputing."""
    ref = reference(model, kv)
    llm = LLM(model, block_size=BS, kv_cache_dtype=kv, kv_cache_memory=pool(kv), kv_tier_dir=str(tmp_path))
    for p in PROMPTS:
        run(llm, p)
    llm.llm_engine.flush_kv_tier()
    stats = llm.llm_engine.tier.tier.stats
    assert stats.stored_blocks > 0 and stats.dropped_blocks == 0
    got = run(llm, PROMPTS[0])  # evicted from the pool by the later prompts: back from disk
    assert got[3].num_tier_tokens > 0 and got[3].num_cached_tokens == 40
    check_same(got[:3], ref[0])
    llm.llm_engine.flush_kv_tier()

    restarted = LLM(model, block_size=BS, kv_cache_dtype=kv, kv_cache_memory=pool(kv), kv_tier_dir=str(tmp_path))
    warm = 0
    for p, r in zip(PROMPTS, ref):
        got = run(restarted, p)
        warm += got[3].num_tier_tokens
        check_same(got[:3], r)
    assert warm >= 4 * 40  # at least the prompts the first engine's pool evicted
    assert restarted.llm_engine.tier.tier.stats.corrupt_files == 0


def test_write_through_and_stats(model: Path, tmp_path: Path) -> None:
    llm = LLM(model, block_size=BS, kv_tier_dir=str(tmp_path), kv_tier_write_through=True)
    run(llm, PROMPTS[0])
    llm.llm_engine.flush_kv_tier()
    assert len(list(tmp_path.glob("*.kvb"))) == 10  # the prompt's 10 full blocks (the pool evicted nothing)
    d = llm.llm_engine.tier.tier.stats.as_dict()
    assert d["tier_stored_blocks"] == 10 and d["tier_size_bytes"] > 0
    b = LLM(model, block_size=BS, kv_tier_dir=str(tmp_path))
    m = run(b, PROMPTS[0])[3]
    assert m.as_dict()["tier_tokens"] == 40
    assert b.llm_engine.tier.tier.stats.as_dict()["tier_hit_blocks"] == 10


def test_bound_evicts_least_recently_used(model: Path, tmp_path: Path) -> None:
    llm = LLM(model, block_size=BS, kv_tier_dir=str(tmp_path), kv_tier_write_through=True)
    run(llm, PROMPTS[0])
    llm.llm_engine.flush_kv_tier()
    one = max(f.stat().st_size for f in tmp_path.glob("*.kvb"))
    small = LLM(model, block_size=BS, kv_tier_dir=str(tmp_path), kv_tier_write_through=True,
                kv_tier_bytes=25 * one)
    for p in PROMPTS[1:4]:
        run(small, p)
    small.llm_engine.flush_kv_tier()
    total = sum(f.stat().st_size for f in tmp_path.glob("*.kvb"))
    assert total <= 25 * one
    assert small.llm_engine.tier.tier.stats.evicted_files > 0
    # the oldest files (the first prompt's, never read since) went first: the last prompt's are all there
    again = run(LLM(model, block_size=BS, kv_tier_dir=str(tmp_path)), PROMPTS[3])[3]
    assert again.num_tier_tokens == 40


def stored(model: Path, tmp_path: Path, prompt: list[int]) -> list[Path]:
    """The tier files of `prompt`'s blocks, oldest first (write-through, one engine)."""
    llm = LLM(model, block_size=BS, kv_tier_dir=str(tmp_path), kv_tier_write_through=True)
    run(llm, prompt)
    llm.llm_engine.flush_kv_tier()
    hashes = llm.llm_engine.block_manager.prompt_block_hashes(prompt)
    return [tmp_path / (h.hex() + ".kvb") for h in hashes]


@pytest.mark.parametrize("fault", ["flipped", "truncated", "renamed", "foreign"])
def test_bad_file_is_removed_and_recomputed(model: Path, tmp_path: Path, fault: str,
                                            caplog: pytest.LogCaptureFixture) -> None:
    ref = reference(model, "auto")[0]
    files = stored(model, tmp_path, PROMPTS[0])
    bad = files[5]
    data = bad.read_bytes()
    if fault == "flipped":
        flipped = bytearray(data)
        flipped[-3] ^= 0x10
        bad.write_bytes(bytes(flipped))
    elif fault == "truncated":  # what a write cut short would leave, had it not gone through a temp name
        bad.write_bytes(data[: len(data) // 2])
    elif fault == "renamed":  # another block's file under this block's name
        bad.write_bytes(files[4].read_bytes())
    else:  # the same block, stored by an engine with another KV format
        other = LLM(model, block_size=BS, kv_cache_dtype="float16", kv_tier_dir=str(tmp_path / "f16"),
                    kv_tier_write_through=True)
        run(other, PROMPTS[0])
        other.llm_engine.flush_kv_tier()
        name = other.llm_engine.block_manager.prompt_block_hashes(PROMPTS[0])[5].hex() + ".kvb"
        bad.write_bytes((tmp_path / "f16" / name).read_bytes())
    llm = LLM(model, block_size=BS, kv_tier_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="kvlm"):
        got = run(llm, PROMPTS[0])
    assert got[3].num_tier_tokens == 5 * BS  # the blocks before the bad one
    check_same(got[:3], ref)
    assert not bad.exists()
    assert llm.llm_engine.tier.tier.stats.corrupt_files == 1
    warnings = [r for r in caplog.records if "KV tier" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0].getMessage()


def test_temp_file_of_a_dead_writer_is_never_loaded(model: Path, tmp_path: Path) -> None:
    """SIGKILL mid-write leaves `.tmp-<hash>-...` and no `<hash>.kvb`: readers look only at the latter."""
    files = stored(model, tmp_path, PROMPTS[0])
    data = files[2].read_bytes()
    for f in files[2:]:
        f.unlink()
    (tmp_path / f".tmp-{files[2].stem}-99999-1").write_bytes(data[: len(data) // 2])
    ref = reference(model, "auto")[0]
    got = run(LLM(model, block_size=BS, kv_tier_dir=str(tmp_path)), PROMPTS[0])
    assert got[3].num_tier_tokens == 2 * BS
    check_same(got[:3], ref)


def test_file_removed_between_lookup_and_load(model: Path, tmp_path: Path) -> None:
    files = stored(model, tmp_path, PROMPTS[0])
    llm = LLM(model, block_size=BS, kv_tier_dir=str(tmp_path))
    tier = llm.llm_engine.tier.tier
    names = [bytes.fromhex(f.stem) for f in files]
    assert tier.lookup(names) == 10
    files[3].unlink()  # another process's LRU pass, between the lookup and the read
    toks = [tuple(PROMPTS[0][i * BS : (i + 1) * BS]) for i in range(10)]
    k, _ = tier.load_run(names, toks)
    assert k.shape[1] == 3 and tier.stats.corrupt_files == 0  # a miss, not a corrupt file
    ref = reference(model, "auto")[0]
    got = run(llm, PROMPTS[0])
    assert got[3].num_tier_tokens == 3 * BS
    check_same(got[:3], ref)


CHILD = r"""
import json, resource, signal, sys
sys.path[:0] = {helpers!r}
from kvlm import LLM, SamplingParams
model, tier, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
if limit:  # a full disk: writes past `limit` bytes fail (EFBIG; SIGXFSZ ignored)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
llm = LLM(model, block_size=4, kv_tier_dir=tier, kv_tier_write_through=True)
out = []
for p in json.loads(sys.argv[4]):
    r = llm.llm_engine.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while not r.is_finished:
        llm.llm_engine.step()
    out.append([r.output_token_ids, r.metrics.num_tier_tokens])
llm.llm_engine.flush_kv_tier()
print(json.dumps({{"out": out, "writable": llm.llm_engine.tier.tier.writable,
                  "corrupt": llm.llm_engine.tier.tier.stats.corrupt_files}}))
"""


def child(model: Path, tier: Path, prompts: list[list[int]], limit: int = 0) -> subprocess.Popen:
    helpers = [str(Path(__file__).parents[1] / "helpers")]
    code = CHILD.format(helpers=helpers)
    return subprocess.Popen([sys.executable, "-c", code, str(model), str(tier), str(limit), json.dumps(prompts)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ})


def result(p: subprocess.Popen) -> tuple[dict, str]:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


def test_two_processes_share_a_directory(model: Path, tmp_path: Path) -> None:
    """Two processes write the same blocks at once (equal bytes, atomic renames); a third loads all of them."""
    ref = [r[0] for r in reference(model, "auto")]
    a, b = child(model, tmp_path, PROMPTS), child(model, tmp_path, PROMPTS[::-1])
    (ra, _), (rb, _) = result(a), result(b)
    assert [o[0] for o in ra["out"]] == ref and [o[0] for o in rb["out"]][::-1] == ref
    assert ra["corrupt"] == rb["corrupt"] == 0
    assert not list(tmp_path.glob(".tmp-*"))
    rc, _ = result(child(model, tmp_path, PROMPTS))
    assert [o[0] for o in rc["out"]] == ref
    assert all(o[1] == 40 for o in rc["out"]) and rc["corrupt"] == 0


def test_full_disk_turns_storing_off_with_one_warning(model: Path, tmp_path: Path) -> None:
    res, err = result(child(model, tmp_path, PROMPTS[:3], limit=1000))  # smaller than one block's file
    assert res["writable"] is False
    assert [o[0] for o in res["out"]] == [r[0] for r in reference(model, "auto")[:3]]
    assert err.count("KV tier: writing to") == 1 and "Traceback" not in err
    assert not list(tmp_path.glob("*.kvb")) and not list(tmp_path.glob(".tmp-*"))


def test_refused_where_blocks_are_not_one_prefix(model: Path, tmp_path: Path) -> None:
    with pytest.raises(ParameterError, match="prefix caching"):
        LLM(model, block_size=BS, kv_tier_dir=str(tmp_path), enable_prefix_caching=False)
    with pytest.raises(ParameterError, match="unbounded"):
        LLM(model, block_size=BS, kv_tier_dir=str(tmp_path), max_kv_tokens=64)
    with pytest.raises(ParameterError, match="less than two KV blocks"):
        LLM(model, block_size=BS, kv_tier_dir=str(tmp_path), kv_tier_bytes=100)


def test_server_restart_starts_warm_and_metrics_split_hits(tmp_path: Path) -> None:
    """`kvlm serve --kv-tier-dir --kv-tier-write-through`: a stopped server's prompt blocks reach the disk, a
    new server loads them (same text), and /metrics splits prompt tokens into pool / tier / miss."""
    import httpx
    from server_utils import ServerProcess

    model = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_config())
    args = ("--served-model-name", "tiny", "--block-size", "4", "--kv-tier-dir", str(tmp_path / "tier"),
            "--kv-tier-write-through")
    prompt = "The tier keeps this prompt's blocks on disk for the next server."

    def complete(server: ServerProcess) -> str:
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 5,
                                                             "temperature": 0}, timeout=60)
        return r.json()["choices"][0]["text"]

    with ServerProcess(model, *args) as first:
        text = complete(first)
        m = first.metrics()
        assert m['kvlm:prefix_cache_source_tokens_total{source="tier"}'] == 0
        assert m['kvlm:prefix_cache_source_tokens_total{source="miss"}'] > 0
    assert list((tmp_path / "tier").glob("*.kvb"))  # flushed at exit
    with ServerProcess(model, *args) as second:
        assert complete(second) == text
        m = second.metrics()
        assert m['kvlm:prefix_cache_source_tokens_total{source="tier"}'] > 0
        assert m["kvlm:kv_tier_hit_blocks"] > 0 and m["kvlm:kv_tier_corrupt_files"] == 0
        assert m['kvlm:prefix_cache_source_bytes_total{source="tier"}'] == \
            m['kvlm:prefix_cache_source_tokens_total{source="tier"}'] * m["kvlm:kv_cache_bytes_per_token"]


def test_a_miss_in_pool_and_tier_says_tier_miss(model: Path, tmp_path: Path) -> None:
    llm = LLM(model, block_size=BS, kv_cache_memory=pool("auto"), kv_tier_dir=str(tmp_path))
    for p in PROMPTS:
        run(llm, p)
    llm.llm_engine.flush_kv_tier()
    for f in tmp_path.glob("*.kvb"):  # another process's LRU pass removed them
        f.unlink()
    m = run(llm, PROMPTS[0])[3]
    assert m.num_tier_tokens == 0 and m.prefix_miss is not None and m.prefix_miss.endswith("(tier miss)")
