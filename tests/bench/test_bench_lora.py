"""`kvlm bench lora`: its random adapter written as a PEFT folder and as llama.cpp's GGUF LoRA is one adapter
(the same weights once loaded, Q/K rows permuted and un-permuted exactly), and the bench drives llama.cpp with
that file in a child process (a stand-in llama_cpp package here: CI has no llama.cpp). Timings are only
checked for sign."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from kvlm import LLM
from kvlm.bench.lora import ALL_TARGETS, write_random_adapter, write_random_gguf_lora
from kvlm.cli.main import main

FAKE_LLAMA_CPP = """
import json, os
__version__ = "fake"


class Llama:
    # Stands in for llama_cpp.Llama in the worker process: logs the adapter file it is given.
    def __init__(self, model_path, lora_path=None, **kw):
        head = open(lora_path, "rb").read(4).decode() if lora_path else None
        with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
            f.write(json.dumps({"init": model_path, "lora": head, "threads": kw["n_threads"]}) + "\\n")

    def reset(self):
        pass

    def eval(self, tokens):
        pass

    def sample(self, **kw):
        return 7
"""


@pytest.mark.parametrize("targets", [ALL_TARGETS, ("q_proj", "v_proj")])
def test_random_adapter_is_the_same_as_peft_and_as_gguf(tiny_gguf: Path, tmp_path: Path,
                                                        targets: tuple[str, ...]) -> None:
    llm = LLM(str(tiny_gguf), dtype="float32", num_threads=1)
    eng = llm.llm_engine
    cfg = eng.model_config
    eng.load_lora("peft", str(write_random_adapter(tmp_path / "peft", cfg, 4, targets=targets)))
    eng.load_lora("gguf", str(write_random_gguf_lora(tmp_path / "a.gguf", tiny_gguf, cfg, 4, targets=targets)))
    peft, gguf = eng.loras.get("peft"), eng.loras.get("gguf")
    assert set(peft.targets) == set(gguf.targets) == set(targets)
    assert peft.weights.keys() == gguf.weights.keys() and peft.weights
    for k, w in peft.weights.items():
        v = gguf.weights[k]
        assert torch.equal(w.a.data, v.a.data) and torch.equal(w.bt, v.bt) and torch.equal(w.spans, v.spans), k


def test_bench_lora_runs_llama_cpp_with_the_gguf_adapter(tiny_gguf: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "fake" / "llama_cpp").mkdir(parents=True)
    (tmp_path / "fake" / "llama_cpp" / "__init__.py").write_text(FAKE_LLAMA_CPP)
    log = tmp_path / "llama.log"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'fake'}:{Path(__file__).parents[2]}")
    assert main(["-q", "bench", "lora", str(tiny_gguf), "--rank", "4", "--max-tokens", "4", "--repeats", "2",
                 "--target-modules", "q_proj,v_proj", "--llama-python", sys.executable]) == 0
    lines = capsys.readouterr().out.rstrip("\n").splitlines()
    d = json.loads(lines[-1])
    assert d["bench"] == "lora" and d["targets"] == ["q_proj", "v_proj"] and d["rank"] == 4
    assert d["adapter"] == "random rank 4, q_proj, v_proj, float32" and d["adapter_bytes"] > 0
    assert d["ratio"] > 0 and len(d["runs"]["base"]) == len(d["runs"]["lora"]) == 2
    peer = d["llama_cpp"]
    assert peer["version"] == "fake" and peer["ratio"] > 0 and len(peer["runs"]["lora"]) == 2, peer
    inits = [json.loads(x) for x in log.read_text().splitlines()]
    assert [c["lora"] for c in inits] == [None, "GGUF"]  # the base, then the base with the adapter's file
    assert all(c["init"] == str(tiny_gguf) and c["threads"] == 2 for c in inits)
    assert any(line.startswith("llama.cpp (llama-cpp-python) fake: base") for line in lines)

    # no peer: a line that says why, not an error
    assert main(["-q", "bench", "lora", str(tiny_gguf), "--rank", "4", "--max-tokens", "4", "--repeats", "1",
                 "--no-llama-cpp"]) == 0
    out = capsys.readouterr().out
    assert "llama.cpp (llama-cpp-python): skipped: disabled by flag" in out


def test_bench_lora_refuses_unknown_target_modules(tiny_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "lora", str(tiny_gguf), "--target-modules", "q_proj,lm_head"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--target-modules: lm_head" in err[0], err
