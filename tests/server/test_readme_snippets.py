"""README's snippets, run as a reader would: the offline Python snippet, the openai-client snippet and the
curl lines, against a live `kvlm serve` on the default model; each must end within 30 s."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_utils import ServerProcess

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
LIMIT_S = 30.0


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def run_python(code: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return r, time.monotonic() - t


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    with ServerProcess(smollm2_gguf, "--served-model-name", "smollm2-135m") as s:
        yield s


def test_offline_snippet(smollm2_gguf: Path) -> None:
    (code,) = [b for b in blocks("python") if "from kvlm import LLM" in b]
    r, took = run_python(code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "'ttft_s'" in r.stdout and ("length" in r.stdout or "stop" in r.stdout), r.stdout[-500:]
    assert took < LIMIT_S + 10, f"took {took:.1f} s"  # + the interpreter and model load of a fresh process


def test_openai_client_snippet(server) -> None:
    (code,) = [b for b in blocks("python") if "from openai import OpenAI" in b]
    assert "http://127.0.0.1:8000/v1" in code
    r, took = run_python(code.replace("http://127.0.0.1:8000", server.url))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip()
    assert took < LIMIT_S, f"took {took:.1f} s"


def test_curl_lines(server) -> None:
    (block,) = [b for b in blocks("bash") if "curl -s localhost:8000/v1/completions" in b]
    commands = re.findall(r"^(curl .*?)(?=^\S|\Z)", block, re.S | re.M)
    assert len(commands) == 2
    for cmd in commands:
        cmd = cmd.replace("localhost:8000", server.url.removeprefix("http://")).replace("\\\n", " ")
        t = time.monotonic()
        r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t
        assert r.returncode == 0 and r.stdout.strip(), (cmd, r.stderr)
        assert '"error"' not in r.stdout, r.stdout[:500]
        assert took < LIMIT_S, f"{cmd[:40]}... took {took:.1f} s"
