"""A real `python -m kvlm serve` subprocess on a free loopback port, for the server tests."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """Start `kvlm serve MODEL *args`; `url` is http://127.0.0.1:PORT. Use as a context manager."""

    def __init__(self, model: str | os.PathLike, *args: str, env: dict[str, str] | None = None,
                 startup_timeout: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvlm-serve-{self.port}.log"
        cmd = [sys.executable, "-m", "kvlm", "serve", str(model), "--port", str(self.port), "--threads", "2",
               "--log-level", "warning", *args]
        full_env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    **(env or {})}
        self._log = open(self.log_path, "w+b")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvlm serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"kvlm serve did not start in {startup_timeout} s:\n{self.output()}")

    def output(self) -> str:
        if not self._log.closed:  # stop() closes it; the timeout path reads the log after stopping
            self._log.flush()
        return self.log_path.read_bytes().decode("utf-8", "replace")

    def metrics(self, headers: dict[str, str] | None = None) -> dict[str, float]:
        """The unlabelled-by-reason samples of /metrics, by metric name (model_name label dropped)."""
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=5.0).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r'^([a-z0-9_:]+)(\{[^}]*\})? ([0-9.e+-]+)$', line)
            if m and "le=" not in (m.group(2) or ""):
                labels = re.sub(r'model_name="[^"]*",?', "", m.group(2) or "").strip("{},")
                out[m.group(1) + (f"{{{labels}}}" if labels else "")] = float(m.group(3))
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def servers_together(*specs: tuple[tuple[Any, ...], dict[str, Any]]) -> Iterator[list[ServerProcess]]:
    """Several `ServerProcess(*args, **kwargs)` started at once, as (args, kwargs) pairs: each spends seconds
    importing, which overlap on a second core. All stopped on the way out; a failed start raises after the
    others are stopped."""
    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        futures = [pool.submit(ServerProcess, *args, **kwargs) for args, kwargs in specs]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        for f in futures:
            f.result()  # the first failed start, if any
        yield started
    finally:
        for server in started:
            server.stop()


async def greedy_completion(client: Any, model: str, prompt: str, max_tokens: int,
                            stream: bool) -> tuple[str, list[float]]:
    """A greedy completion's text and per-token logprobs through an `openai.AsyncOpenAI` client, streamed
    or not (a streamed error event raises the client's APIError)."""
    kw = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=1)
    if not stream:
        r = await client.completions.create(**kw)
        return r.choices[0].text, list(r.choices[0].logprobs.token_logprobs)
    text, lps = "", []
    async for c in await client.completions.create(stream=True, **kw):
        if c.choices:
            text += c.choices[0].text
            lps += list(c.choices[0].logprobs.token_logprobs) if c.choices[0].logprobs else []
    return text, lps


def run_doc_snippet(page: str, marker: str, url: str, timeout: float = 300) -> list[str]:
    """Run the one ```python block of docs/`page` that contains `marker` against the server at `url`, as a
    reader would (a fresh interpreter); its printed lines."""
    text = (ROOT / "docs" / page).read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if marker in b]
    r = subprocess.run([sys.executable, "-c", code.replace("http://127.0.0.1:8000", url)],
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.splitlines()
