"""README's snippets, run as a reader would: the offline Python snippet, the openai-client snippet and the
curl lines, against a live `kvlm serve` on the default model. Each snippet must bound its own length
(every generating call names max_tokens) and the server must honour it; the subprocess timeout is only a
hang guard, since speed lives in benchmarks, not in timed tests."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
HANG_GUARD_S = 300


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=ROOT)


def generating_calls(code: str) -> list[str]:
    """The source of each call in a Python snippet that generates text (up to its line's end)."""
    return re.findall(r"(?:\.generate|\.chat|\.stream|\.create)\((?:[^()]|\([^()]*\))*\)", code, re.S)


def test_every_snippet_bounds_its_length() -> None:
    """A reader who pastes a snippet gets an answer of known length, never a run to the context's end."""
    calls = [c for b in blocks("python") for c in generating_calls(b)]
    assert len(calls) >= 4, calls
    for call in calls:
        assert "max_tokens" in call, call
    bodies = re.findall(r"-d '(\{.*?\})'", "\n".join(blocks("bash")))
    assert len(bodies) >= 2
    for body in bodies:
        assert "max_tokens" in json.loads(body), body


@pytest.fixture(scope="module")
def server(smollm2_server_process):
    return smollm2_server_process  # `kvlm serve` at its defaults, named smollm2-135m (tests/conftest.py)


def test_offline_snippet(smollm2_gguf: Path) -> None:
    (code,) = [b for b in blocks("python") if "from kvlm import LLM" in b]
    r = run_python(code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "'ttft_s'" in r.stdout and ("length" in r.stdout or "stop" in r.stdout), r.stdout[-500:]


def test_openai_client_snippet(server) -> None:
    (code,) = [b for b in blocks("python") if "from openai import OpenAI" in b]
    assert "http://127.0.0.1:8000/v1" in code
    r = run_python(code.replace("http://127.0.0.1:8000", server.url))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip()


def test_curl_lines(server) -> None:
    (block,) = [b for b in blocks("bash") if "curl -s localhost:8000/v1/completions" in b]
    commands = re.findall(r"^(curl .*?)(?=^\S|\Z)", block, re.S | re.M)
    assert len(commands) == 2
    for cmd in commands:
        cmd = cmd.replace("localhost:8000", server.url.removeprefix("http://")).replace("\\\n", " ")
        limit = json.loads(re.search(r"-d '(\{.*?\})'", cmd).group(1))["max_tokens"]
        r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=HANG_GUARD_S)
        assert r.returncode == 0 and r.stdout.strip(), (cmd, r.stderr)
        assert '"error"' not in r.stdout, r.stdout[:500]
        if "stream" in cmd:
            events = [ln.removeprefix("data: ") for ln in r.stdout.splitlines() if ln.startswith("data: ")]
            assert events[-1] == "[DONE]", events[-3:]
            chunks = [json.loads(e) for e in events[:-1]]
            finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
            assert finish[-1] in ("stop", "length"), finish[-3:]
            assert sum(bool(c["choices"] and c["choices"][0]["delta"].get("content")) for c in chunks) <= limit
        else:
            usage = json.loads(r.stdout)["usage"]
            assert 0 < usage["completion_tokens"] <= limit, usage
