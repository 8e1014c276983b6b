"""Without Ray: `kvlm serve --replicas` says in one line what to install; a plain `kvlm serve` never imports Ray."""

from __future__ import annotations

import subprocess
import sys

import httpx
from server_utils import ROOT, ServerProcess, free_port


def _no_ray(tmp_path) -> str:
    """A PYTHONPATH on which `import ray` fails as it does where Ray is not installed."""
    pkg = tmp_path / "ray"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError(\"No module named 'ray'\")\n")
    return f"{tmp_path}:{ROOT}"


def test_replicas_without_ray_is_one_line(tmp_path, tiny_gguf):
    env = {"PYTHONPATH": _no_ray(tmp_path), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "kvlm", "serve", str(tiny_gguf), "--replicas", "2", "--port",
                        str(free_port())], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert r.returncode != 0
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "pip install 'kvlm[ray]'" in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_one_process_serve_never_imports_ray(tmp_path, tiny_gguf):
    with ServerProcess(tiny_gguf, env={"PYTHONPATH": _no_ray(tmp_path)}) as s:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and httpx.get(s.url + "/health").status_code == 200
