"""`kvlm bench long` on a tiny model and a text file: its three parts' documents, the table, one JSON line
and the plot; part (c) on a tiny Gemma 3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bench import cli_json
from tiny_gemma import gemma3_config, gemma3_state, write_gemma3_gguf
from tiny_models import tiny_config, write_tiny_gguf

TEXT = "In the beginning God created the heaven and the earth. And the earth was without form, and void. " * 12


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("long") / "tiny.gguf", tiny_config(), tensor_type="Q8_0")


def test_cli_prints_a_table_and_one_json_line(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text, png = tmp_path / "text.txt", tmp_path / "long.png"
    text.write_text(TEXT)
    cfg = gemma3_config()
    gemma = write_gemma3_gguf(tmp_path / "gemma.gguf", cfg, gemma3_state(cfg), tensor_type="Q8_0")
    d, table = cli_json(capsys, ["bench", "long", str(model), "--tokens", "200", "--windows", "32", "--generate",
                                 "300", "--budget", "64", "--every", "100", "--text", str(text), "--gemma", str(gemma),
                                 "--plot", str(png)])
    assert d["plot"] == str(png) and png.stat().st_size > 1000
    assert json.loads(json.dumps(d)) == d
    ppl = {r["policy"].split(" (")[0]: r for r in d["perplexity"]}
    assert set(ppl) == {"full", "window(32)", "sinks(16)", "window(32) recomputed"}
    assert all(r["scored"] == 199 for r in d["perplexity"])  # every token once, the recomputed reference too
    assert all(r["ppl"] > 1 for r in d["perplexity"]) and ppl["full"]["vs_full"] == 1.0
    g = d["generation"]
    assert g["tokens"] == 300 and g["max_kv_bytes_held"] <= g["budget_bytes"]
    assert g["samples"][-1]["evicted_tokens"] > 300 - 64
    assert d["gemma"]["contexts"] == [256]  # the tiny model's whole context
    for ctx in map(str, d["gemma"]["contexts"]):  # one sequence's pool: sliding layers at their window, counted
        r = d["gemma"][ctx]
        assert r["per_layer_bytes"] <= r["pool_bytes"] < r["all_full_bytes"]
    assert "(a) perplexity" in table and "(b) 300 generated tokens" in table and "(c) Gemma 3" in table


def test_recomputed_window_scores_each_token_from_its_own_prompt(model: Path) -> None:
    """A window as long as the text is `full`; with a shorter one, token t (t >= window) is predicted from
    a prompt starting at q - window, q = t's stretch start (window + stride * k): each token computed
    from its own prompt here gives the same perplexity."""
    import math

    import torch

    from kvlm import EngineConfig
    from kvlm.bench.long import perplexity, recomputed
    from kvlm.engine.engine import Engine

    eng = Engine(model, EngineConfig(max_model_len=256, enable_prefix_caching=False), quiet=True)
    ids = [int(t) for t in torch.randint(3, 200, (90,), generator=torch.Generator().manual_seed(0))]
    assert recomputed(eng, ids, 90, 16)["ppl"] == perplexity(eng, ids, None, 0)["ppl"]
    nll = 0.0
    for t in range(1, 90):
        lo = 0 if t < 32 else 32 + (t - 32) // 16 * 16 - 32
        ((p0, logits),) = eng.prompt_logits(ids[lo : t + 1], t - lo - 1)
        nll -= float(logits[0].double().log_softmax(-1)[ids[t]])
    r = recomputed(eng, ids, 32, 16)
    assert r["scored"] == 89 and math.isclose(r["ppl"], math.exp(nll / 89), rel_tol=1e-12)
