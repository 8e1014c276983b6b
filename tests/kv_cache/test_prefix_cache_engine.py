"""Prefix caching through the engine on tiny random models (fp32, greedy): a request served from cached
blocks gives the tokens (and logits within 1e-4) of the same request with caching off, for prefixes of
0, 1, k blocks and k blocks + a partial one, alone and inside mixed batches; sharing under a small pool
(evictions and preemptions) equals the unconstrained run; accounting and miss diagnostics."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from engine_runs import assert_same_logits

from kvlm import Engine, EngineConfig, SamplingParams

BS = 4
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams = PARAMS,
        start_steps: int = 0) -> tuple[list[list[int]], list[list[torch.Tensor]], list]:
    """Submit prompts (the first `start_steps` steps with only the first one running), run to the end;
    tokens, per-token logits and the requests, in prompt order."""
    reqs = [engine.add_request(prompts[0], params)]
    for _ in range(start_steps):
        engine.step(keep_logits=True)
    reqs += [engine.add_request(p, params) for p in prompts[1:]]
    logits: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in reqs}
    while engine.has_unfinished:
        engine.step(keep_logits=True)
        res = engine.last_result
        for j, r in enumerate(res.requests):
            logits[r.request_id].append(res.logits[j])
        engine.block_manager.check(engine.scheduler.running)
    return [r.output_token_ids for r in reqs], [logits[r.request_id] for r in reqs], reqs


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 256) for _ in range(n)]


@pytest.mark.parametrize("shared", [0, 1, BS, 3 * BS, 3 * BS + 2])
@pytest.mark.parametrize("mixed", [False, True])
def test_cached_prefix_equals_recompute(tiny_gguf: Path, shared: int, mixed: bool) -> None:
    """A warm-up request shares `shared` tokens with the target; the target then reuses
    shared // BS full blocks and gives the cache-off tokens and logits, alone or in a mixed batch
    (a long request decoding, others prefilling in chunks)."""
    rng = random.Random(shared)
    common = rand_tokens(rng, shared)
    warm = common + rand_tokens(rng, 5)
    target = common + rand_tokens(rng, 9)
    others = [rand_tokens(rng, 30), common[:BS] + rand_tokens(rng, 20)] if mixed else []
    cfg = {"block_size": BS, "max_num_batched_tokens": 16 if mixed else 2048}
    off = Engine(tiny_gguf, EngineConfig(enable_prefix_caching=False, **cfg), quiet=True)
    ref_tokens, ref_logits, _ = run(off, [target] + others)
    on = Engine(tiny_gguf, EngineConfig(**cfg), quiet=True)
    on.block_manager.enable_debug()
    run(on, [warm])
    tokens, logits, reqs = run(on, [others[0], target, others[1]] if mixed else [target], start_steps=3 if mixed else 0)
    got = tokens[1] if mixed else tokens[0]
    got_logits = logits[1] if mixed else logits[0]
    treq = reqs[1] if mixed else reqs[0]
    assert got == ref_tokens[0]
    assert_same_logits(got_logits, ref_logits[0])
    assert treq.metrics.num_cached_tokens == shared // BS * BS
    assert treq.metrics.num_prefilled_tokens == len(target) - shared // BS * BS
    if mixed:
        assert tokens[0] == ref_tokens[1] and tokens[2] == ref_tokens[2]
    bm = on.block_manager
    assert bm.ref_counts == [0] * bm.num_blocks
    bm.check([])


def test_sharing_under_stress_equals_unconstrained_run(tiny_gguf: Path) -> None:
    """Many requests sharing prefixes in a pool so small that cached blocks are evicted and requests are
    preempted: tokens identical to an unconstrained cache-off run, no block freed or written while read
    (debug mode), every ref count back to zero."""
    from engine_runs import small_bytes

    rng = random.Random(3)
    system = rand_tokens(rng, 22)
    prompts = [system[: rng.choice([5, 13, 22])] + rand_tokens(rng, rng.randint(1, 9)) for _ in range(14)]
    prompts += prompts[:3]  # exact repeats: their whole prompt but the last token comes from the cache
    # Seeded sampling: the tiny model's greedy output repeats one token, sampled tokens follow the logits.
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=20, ignore_eos=True) for i in range(len(prompts))]
    free = Engine(tiny_gguf, EngineConfig(block_size=BS, enable_prefix_caching=False), quiet=True)
    free_reqs = [free.add_request(p, sp) for p, sp in zip(prompts, params)]
    while free.has_unfinished:
        free.step()
    ref = [r.output_token_ids for r in free_reqs]
    assert len({t for r in ref for t in r}) > 20
    small = Engine(tiny_gguf, EngineConfig(block_size=BS, max_num_seqs=8, max_num_batched_tokens=24,
                                           kv_cache_memory=40 * BS * small_bytes(tiny_gguf)), quiet=True)
    bm = small.block_manager
    bm.enable_debug()
    reqs = []
    for i, p in enumerate(prompts):  # arrive a few at a time, so later ones find earlier ones cached
        reqs.append(small.add_request(p, params[i]))
        if i % 3 == 2:
            small.step()
            bm.check(small.scheduler.running)
    while small.has_unfinished:
        small.step()
        bm.check(small.scheduler.running)
    assert [r.output_token_ids for r in reqs] == ref
    assert sum(r.metrics.num_preemptions for r in reqs) > 0
    assert bm.num_evictions > 0
    assert sum(r.metrics.num_cached_tokens for r in reqs) > 0
    assert bm.ref_counts == [0] * bm.num_blocks and bm.num_free_blocks == bm.num_blocks
    bm.check([])


def test_prompt_logprobs_request_takes_no_cached_prefix(tiny_gguf: Path) -> None:
    """Prompt logprobs need logits at every prompt position, so such a request recomputes its prompt."""
    e = Engine(tiny_gguf, EngineConfig(block_size=BS), quiet=True)
    prompt = list(range(10, 30))
    run(e, [prompt])
    plain = e.add_request(prompt + [1], PARAMS)
    lp = e.add_request(prompt + [1], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))
    while e.has_unfinished:
        e.step()
    assert plain.metrics.num_cached_tokens == 20 and lp.metrics.num_cached_tokens == 0
    assert lp.metrics.num_prefilled_tokens == 21


def test_accounting_and_counters(tiny_gguf: Path) -> None:
    """Metrics say prompt / cached / prefilled tokens and blocks held / shared; the engine counts vLLM's
    prefix_cache_queries and prefix_cache_hits (tokens)."""
    e = Engine(tiny_gguf, EngineConfig(block_size=BS), quiet=True)
    system = list(range(40, 56))  # 4 blocks
    a = e.add_request(system + [1, 2], PARAMS)
    e.step()
    b = e.add_request(system + [3], PARAMS)
    e.step()
    assert b.metrics.blocks_shared == 4 and a.metrics.blocks_shared == 4
    while e.has_unfinished:
        e.step()
    d = b.metrics.as_dict()
    assert d["prompt_tokens"] == 17 and d["cached_tokens"] == 16 and d["prefilled_tokens"] == 1
    assert d["computed_tokens"] == 1 + 11  # the prompt's last token, then 11 decode steps
    assert a.metrics.num_prefilled_tokens == 18 and a.metrics.num_cached_tokens == 0
    assert e.scheduler.prefix_cache_queries == 35 and e.scheduler.prefix_cache_hits == 16


def test_prefix_caching_off_by_flag_and_for_contiguous_layout(tiny_gguf: Path) -> None:
    prompt = list(range(30))
    for cfg in (EngineConfig(enable_prefix_caching=False), EngineConfig(kv_cache_layout="contiguous"),
                EngineConfig(enable_kv_cache=False)):
        e = Engine(tiny_gguf, cfg, quiet=True)
        assert not e.block_manager.enable_prefix_caching
        run(e, [prompt])
        _, _, (r,) = run(e, [prompt + [1]])
        assert r.metrics.num_cached_tokens == 0


def test_miss_diagnostics(tiny_gguf: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A request reusing less than an earlier one shared says why: diverged (with the text around it),
    evicted, or shorter than one block; and logs it at debug level."""
    import logging

    e = Engine(tiny_gguf, EngineConfig(block_size=BS), quiet=True)
    tok = e.tokenizer
    base = "Today is 2024-05-01 and the weather is fine. "

    def req(text: str):
        r = e.add_request(tok.encode(text), SamplingParams(temperature=0, max_tokens=2))
        while e.has_unfinished:
            e.step()
        return r

    req(base + "Question one?")
    with caplog.at_level(logging.DEBUG, logger="kvlm"):
        r = req(base.replace("01", "02") + "Question one?")
    assert r.metrics.prefix_miss is not None and "diverged at token" in r.metrics.prefix_miss
    assert "'1 and the w'" in r.metrics.prefix_miss.replace('"', "'") or "1 and" in r.metrics.prefix_miss
    assert any("diverged" in m for m in caplog.messages)
    e.reset_prefix_cache()
    r = req(base + "Question one? More.")
    assert "evicted" in r.metrics.prefix_miss
    r = req("To")  # shares 'To' with the others: less than one block
    assert r.metrics.prefix_miss is None or "shorter than one block" in r.metrics.prefix_miss
    r = req("Tod, " + "x" * 10)
    assert "shorter than one block" in r.metrics.prefix_miss
    n = len(tok.encode(base + "Question one? More."))
    r = req(base + "Question one? More. And more.")  # extends a cached prompt, not its generated reply
    assert r.metrics.num_cached_tokens == n // BS * BS
    assert f"diverged at token {n}:" in r.metrics.prefix_miss  # where the earlier request's output began
    r = req(base + "Question one? More. And more.")  # the same prompt again: nothing missed
    assert r.metrics.prefix_miss is None


