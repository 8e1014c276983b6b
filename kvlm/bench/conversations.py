"""`kvlm bench serve --conversations C --turns T`: a multi-turn chat workload, to compare routers.

C conversations, each with its own system prompt, each resending its whole growing history every turn
(system, then user / assistant pairs; the assistant's turns are what the server answered). Turns go in
rounds: every conversation sends turn t, in a shuffled order, before any sends turn t + 1 (in a closed
loop a load balancer would land on the replica that just answered by accident). Requests are greedy,
streamed, `ignore_eos` with `--output-len MIN` tokens, at most `--max-concurrency` in flight.

Reported: prefix-hit tokens (the prompt tokens whose K/V a replica reused, from each answer's
`usage.prompt_tokens_details.cached_tokens`) overall and per replica (from /metrics, before and after),
TTFT (first content chunk) and throughput. The last line of `kvlm bench serve` is the JSON document.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any

from kvlm.bench.common import log, percentiles

_TOPICS = ["astronomy", "baking", "chess", "databases", "economics", "forestry", "geology", "harbours", "islands",
           "jazz", "knitting", "linguistics", "mountains", "navigation", "optics", "pottery", "quilting", "rivers",
           "sailing", "typography", "urban planning", "volcanoes", "weaving", "xylophones", "yoga", "zoology"]
_WORDS = ("history method tools safety practice common mistakes famous examples materials seasons measure "
          "beginner expert careful patient precise friendly short answers numbers dates places names").split()


@dataclass(slots=True)
class Conversation:
    messages: list[dict[str, str]] = field(default_factory=list)


@dataclass(slots=True)
class TurnResult:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


def system_prompt(i: int, rng: random.Random, words: int) -> str:
    topic = _TOPICS[i % len(_TOPICS)]
    filler = " ".join(rng.choice(_WORDS) for _ in range(words))
    return f"You are assistant {i}, an expert on {topic}. Keep in mind: {filler}."


def user_turn(conv: int, turn: int, rng: random.Random) -> str:
    return f"Question {turn + 1} from user {conv}: tell me about {' '.join(rng.sample(_WORDS, 4))}."


async def one_turn(client: Any, url: str, model: str, messages: list[dict[str, str]],
                   max_tokens: int) -> tuple[TurnResult, str]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    res, text = TurnResult(), ""
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res, text
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                doc = json.loads(line[6:])
                if "error" in doc:
                    res.error = doc["error"]["message"]
                    return res, text
                if doc.get("usage"):
                    u = doc["usage"]
                    res.prompt_tokens, res.output_tokens = u["prompt_tokens"], u["completion_tokens"]
                    res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                for c in doc["choices"]:
                    piece = c["delta"].get("content") or ""
                    if piece and not text:
                        res.ttft = time.perf_counter() - t0
                    text += piece
        res.latency = time.perf_counter() - t0
        res.ok = res.output_tokens > 0
    except Exception as e:  # counted as failed, never retried
        res.error = f"{type(e).__name__}: {e}"
    return res, text


def prefix_hits_by_replica(url: str) -> dict[str, float]:
    """`kvlm:prefix_cache_hits_total` per replica label ("-" for a one-process server)."""
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r'^kvlm:prefix_cache_hits_total\{([^}]*)\} ([0-9.e+-]+)$', line)
        if m:
            rep = re.search(r'replica="([^"]*)"', m.group(1))
            out[rep.group(1) if rep else "-"] = float(m.group(2))
    return out


async def run_rounds(url: str, model: str, conversations: int, turns: int, output_len: int, concurrency: int,
                     system_words: int, seed: int, timeout: float) -> tuple[list[TurnResult], float]:
    import httpx

    rng = random.Random(seed)
    convs = [Conversation([{"role": "system", "content": system_prompt(i, rng, system_words)}])
             for i in range(conversations)]
    results: list[TurnResult] = []
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        async def turn_of(i: int, t: int) -> None:
            c = convs[i]
            c.messages.append({"role": "user", "content": user_turn(i, t, rng)})
            async with sem:
                res, text = await one_turn(client, url, model, list(c.messages), output_len)
            c.messages.append({"role": "assistant", "content": text})
            results.append(res)

        t0 = time.perf_counter()
        for t in range(turns):
            order = list(range(conversations))
            rng.shuffle(order)
            tasks = []
            for i in order:  # started in this order; the semaphore admits them in it
                tasks.append(asyncio.create_task(turn_of(i, t)))
                await asyncio.sleep(0)
            await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def run_conversations(url: str, model: str, a: Any) -> dict[str, Any]:
    before = prefix_hits_by_replica(url)
    results, dt = asyncio.run(run_rounds(url, model, a.conversations, a.turns, a.output_len[0],
                                         a.max_concurrency or 4, a.system_words, a.seed, a.max_duration))
    time.sleep(1.5)  # replicas report their counters every 0.5 s (serve_ray.launch.STATS_PERIOD_S)
    after = prefix_hits_by_replica(url)
    ok = [r for r in results if r.ok]
    out_tok, in_tok = sum(r.output_tokens for r in ok), sum(r.prompt_tokens for r in ok)
    hits = sum(r.cached_tokens for r in ok)
    doc: dict[str, Any] = {
        "conversations": a.conversations, "turns": a.turns, "output_len": a.output_len[0],
        "max_concurrency": a.max_concurrency or 4, "system_words": a.system_words, "seed": a.seed,
        "completed": len(ok), "failed": len(results) - len(ok), "duration": dt,
        "total_input_tokens": in_tok, "total_output_tokens": out_tok, "prefix_hit_tokens": hits,
        "prefix_hit_rate": hits / max(1, in_tok),
        "prefix_hit_tokens_by_replica": {k: after[k] - before.get(k, 0.0) for k in sorted(after)},
        "request_throughput": len(ok) / dt, "output_throughput": out_tok / dt,
        "total_token_throughput": (in_tok + out_tok) / dt,
        **percentiles([r.ttft for r in ok], "ttft"), **percentiles([r.latency for r in ok], "e2el"),
    }
    errors = sorted({r.error for r in results if r.error})
    if errors:
        doc["errors"] = errors[:5]
    log(f"{a.conversations} conversations x {a.turns} turns: {len(ok)} ok, {doc['failed']} failed, prefix hits "
        f"{hits} of {in_tok} prompt tokens ({doc['prefix_hit_rate']:.0%}), TTFT p50 {doc['median_ttft_ms']:.0f} ms, "
        f"{doc['output_throughput']:.1f} output tok/s, {doc['total_token_throughput']:.0f} total tok/s")
    return doc
