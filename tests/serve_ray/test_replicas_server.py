"""`kvlm serve --replicas 2` on Ray Serve with the real default model: the same tokens as offline, the
same API, prefix routing, a replica killed mid-run, and SIGTERM leaving no process behind (by PID).

One server for the module (a local Ray instance and two 1-thread replicas: about 1.5 GiB and 20-30 s to
start here); the last test stops it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from deps import need
from server_utils import ServerProcess, greedy_completion

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Write a haiku about caches.", "1, 2, 3, 4,", "Translate to French: cat",
           "def fibonacci(n):", "Once upon a time, in a land far away, there lived a small dragon who",
           "Explain what a KV cache is in one sentence:", "Q: What is 17 + 25?\nA:"]
KEY = "replica-test-key"


def descendants(pid: int) -> set[int]:
    """Every live process under `pid` (from /proc), with its command line."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def replica_pids(server: ServerProcess) -> set[int]:
    return {p for p in descendants(server.proc.pid) if cmdline(p).startswith("ray::ServeReplica")}


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    need("ray")
    with ServerProcess(smollm2_gguf, "--replicas", "2", "--threads", "1", "--served-model-name", "smollm2-135m",
                       "--max-model-len", "1024", "--kv-cache-memory", "96MiB", "--max-num-seqs", "8",
                       "--max-queued-requests", "16", "--api-key", KEY,
                       "--speculative", "ngram", startup_timeout=240) as s:  # drafts through replicas, too
        s.model_path = smollm2_gguf
        s.headers = {"Authorization": f"Bearer {KEY}"}
        yield s


@pytest.fixture(scope="module")
def offline(smollm2_gguf):
    from kvlm import LLM

    return LLM(str(smollm2_gguf), num_threads=2, max_model_len=1024)


def offline_completions(llm, prompts: list[str], max_tokens: list[int]) -> list[tuple[str, list[float]]]:
    from kvlm import SamplingParams

    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, logprobs=1) for n in max_tokens],
                        use_tqdm=False)
    return [(o.outputs[0].text, [d[t] for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]) for o in outs]


async def one(client: openai.AsyncOpenAI, p: str, n: int, stream: bool) -> tuple[str, list[float]]:
    return await greedy_completion(client, "smollm2-135m", p, n, stream)


