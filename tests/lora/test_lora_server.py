"""`kvlm serve --lora NAME=PATH` driven by the real `openai` client: /v1/models lists adapters with the base as
`parent`, the `model` field selects one (its tokens equal the offline engine's under that adapter), an unknown
name is a 404 in OpenAI's shape, adapters load and unload at run time (vLLM's endpoints), bad adapters are one
line (an HTTP 400 body, or `kvlm serve`'s stderr and exit code)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from deps import need
from server_utils import ROOT, ServerProcess
from tiny_models import random_state_dict, tiny_config, write_tiny_gguf

from kvlm import EngineConfig, SamplingParams
from kvlm.engine.engine import Engine

CFG = tiny_config()
STATE = random_state_dict(CFG)
PROMPT = [5, 17, 99, 42, 7, 8, 120, 33]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    need("peft")
    from tiny_lora import peft_model, save_peft, write_gguf_lora

    root = tmp_path_factory.mktemp("lora-server")
    base = write_tiny_gguf(root / "tiny.gguf", CFG, STATE)
    a = save_peft(peft_model(CFG, STATE, ["q_proj", "v_proj", "down_proj"], seed=3), root / "a")
    b = write_gguf_lora(root / "b.gguf", peft_model(CFG, STATE, ["o_proj", "up_proj"], r=2, alpha=4.0, seed=4),
                        CFG, 4.0)
    return base, a, b


def _offline(files: tuple[Path, Path, Path], lora: str | None) -> list[int]:
    base, a, b = files
    eng = Engine(base, EngineConfig(), quiet=True)
    eng.load_lora("a", a)
    eng.load_lora("b", b)
    req = eng.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), lora=lora)
    while not req.is_finished:
        eng.step()
    return req.output_token_ids


def test_openai_client_lists_uses_loads_and_unloads_adapters(files: tuple[Path, Path, Path]) -> None:
    openai = need("openai")
    base, a, b = files
    with ServerProcess(base, "--lora", f"a={a}", "--served-model-name", "tiny") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {"tiny", "a"} and models["a"].parent == "tiny"

        out = client.completions.create(model="a", prompt=PROMPT, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == _decode(srv.url, _offline(files, "a"))
        assert out.model == "a"  # the response names the adapter, as vLLM's does
        chunks = list(client.completions.create(model="a", prompt=PROMPT, max_tokens=2, stream=True))
        assert chunks and {c.model for c in chunks} == {"a"}
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="nope", prompt="hi", max_tokens=2)
        assert e.value.body["code"] == "model_not_found"  # type: ignore[index]

        # run-time load (a GGUF LoRA file), use, then unload
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(b)})
        assert r.status_code == 200, r.text
        assert {m.id for m in client.models.list().data} == {"tiny", "a", "b"}
        chat = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.choices[0].finish_reason in ("length", "stop") and chat.model == "b"
        resp = client.responses.create(model="b", input="hi", max_output_tokens=4)
        assert resp.model == "b"
        out_b = client.completions.create(model="b", prompt=PROMPT, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert out_b.choices[0].text == _decode(srv.url, _offline(files, "b"))
        base_out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert base_out.choices[0].text == _decode(srv.url, _offline(files, None)) and base_out.model == "tiny"
        for body, code, words in [({"lora_name": "b", "lora_path": str(b)}, 400, "already loaded"),
                                  ({"lora_name": "c", "lora_path": "/nonexistent"}, 400, "no such file"),
                                  ({"lora_name": "c"}, 400, "lora_path")]:
            r = httpx.post(srv.url + "/v1/load_lora_adapter", json=body)
            assert r.status_code == code and words in r.json()["error"]["message"], r.text
        assert httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
        r = httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "b"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="b", prompt="hi", max_tokens=2)
        assert httpx.get(srv.url + "/health").status_code == 200  # still serving


def _decode(url: str, ids: list[int]) -> str:
    r = httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def test_serve_refuses_a_bad_adapter_in_one_line(files: tuple[Path, Path, Path], tmp_path: Path) -> None:
    base, a, _ = files
    for flag, words in [(f"a={tmp_path / 'none'}", "no such file or folder"), ("nonsense", "expected NAME=PATH"),
                        (f"a={a}", "already loaded")]:
        extra = ["--lora", f"a={a}"] if words == "already loaded" else []
        p = subprocess.run([sys.executable, "-m", "kvlm", "serve", str(base), "--port", "0", *extra, "--lora", flag],
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert p.returncode != 0 and words in p.stderr, p.stderr
        errors = [ln for ln in p.stderr.splitlines() if ln.startswith("kvlm: error:")]
        assert "Traceback" not in p.stderr and len(errors) == 1 and words in errors[0], p.stderr
