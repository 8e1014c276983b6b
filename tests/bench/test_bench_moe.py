"""`kvlm bench moe` on a tiny random Qwen3-MoE GGUF: the table, the JSON document and the plot; the counts
are checked against what the run must have routed (each processed token: top-k rows in every routed layer),
the bytes at batch 1 against the dense weights plus k experts per layer; a dense model is one error line."""

from __future__ import annotations

from pathlib import Path

import pytest
from deps import need_native
from test_bench import assert_header, assert_png, cli_json
from tiny_moe import moe_config, moe_state_dict, write_moe_gguf

from kvlm.cli.main import main


def test_bench_moe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    need_native()
    cfg = moe_config("qwen3_moe", head_dim=32)
    path = write_moe_gguf(tmp_path / "moe.gguf", cfg, moe_state_dict(cfg), tensor_type="Q8_0")
    png = tmp_path / "moe.png"
    d, table = cli_json(capsys, ["bench", "moe", str(path), "--batches", "1", "3", "--max-tokens", "5",
                                 "--prompt-len", "7", "--plot", str(png)])
    assert_header(d, "moe")
    assert_png(png) and d["plot"] == str(png)
    L, E, k = cfg["num_hidden_layers"], cfg["num_experts"], cfg["num_experts_per_tok"]
    assert (d["experts"], d["experts_per_token"], d["routed_layers"]) == (E, k, L)
    assert d["active_parameters"] < d["total_parameters"]
    assert sum(d["expert_load"]) == L * k * (1 + 3) * (7 + 5 - 1)  # prefill + decode tokens, every batch
    one, three = d["rows"]
    assert (one["batch"], one["tokens"], three["batch"], three["tokens"]) == (1, 4, 3, 12)
    assert one["experts_touched_per_layer"] == k and k <= three["experts_touched_per_layer"] <= min(E, 3 * k)
    assert one["bytes_per_token"] == d["dense_weight_bytes"] + L * k * d["expert_bytes"]
    assert three["bytes_per_token"] < one["bytes_per_token"]  # three tokens share a step's dense weights
    assert all(r["tokens_per_s"] > 0 and 0 < r["fraction_of_bandwidth"] for r in d["rows"])
    assert "experts/layer" in table and "expert load" in table


def test_bench_moe_on_a_dense_model_is_one_line(tiny_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "moe", str(tiny_gguf), "--batches", "1", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a mixture-of-experts model" in err[0], err
