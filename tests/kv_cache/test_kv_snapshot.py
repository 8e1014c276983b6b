"""KV snapshots (kvlm.kv_cache.snapshot): a saved then loaded prefix gives the tokens of recomputing it; every
refusal (another model, dtype, block size, layout; corrupt, truncated, not a snapshot, no prefix cache)
is one SnapshotError line that leaves the engine unchanged and still serving; the CLI commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_runs import assert_same_logits, run_alone

from kvlm import LLM, SamplingParams
from kvlm.errors import SnapshotError

BS = 4
PARAMS = SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
PREFIX = list(range(30, 70))  # 10 blocks of 4
PROMPT = PREFIX + [7, 8, 9]


def greedy_with_logits(llm: LLM, ids: list[int]) -> tuple[list[int], torch.Tensor, int]:
    req, logits = run_alone(llm.llm_engine, ids, PARAMS)
    return req.output_token_ids, logits, req.metrics.num_cached_tokens


@pytest.fixture(scope="module")
def snapshot(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("snap") / "prefix.safetensors"
    info = LLM(tiny_gguf, block_size=BS).save_prefix({"prompt_token_ids": PREFIX + [1, 2]}, path)
    assert (info.num_tokens, info.num_blocks) == (40, 10)
    return path


def cache_state(llm: LLM) -> tuple:
    bm = llm.llm_engine.block_manager
    return (dict(bm.hash_to_block), list(bm.free_blocks), list(bm.cached_free), list(bm.ref_counts),
            [t.clone() for t in llm.llm_engine.kv_cache.k])


def test_round_trip_equals_recompute(tiny_gguf: Path, snapshot: Path) -> None:
    fresh = LLM(tiny_gguf, block_size=BS, enable_prefix_caching=False)
    ref_tokens, ref_logits, _ = greedy_with_logits(fresh, PROMPT)
    llm = LLM(tiny_gguf, block_size=BS)
    info = llm.load_prefix(snapshot)
    assert info.blocks_loaded == 10 and llm.llm_engine.block_manager.num_cached_blocks == 10
    tokens, logits, cached = greedy_with_logits(llm, PROMPT)
    assert cached == 40
    assert tokens == ref_tokens
    assert_same_logits(logits, ref_logits)
    again = llm.load_prefix(snapshot)  # already cached: nothing written
    assert again.blocks_loaded == 0
    llm.llm_engine.block_manager.check([])


def write_header_variant(src: Path, dst: Path, **changes: str) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        meta = {**f.metadata(), **changes}
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    save_file(tensors, str(dst), metadata=meta)


def bad_files(snapshot: Path, tmp: Path) -> dict[str, tuple[Path, str]]:
    data = snapshot.read_bytes()
    out = {}
    (tmp / "truncated.safetensors").write_bytes(data[: len(data) * 2 // 3])
    out["truncated"] = (tmp / "truncated.safetensors", "corrupt or truncated")
    flipped = bytearray(data)
    flipped[-100] ^= 0x40
    (tmp / "flipped.safetensors").write_bytes(bytes(flipped))
    out["flipped"] = (tmp / "flipped.safetensors", "checksum")
    (tmp / "garbage.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    out["garbage"] = (tmp / "garbage.safetensors", "corrupt or truncated")
    (tmp / "empty.safetensors").write_bytes(b"")
    out["empty"] = (tmp / "empty.safetensors", "corrupt or truncated")
    write_header_variant(snapshot, tmp / "model.safetensors", model_fingerprint="0" * 64)
    out["model"] = (tmp / "model.safetensors", "another model")
    write_header_variant(snapshot, tmp / "layout.safetensors", kv_layout=json.dumps({"layout": "paged", "layers": 3}))
    out["layout"] = (tmp / "layout.safetensors", "another KV layout")
    write_header_variant(snapshot, tmp / "format.safetensors", format="something-else")
    out["format"] = (tmp / "format.safetensors", "not a kvlm prefix snapshot")
    write_header_variant(snapshot, tmp / "count.safetensors", num_tokens="44")
    out["count"] = (tmp / "count.safetensors", "shapes disagree")
    out["missing"] = (tmp / "nope.safetensors", "no such file")
    return out


def test_every_refusal_leaves_the_engine_unchanged_and_serving(tiny_gguf: Path, snapshot: Path,
                                                               tmp_path: Path) -> None:
    llm = LLM(tiny_gguf, block_size=BS)
    expected = llm.generate({"prompt_token_ids": PROMPT}, PARAMS)[0].outputs[0].token_ids
    before = cache_state(llm)
    for name, (path, words) in bad_files(snapshot, tmp_path).items():
        with pytest.raises(SnapshotError, match=words) as e:
            llm.load_prefix(path)
        assert "\n" not in str(e.value), name
        after = cache_state(llm)
        assert after[:4] == before[:4], f"{name}: block manager changed"
        # bitwise: the pool is allocated untouched, so slots never written may hold NaN (NaN != NaN)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(after[4], before[4])), \
            f"{name}: KV pool changed"
    assert llm.generate({"prompt_token_ids": PROMPT}, PARAMS)[0].outputs[0].token_ids == expected


def test_refused_for_another_model_dtype_or_block_size(tiny_gguf: Path, snapshot: Path, tmp_path: Path) -> None:
    from tiny_models import random_state_dict, tiny_config, write_tiny_gguf

    other = write_tiny_gguf(tmp_path / "other.gguf", tiny_config(), random_state_dict(tiny_config(), seed=9))
    cases = [(LLM(other, block_size=BS), "another model"),
             (LLM(tiny_gguf, block_size=BS, dtype="bfloat16"), "another dtype"),
             (LLM(tiny_gguf, block_size=8), "another block size")]
    for llm, words in cases:
        with pytest.raises(SnapshotError, match=words):
            llm.load_prefix(snapshot)
        assert llm.llm_engine.block_manager.num_cached_blocks == 0
        assert len(llm.generate({"prompt_token_ids": PROMPT}, PARAMS)[0].outputs[0].token_ids) == 10
    for cfg in ({"enable_prefix_caching": False}, {"kv_cache_layout": "contiguous"}):
        with pytest.raises(SnapshotError, match="prefix caching"):
            LLM(tiny_gguf, block_size=BS, **cfg).load_prefix(snapshot)


def test_snapshot_larger_than_free_pool_is_refused(tiny_gguf: Path, snapshot: Path) -> None:
    from engine_runs import small_bytes

    llm = LLM(tiny_gguf, block_size=BS, kv_cache_memory=12 * BS * small_bytes(tiny_gguf))
    eng = llm.llm_engine
    req = eng.add_request(list(range(20)), SamplingParams(max_tokens=20, ignore_eos=True))
    eng.step()  # holds 6 of the 12 blocks
    with pytest.raises(SnapshotError, match="free KV blocks"):
        llm.load_prefix(snapshot)
    while not req.is_finished:
        eng.step()
    eng.block_manager.check([])


def test_cli_cache_save_and_prefix_snapshot(tiny_gguf: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from kvlm.cli.main import main

    path = tmp_path / "p.safetensors"
    text = "hello world, a prefix long enough for a few blocks"
    assert main(["-q", "cache", "save", str(tiny_gguf), text, str(path), "--block-size", "4"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["blocks"] == doc["tokens"] // 4 > 0
    args = ["-q", "generate", str(tiny_gguf), text + " and more", "--block-size", "4", "--max-tokens", "4", "--json"]
    assert main(args + ["--prefix-snapshot", str(path)]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["cached_tokens"] == doc["tokens"]
    assert main(args[:-1] + ["--prefix-snapshot", str(path), "--block-size", "8"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvlm: error: {path}: snapshot is for another block size (4; this engine: 8)"]


def test_serve_prefix_snapshot_counts_as_cached_tokens(tiny_gguf: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """`kvlm serve --prefix-snapshot FILE`: the first request with that prefix reports it as cached."""
    import httpx
    from server_utils import ServerProcess

    from kvlm.cli.main import main

    path = tmp_path / "p.safetensors"
    text = "hello world, a prefix long enough for a few blocks"
    assert main(["-q", "cache", "save", str(tiny_gguf), text, str(path), "--block-size", "4"]) == 0
    saved = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"]
    with ServerProcess(tiny_gguf, "--block-size", "4", "--prefix-snapshot", str(path)) as server:
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"prompt": text + " and more", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == saved
    with pytest.raises(RuntimeError, match="another block size"):
        ServerProcess(tiny_gguf, "--block-size", "8", "--prefix-snapshot", str(path))