@pytest.mark.slow
def test_ten_turn_chat_on_default_model_same_with_and_without_reuse(smollm2_gguf: Path) -> None:
    """SmolLM2 on the default path (quantized weights, int8 activations): a 10-turn greedy chat gives the
    same replies, with the same logprobs bit for bit, with the prefix cache as without, and from turn 2 on
    each turn reuses the earlier turns (it prefills far fewer tokens than its prompt)."""
    from kvlm import LLM
    from kvlm.bench.prefix import CHAT_TURNS

    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3)
    replies, prefilled = {}, {}
    for caching in (False, True):
        llm = LLM(str(smollm2_gguf), num_threads=2, enable_prefix_caching=caching)
        messages = [{"role": "system", "content": "You are a concise assistant."}]
        replies[caching], prefilled[caching] = [], []
        for turn in CHAT_TURNS:
            messages.append({"role": "user", "content": turn})
            out = llm.chat(messages, params)[0]
            replies[caching].append((out.outputs[0].token_ids, out.outputs[0].logprobs))
            prefilled[caching].append((out.metrics.num_prompt_tokens, out.metrics.num_prefilled_tokens))
            messages.append({"role": "assistant", "content": out.outputs[0].text})
    for turn, (a, b) in enumerate(zip(replies[False], replies[True])):
        assert a == b, f"turn {turn + 1}: the reply with the prefix cache differs from recomputing"
    assert all(p == n for n, p in prefilled[False])
    for n, p in prefilled[True][1:]:
        assert p < 40 and p < n / 2, prefilled[True]


