"""`kvlm bench throughput` and `kvlm bench decode` with a quantized KV cache on a tiny model: a
`--kv-cache-memory` budget holds 3.5x (int8) / 6.5x (int4) the tokens of float32, the run reports the
peak tokens it held, and decode reports tokens/s at each `--contexts`. `kvlm bench kv`: the formats'
decode tokens/s side by side, and their bytes per token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import tiny_config, write_tiny_gguf

from kvlm.bench import decode, throughput
from kvlm.cli.main import main


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_config(head_dim=32, tie_word_embeddings=False)
    return write_tiny_gguf(tmp_path_factory.mktemp("kvfmt") / "tiny-q8-d32.gguf", cfg, tensor_type="Q8_0")


def test_budget_holds_more_tokens_and_the_peak_is_reported(model: Path) -> None:
    pool = {}
    for kv in ("float32", "int8", "int4"):
        d = throughput.run(str(model), num_prompts=6, in_range=(20, 40), out_range=(8, 16), max_num_seqs=6,
                           sequential=False, compare_hf=False, kv_cache_dtype=kv, kv_cache_memory=1 << 18)
        b = d["kvlm_batched"]
        assert 0 < b["peak_kv_tokens"] <= b["kv_pool_tokens"]
        assert b["kv_pool_tokens"] * b["kv_bytes_per_token"] <= 1 << 18
        pool[kv] = b["kv_pool_tokens"]
    assert pool["int8"] >= 3.5 * pool["float32"] and pool["int4"] >= 6.5 * pool["float32"]


def test_decode_at_contexts(model: Path) -> None:
    d = decode.run(str(model), prompt_len=16, gen_tokens=4, no_cache_tokens=4, repeats=1, compare_hf=False,
                   kv_cache_dtype="int8", contexts=(48, 96), context_gen=8)
    assert [c["context"] for c in d["context_decode"]] == [48, 96]
    assert all(c["tokens_per_s"] > 0 for c in d["context_decode"])
    assert d["kv_cache_dtype"] == "int8" and d["kv_bytes_per_token"] == 2 * 2 * 2 * 34


def test_bench_kv_side_by_side(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["-q", "bench", "kv", str(model), "--kv-cache-dtypes", "float32", "int8", "int4", "--contexts", "48", "96",
            "--context-gen", "8", "--gen-tokens", "4", "--repeats", "1"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.rstrip("\n").splitlines()
    d = json.loads(lines[-1])
    assert d["bench"] == "kv" and d["threads"] == 2 and d["kv_cache_dtypes"] == ["float32", "int8", "int4"]
    assert (d["contexts"], d["context_gen"], d["gen_tokens"], d["repeats"]) == ([48, 96], 8, 4, 1)
    per_value = {"float32": 4, "int8": 34 / 32, "int4": 18 / 32}  # 2 x layers x kv heads x head_dim values a token
    assert d["kv_bytes_per_token"] == {kv: round(2 * 2 * 2 * 32 * b) for kv, b in per_value.items()}
    for kv in d["kv_cache_dtypes"]:
        assert set(d["decode_tokens_per_s"][kv]) == {"short", "48", "96"}
        assert all(v > 0 for v in d["decode_tokens_per_s"][kv].values())
    assert lines[1].split() == ["context", "float32", "int8", "int4"] and lines[-2].startswith(" B/token")
    assert main(["-q", "bench", "kv", str(model), "--contexts", "8", "--context-gen", "8"]) == 2
    assert capsys.readouterr().err == "kvlm: error: each of --contexts must be larger than --context-gen\n"