def aclient(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def test_32_greedy_requests_equal_offline_streamed_and_not(server, offline):
    """32 requests at once over 2 replicas (speculative decoding on), streamed and not: offline's text and
    logprobs (no speculation), bit for bit."""
    prompts = [f"{PROMPTS[i % 8]}" + " and" * (i // 8) for i in range(32)]
    max_tokens = [6 + (i * 5) % 11 for i in range(32)]

    async def run_all(stream: bool) -> list:
        c = aclient(server)
        return await asyncio.gather(*(one(c, p, n, stream) for p, n in zip(prompts, max_tokens)))

    plain, streamed = asyncio.run(run_all(False)), asyncio.run(run_all(True))
    want = offline_completions(offline, prompts, max_tokens)
    for p, a, b, w in zip(prompts, plain, streamed, want):
        assert a == w, f"{p!r}: HTTP through replicas differs from offline"
        assert b == w, f"{p!r}: streamed through replicas differs from offline"
    served = {lbl for lbl, v in server.metrics(server.headers).items()
              if lbl.startswith("kvlm:request_finished_total") and v > 0}
    assert len(served) == 2, f"both replicas served requests: {served}"
    accepted = sum(v for lbl, v in server.metrics(server.headers).items()
                   if lbl.startswith("kvlm:spec_decode_num_accepted_tokens_total"))
    assert accepted > 0, "the replicas verified and accepted drafts"


def test_same_api_as_one_server(server):
    h = server.headers
    assert httpx.get(server.url + "/v1/models").status_code == 401  # the API key holds
    assert httpx.get(server.url + "/v1/models", headers=h).json()["data"][0]["id"] == "smollm2-135m"
    assert httpx.get(server.url + "/health").status_code == 200
    assert "<html" in httpx.get(server.url + "/").text.lower()  # the chat page
    tok = httpx.post(server.url + "/tokenize", headers=h, json={"prompt": "hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 1024
    bad = httpx.post(server.url + "/v1/completions", headers=h,
                     json={"model": "smollm2-135m", "prompt": "hi", "max_tokens": 5000})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "context_length_exceeded"
    oov = httpx.post(server.url + "/v1/completions", headers=h,
                     json={"model": "smollm2-135m", "prompt": [10**7], "max_tokens": 2})
    assert oov.status_code == 400 and "vocabulary" in oov.json()["error"]["message"]  # the replica's engine refused
    missing = httpx.post(server.url + "/v1/completions", headers=h, json={"model": "nope", "prompt": "hi"})
    assert missing.status_code == 404
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Name three colours."}]
    full = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=12, temperature=0)
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2-135m", messages=msgs, max_tokens=12, temperature=0, stream=True) if c.choices]
    assert "".join(parts) == full.choices[0].message.content and full.usage.prompt_tokens > 10
    m = httpx.get(server.url + "/metrics", headers=h).text
    assert m.count('kvlm:kv_cache_total_blocks{model_name="smollm2-135m",replica=') == 2
    assert "kvlm:router_decisions_total" in m and "kvlm:router_retries_total" in m


def test_prefix_routing_sends_a_conversation_back_to_its_cache(server):
    """Four system prompts, each followed three times: every repeat finds its prefix cached (it went to the
    replica holding it), where a load balancer would miss about half the time."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    systems = [f"You are assistant number {i}. " + "You answer briefly, politely and precisely. " * 6
               for i in range(4)]
    cached = []
    for turn in range(3):
        for s in systems:
            r = client.chat.completions.create(model="smollm2-135m", max_tokens=2, temperature=0, messages=[
                {"role": "system", "content": s}, {"role": "user", "content": f"Question {turn}?"}])
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
    assert all(c >= 64 for c in cached[4:]), cached  # turns 2 and 3 reuse the system prompt's blocks


def test_full_replicas_answer_503(server):
    """2 replicas x 8 running (--max-num-seqs 8) + 16 queued (--max-queued-requests 16): of a burst of 48,
    the extra ones get 503 with Retry-After at once, as one server does; the admitted ones finish."""
    body = {"model": "smollm2-135m", "prompt": "Count slowly:", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}

    async def burst():
        async with httpx.AsyncClient(timeout=300, headers=server.headers,
                                     limits=httpx.Limits(max_connections=64)) as c:
            return await asyncio.gather(*(c.post(server.url + "/v1/completions", json=body) for _ in range(48)))

    rs = asyncio.run(burst())
    codes = [r.status_code for r in rs]
    assert set(codes) == {200, 503} and codes.count(200) >= 32, codes
    full = next(r for r in rs if r.status_code == 503)
    assert full.headers["retry-after"] == "1" and full.json()["error"]["type"] == "service_unavailable"


def test_replica_killed_mid_run_loses_no_request(server, offline):
    """64 requests (half streamed) at concurrency 8; one replica's process is SIGKILLed after the 12th
    answer. Every request ends: with offline's tokens, or, streamed and already under way, with an error
    event. Ray restarts the replica; /health says degraded until it is back, then both serve again."""
    prompts = [f"{PROMPTS[i % 8]} " + "again " * (i // 8) for i in range(64)]
    max_tokens = [24] * 64
    want = offline_completions(offline, prompts, max_tokens)
    before = replica_pids(server)
    assert len(before) == 2
    victim = max(before)
    done = 0
    health: list[str] = []

    async def guarded(c, sem, i):
        nonlocal done
        async with sem:
            try:
                out = await one(c, prompts[i], max_tokens[i], stream=i % 2 == 1)
            except openai.APIError as e:
                out = e
            done += 1
            return out

    async def killer():
        while done < 12:
            await asyncio.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        async with httpx.AsyncClient() as h:
            for _ in range(240):  # at most about 120 s: degraded once Serve notices, then ok once it is back
                r = await h.get(server.url + "/health")
                health.append(r.json()["status"] if r.content else "ok")
                if health[-1] == "ok" and "degraded" in health:
                    return
                await asyncio.sleep(0.5)

    async def run_all():
        c, sem = aclient(server), asyncio.Semaphore(8)
        results = asyncio.gather(*(guarded(c, sem, i) for i in range(64)))
        return (await asyncio.gather(results, asyncio.wait_for(killer(), 200)))[0]

    results = asyncio.run(asyncio.wait_for(run_all(), 400))  # none hangs
    errors = [i for i, r in enumerate(results) if isinstance(r, Exception)]
    for i, r in enumerate(results):
        if isinstance(r, Exception):
            assert i % 2 == 1, f"request {i} was not streamed: it must have been retried, got {r!r}"
            assert "replica" in str(r)
        else:
            assert r == want[i], f"request {i} differs from offline after the kill"
    assert len(errors) < 8, f"only requests streaming on the killed replica may fail: {errors}"
    assert "degraded" in health and health[-1] == "ok", health
    assert not alive(victim)
    after = replica_pids(server)
    assert len(after) == 2 and victim not in after
    m = server.metrics(server.headers)
    assert m["kvlm:replicas_running"] == 2
    assert asyncio.run(one(aclient(server), PROMPTS[0], 8, False)) == offline_completions(offline, PROMPTS[:1], [8])[0]


def test_sigterm_stops_every_process_of_the_run(server):
    """SIGTERM drains and exits 0, and no process the server started (Ray's GCS, raylet, agents, the Serve
    controller, the replicas) is left, checked by PID."""
    pids = descendants(server.proc.pid)
    assert any(cmdline(p).startswith("ray::ServeReplica") for p in pids) and len(pids) >= 5
    lines: list[str] = []

    def stream() -> None:  # a request under way when the signal comes ends with "abort" and [DONE]
        body = {"model": "smollm2-135m", "prompt": "Count:", "max_tokens": 500, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers,
                          timeout=60) as r:
            for x in r.iter_lines():
                if x.startswith("data: "):
                    lines.append(x)

    reader = threading.Thread(target=stream)
    reader.start()
    while len(lines) < 3 and reader.is_alive():
        time.sleep(0.05)
    t0 = time.monotonic()
    assert server.stop(signal.SIGTERM, timeout=60) == 0
    reader.join(30)
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "abort"
    deadline = t0 + 60
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    left = {p: cmdline(p) for p in pids if alive(p)}
    assert not left, f"left running: {json.dumps(left)}"