def test_kvlm_chat_reuses_earlier_turns(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The REPL sends the whole conversation each turn; from turn 2 on most of it comes from the cache."""
    import builtins

    from kvlm.cli.main import main

    lines = iter(["hello there, how are you today?", "and what about tomorrow?", "/exit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    assert main(["-q", "chat", str(tiny_gguf), "--block-size", "4", "--max-tokens", "6", "--ignore-eos"]) == 0
    stats = [ln for ln in capsys.readouterr().err.splitlines() if "prompt tokens:" in ln]
    assert len(stats) == 2
    first, second = ([int(w) for w in ln.replace("[", " ").split() if w.isdigit()] for ln in stats)
    assert first[1] == 0  # nothing cached before the first turn
    assert second[1] >= first[0] // 4 * 4 and second[2] < second[0] / 2


def test_kvlm_chat_runs_past_the_context_with_a_bounded_cache(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`kvlm chat --max-kv-tokens`: ten turns whose history outgrows the 64-token context; each turn still
    prefills only its new tokens (the earlier turns' sinks and window come from the cache)."""
    import builtins

    from kvlm.cli.main import main

    lines = iter([f"turn {i}: tell me more" for i in range(10)] + ["/exit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    assert main(["-q", "chat", str(tiny_gguf), "--block-size", "4", "--max-model-len", "64", "--max-kv-tokens",
                 "32", "--max-tokens", "8", "--ignore-eos"]) == 0
    stats = [[int(w) for w in ln.replace("[", " ").split() if w.isdigit()]
             for ln in capsys.readouterr().err.splitlines() if "prompt tokens:" in ln]
    assert len(stats) == 10 and stats[-1][0] > 64  # the history is past the context
    for (before, _, _, _), (_, reused, prefilled, _) in zip(stats, stats[1:]):
        assert reused >= before and prefilled < 50  # the whole previous turn reused; its reply and message run
