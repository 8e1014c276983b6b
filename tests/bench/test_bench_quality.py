"""`kvlm bench quality` on a tiny model and a text file: teacher forcing through the cache, its streamed
scoring, the rows and gates it reports, and the CLI's one JSON line.

* `Engine.prompt_logits` yields each scored position once, in order, and the logits equal the model's
  logits of a whole-prompt run (chunked == whole, bit for bit on the native path).
* The baseline row has no KLD; a KV format's KLD is >= 0 and its perplexity ratio is reported; with both
  --dtype values, `auto` is scored against `float32`. float32 against itself would be KLD 0.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
from test_bench import cli_json
from tiny_models import tiny_config, write_tiny_gguf

from kvlm import EngineConfig
from kvlm.bench import quality
from kvlm.engine.engine import Engine
from kvlm.kernels import native

TEXT = "In the beginning God created the heaven and the earth. And the earth was without form, and void. " * 12


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_config(head_dim=32, tie_word_embeddings=False)
    return write_tiny_gguf(tmp_path_factory.mktemp("quality") / "tiny-q8-d32.gguf", cfg, tensor_type="Q8_0")


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("quality") / "text.txt"
    p.write_text(TEXT)
    return p


def test_windows() -> None:
    ids = list(range(100))
    assert quality.windows(ids, 30, 0) == [ids[0:30], ids[30:60], ids[60:90]]
    assert quality.windows(ids, 30, 2) == [ids[0:30], ids[30:60]]
    assert quality.windows(ids, 200, 0) == []


@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_prompt_logits_stream_each_position_once_chunked_equals_whole(model: Path, kv: str) -> None:
    ids = [(7 * i) % 250 + 3 for i in range(60)]
    chunked = Engine(model, EngineConfig(kv_cache_dtype=kv, max_num_batched_tokens=8, enable_prefix_caching=False),
                     quiet=True)
    parts = list(chunked.prompt_logits(ids, 20))
    assert [p for p, _ in parts] == sorted(p for p, _ in parts) and parts[0][0] == 20
    got = torch.cat([lg for _, lg in parts])
    assert got.shape == (len(ids) - 1 - 20, chunked.model_config.vocab_size)
    assert not chunked.has_unfinished and chunked.runner.hidden_observer is None
    whole = Engine(model, EngineConfig(kv_cache_dtype=kv, enable_prefix_caching=False), quiet=True)
    ref = torch.cat([lg for _, lg in whole.prompt_logits(ids, 20)])
    if native.active_isa() != "reference":
        assert torch.equal(got, ref)
    else:
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_rows_and_gates(model: Path, text: Path) -> None:
    d = quality.run(str(model), threads=2, context=64, chunks=2, chunk=16, kv_cache_dtypes=("float16", "int8", "int4"),
                    dtypes=("auto", "float32"), text=str(text))
    assert d["bench"] == "quality" and d["windows"] == 2 and d["scored_tokens_per_window"] == 31
    rows = {(r["dtype"], r["kv_cache_dtype"], (r["against"] or {}).get("dtype")): r for r in d["rows"]}
    assert set(rows) == {("auto", "float32", None), ("float32", "float32", None), ("auto", "float32", "float32")} | {
        (dt, kv, dt) for dt in ("auto", "float32") for kv in ("float16", "int8", "int4")}
    for (dt, kv, against), r in rows.items():
        assert r["tokens"] == 62 and math.isfinite(r["ppl"]) and r["ppl"] > 1
        if against is None:
            assert "mean_kld" not in r
        else:
            assert r["mean_kld"] >= -1e-9 and r["p99_kld"] >= r["mean_kld"] - 1e-9 and 0 <= r["top1_agreement"] <= 1
            assert r["ppl_delta"] == pytest.approx(r["ppl"] / rows[(against, "float32", None)]["ppl"] - 1)
            # the paired per-token NLL difference: its standard error is at most its root mean square, and
            # a float16 cache under float32 activations moves no token's NLL by much
            assert 0 <= r["ppl_delta_se"] < 1
    assert rows[("float32", "float16", "float32")]["ppl_delta_se"] < 1e-3
    bpt = {kv: rows[("auto", kv, "auto")]["bytes_per_token"] for kv in ("float16", "int8", "int4")}
    assert bpt == {"float16": 2 * 2 * 2 * 32 * 2, "int8": 2 * 2 * 2 * 34, "int4": 2 * 2 * 2 * 18}
    assert set(d["gates"]) == {f"{g} (--dtype {dt})" for g in ("int8_mean_kld_le_1e-3", "int8_ppl_within_0.5%",
                                                                "int4_ppl_within_3%") for dt in ("auto", "float32")}


def test_cli_prints_a_table_and_one_json_line(model: Path, text: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "q.png"
    d, table = cli_json(capsys, ["bench", "quality", str(model), "--context", "32", "--chunks", "1", "--chunk", "8",
                                 "--kv-cache-dtype", "int8", "--dtype", "auto", "--text", str(text),
                                 "--plot", str(png)])
    assert d["plot"] == str(png) and png.stat().st_size > 1000
    assert "int8" in table and "against" in table
    assert json.loads(json.dumps(d)) == d


def test_bad_input(model: Path, text: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        quality.run(str(model), text=str(tmp_path / "missing.txt"))
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(ValueError, match="fewer than one"):
        quality.run(str(model), context=64, text=str(short), kv_cache_dtypes=("int8",), dtypes=("auto",))
    with pytest.raises(ValueError, match="even number"):
        quality.run(str(model), context=63, text=str(text))


def test_float_cache_over_an_int8_tier(model: Path, text: Path) -> None:
    """--kv-tier-dtype int8: each float cache also runs with the window's first half loaded from an int8 tier,
    scored against that cache alone: close (the round trip's error), not equal, and every row's tokens."""
    d = quality.run(str(model), threads=2, context=64, chunks=2, chunk=16, kv_cache_dtypes=("float16", "int8"),
                    dtypes=("float32",), text=str(text), kv_tier_dtype="int8")
    tier = {r["kv_cache_dtype"]: r for r in d["rows"] if r.get("kv_tier_dtype") == "int8"}
    assert set(tier) == {"float32", "float16"}  # not int8: its blocks go to a tier as stored
    for kv, r in tier.items():
        assert r["against"] == {"dtype": "float32", "kv_cache_dtype": kv} and r["tokens"] == 62
        assert 0 < r["mean_kld"] < 1e-2 and r["top1_agreement"] > 0.9
        assert r["tier_bytes_per_token"] < r["bytes_per_token"]
    assert set(d["gates"]) == {"int8_mean_kld_le_1e-3 (--dtype float32)", "int8_ppl_within_0.5% (--dtype float32)"}


def test_tier_writers_finish_before_their_directory_goes(model: Path, text: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """The tiers' writer threads still hold the last window's blocks when scoring ends: `run` waits for them
    before it removes the temporary tier directories (a writer that lagged once failed CI's rmtree). A writer
    slowed here would otherwise find its directory gone and log that storing failed."""
    from kvlm.kv_cache.tier import KVTier

    write = KVTier._write

    def slow_write(self: KVTier, item: object) -> None:
        time.sleep(0.05)
        write(self, item)

    monkeypatch.setattr(KVTier, "_write", slow_write)
    with caplog.at_level("WARNING", logger="kvlm"):
        quality.run(str(model), threads=2, context=64, chunks=1, chunk=16, kv_cache_dtypes=("float16",),
                    dtypes=("float32",), text=str(text), kv_tier_dtype="int8")
        time.sleep(0.3)  # a writer that was still behind reaches its missing directory by now
    assert not [r for r in caplog.records if "KV tier" in r.getMessage()]
