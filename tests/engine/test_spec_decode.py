"""Speculative decoding never changes a bit: token ids and top-5 logprobs with it off, `ngram` and `suffix`
are equal (`==` on the floats), greedy and seeded, alone and in a batch of 16, with the prefix cache, int8
KV, preemption, stop tokens and a JSON-schema grammar, on tiny random Q8_0 models on the native kernels: one
with tied embeddings, which tends to repeat itself (drafts mostly accepted), and one without (mostly
rejected). The comparisons also assert that drafts were accepted, so they cannot pass with speculation
silently off."""

from __future__ import annotations

from pathlib import Path

import pytest
from deps import need_native
from tiny_models import tiny_config, write_tiny_gguf

from kvlm import EngineConfig, SamplingParams
from kvlm.engine.engine import Engine
from kvlm.errors import ParameterError
from kvlm.sampling_params import StructuredOutputsParams as SO

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True, logprobs=5)
METHODS = ("ngram", "suffix")
SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8},
                                           "b": {"type": "array", "items": {"enum": ["xy", "xyz"]}, "maxItems": 4}},
          "required": ["a", "b"], "additionalProperties": False}
SCHEMA_SEEDED = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=16, logprobs=5,
                                structured_outputs=SO(json=SCHEMA)) for s in range(8)]
# copy-heavy prompts (repeated spans the proposers find) of 16 kinds
PROMPTS = [[(7 * i + j) % 200 + 20 for j in range(5 + i % 4)] * (3 + i % 3) for i in range(16)]


def tiny(tmp_path_factory: pytest.TempPathFactory, kind: str) -> Path:
    need_native()
    cfg = tiny_config(head_dim=32, tie_word_embeddings=kind == "repeating")  # (int8 KV: 32-wide heads)
    return write_tiny_gguf(tmp_path_factory.mktemp("spec") / f"{kind}.gguf", cfg, tensor_type="Q8_0")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny(tmp_path_factory, "repeating")


@pytest.fixture(scope="module")
def varied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny(tmp_path_factory, "varied")


def run(eng: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
        requests: list | None = None) -> list[tuple]:
    """Run to completion, the KV invariants checked each step; (token ids, logprobs, text, finish reason)
    per prompt. `requests`, if given, receives the Request objects."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for p in plist:
        if p.structured_outputs is not None:
            eng.grammars.compile(p.structured_outputs)
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, plist)]
    if requests is not None:
        requests.extend(reqs)
    while eng.has_unfinished:
        eng.step()
        eng.scheduler.check()
        bs = eng.block_manager.block_size
        for r in eng.scheduler.running:  # rejected drafts' blocks given back: less than a block past the K/V
            assert 0 <= len(r.block_table) * bs - r.num_computed_tokens < bs
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    if eng.draft_engine is not None:  # method draft: every request's draft state freed too
        dbm = eng.draft_engine.block_manager
        assert dbm.num_free_blocks == dbm.num_blocks and not eng.speculator.proposer.state  # type: ignore[union-attr]
    return [(r.output_token_ids, r.logprobs, r.text, r.finish_reason) for r in reqs]


def engine(model: Path, method: str | None, k: int = 4, draft_rows: int = 16, cost_rule: bool = False,
           **cfg) -> Engine:
    """method: ngram, suffix, "draft:PATH" (a draft model) or None (off). Without the cost rule by default:
    the tests want drafts in batches too, where the rule (rightly) proposes few (test_cost_rule_*)."""
    spec = None if method is None else {"method": method, "num_speculative_tokens": k, "draft_rows": draft_rows,
                                        "cost_rule": cost_rule}
    if method is not None and method.startswith("draft:"):
        spec.update(method="draft", model=method[len("draft:"):])  # type: ignore[union-attr]
    return Engine(model, EngineConfig(block_size=4, speculative_config=spec, **cfg), quiet=True)


def accepted(eng: Engine) -> int:
    return eng.speculator.stats.num_accepted_tokens  # type: ignore[union-attr]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kind", ["repeating", "varied"])
def test_identical_alone_and_in_a_batch_of_16(kind: str, params: SamplingParams,
                                              request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue({"repeating": "model", "varied": "varied"}[kind])
    ref = run(engine(model, None), PROMPTS, params)
    total = batched = 0
    for method in METHODS:
        batch = engine(model, method, draft_rows=64)  # 16 running: up to 3 drafts each (the default, 16, none)
        assert run(batch, PROMPTS, params) == ref, f"{method}: batch of 16"
        alone = engine(model, method, max_num_seqs=1, cost_rule=True)  # one request at a time, the default rule
        assert run(alone, PROMPTS[:6], params) == ref[:6], f"{method}: alone"
        s = alone.speculator.stats  # type: ignore[union-attr]
        assert sum(s.accepted_per_pos) == s.num_accepted_tokens <= s.num_draft_tokens
        total += accepted(alone) + accepted(batch)
        batched += accepted(batch)
    assert total > 0, "no draft accepted"
    assert batched > 0 or kind == "varied", "no draft accepted in the batch"


def test_cost_rule_drafts_where_they_pay_and_changes_no_bit(model: Path, varied: Path) -> None:
    """The default depth rule (spec_decode/depth.py) in a batch of 16: the same bits as off. On the model
    that repeats itself (drafts mostly accepted) it keeps drafting in the batch; on the other, whose drafts
    are accepted less often than a row of 16 costs (about 0.8), it drafts only in rare probes, so far
    fewer drafts are verified than with the rule off."""
    for m in (model, varied):
        ref = run(engine(m, None), PROMPTS, GREEDY)
        ruled = engine(m, "ngram", draft_rows=64, cost_rule=True)
        assert run(ruled, PROMPTS, GREEDY) == ref
        forced = engine(m, "ngram", draft_rows=64)
        assert run(forced, PROMPTS, GREEDY) == ref
        r, f = ruled.speculator.stats, forced.speculator.stats  # type: ignore[union-attr]
        if m is model:
            assert r.num_accepted_tokens > 0 and r.acceptance_rate > 0.5, r.as_dict()
        else:
            assert f.acceptance_rate < 0.8 and r.num_draft_tokens < f.num_draft_tokens / 3, (r.as_dict(), f.as_dict())


def test_identical_with_int8_kv_prefix_hits_and_preemption(model: Path) -> None:
    ref = run(engine(model, None, kv_cache_dtype="int8"), PROMPTS[:8], SEEDED)
    for method in METHODS:
        eng = engine(model, method, kv_cache_dtype="int8")
        assert run(eng, PROMPTS[:8], SEEDED) == ref
        again = run(eng, PROMPTS[:8], SEEDED)  # the same prompts again: their blocks from the prefix cache
        assert again == ref and eng.scheduler.prefix_cache_hits > 0 and accepted(eng) > 0
    off = run(engine(model, None), PROMPTS[:8], GREEDY)
    per_token = engine(model, None).kv_bytes_per_token
    small = engine(model, "suffix", kv_cache_memory=40 * 4 * per_token, enable_prefix_caching=False)
    reqs: list = []
    assert run(small, PROMPTS[:8], GREEDY, reqs) == off and accepted(small) > 0
    assert sum(r.metrics.num_preemptions for r in reqs) > 0


def test_stop_inside_an_accepted_run(model: Path) -> None:
    """A stop token id (or EOS) sampled inside a run of accepted drafts ends the request there: nothing
    past it is emitted, the same as without speculation."""
    ref = run(engine(model, None), PROMPTS, GREEDY)
    stops = [SamplingParams(temperature=0, max_tokens=16, logprobs=5, stop_token_ids=[toks[8]])
             for toks, *_ in ref]
    off = run(engine(model, None), PROMPTS, stops)
    assert all(f == "stop" for *_, f in off)
    for method in METHODS:
        eng = engine(model, method)
        assert run(eng, PROMPTS, stops) == off and accepted(eng) > 0


def test_identical_under_a_json_schema(model: Path) -> None:
    params = SCHEMA_SEEDED
    prompts = PROMPTS[:8]
    ref = run(engine(model, None), prompts, params)
    for method in METHODS:
        eng = engine(model, method)
        assert run(eng, prompts, params) == ref
        assert accepted(eng) > 0


def test_config_refused_with_one_line() -> None:
    for bad in ({"method": "eagle"}, {"method": "ngram", "num_speculative_tokens": 0}, {"k": 3}, "ngram",
                {"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}):
        with pytest.raises(ParameterError) as e:
            EngineConfig(speculative_config=bad)
        assert e.value.param == "speculative_config" and "\n" not in str(e.value)


def test_unseeded_sampling_keeps_the_target_distribution(varied: Path) -> None:
    """Unseeded requests (each draws its seed at admission) with drafts verified: the three tokens they
    generate follow the target's joint distribution p(t1) p(t2 | t1) p(t3 | t1, t2) (top-k 4: at most
    K = 64 outcomes). Bound: for n draws over K outcomes the empirical distribution's expected total
    variation from the truth is at most sqrt((K - 1) / n) / 2 (Cauchy-Schwarz over the K binomial
    deviations), and one draw moves TV by at most 1/n, so by McDiarmid it exceeds that by
    sqrt(ln(1/delta) / (2n)) with probability at most delta = 1e-6. A verifier that kept a refused draft, or
    a draft row drawing with its neighbour's noise, would move mass between outcomes well past it."""
    from collections import Counter

    import torch

    from kvlm.engine.sampler import filter_logits

    prompt, top_k, n = [40, 41] * 6, 4, 1500
    params = SamplingParams(temperature=1.0, top_k=top_k, max_tokens=3, ignore_eos=True)
    eng = engine(varied, "suffix", k=1, draft_rows=64, max_num_seqs=16)
    got = Counter(tuple(toks) for toks, *_ in run(eng, [prompt] * n, params))
    s = eng.speculator.stats  # type: ignore[union-attr]
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens  # drafts both kept and refused
    ref = engine(varied, None)

    def dist(prefix: tuple[int, ...]) -> torch.Tensor:
        """The target's distribution of the token after prompt + prefix, top-k filtered, (V,)."""
        *_, (_, logits) = ref.prompt_logits([*prompt, *prefix, 0], len(prompt) + len(prefix) - 1)
        return filter_logits(logits[-1:], torch.tensor([top_k]), torch.tensor([1.0]),
                             torch.tensor([0.0])).softmax(-1)[0]

    want: dict[tuple[int, ...], float] = {}
    p1 = dist(())
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = dist((t1,))
        for t2 in torch.nonzero(p2).flatten().tolist():
            p3 = dist((t1, t2))
            for t3 in torch.nonzero(p3).flatten().tolist():
                want[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[t3])
    assert set(got) <= set(want) and abs(sum(want.values()) - 1) < 1e-4
    K = len(want)
    tv = 0.5 * sum(abs(got[o] / n - q) for o, q in want.items())
    bound = 0.5 * ((K - 1) / n) ** 0.5 + (13.82 / (2 * n)) ** 0.5  # ln(1e6) = 13.82
    assert tv <= bound, (tv, bound, K)


def test_identical_with_sliding_window_layer_groups(tmp_path: Path) -> None:
    """Gemma 3's sliding layers (their own block tables, given back as the window moves, window 8 here):
    drafts there too, rejected ones given back in every group, the same bits."""
    from tiny_gemma import gemma3_config, gemma3_state, write_gemma3_gguf

    need_native()
    cfg = gemma3_config()
    path = write_gemma3_gguf(tmp_path / "gemma.gguf", cfg, gemma3_state(cfg), tensor_type="Q8_0")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    ref = run(engine(path, None), PROMPTS[:8], params)
    eng = engine(path, "suffix", draft_rows=64)
    assert run(eng, PROMPTS[:8], params) == ref and accepted(eng) > 0
    assert eng.scheduler.groups  # (the model has extra layer groups)


def test_identical_with_a_bounded_cache(model: Path) -> None:
    """Sinks + window (`max_kv_tokens` 32, 4 sinks), generating well past it: the window moves between
    verify steps (a step's rows never straddle a move), rejected drafts' blocks are given back."""
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=40, ignore_eos=True, logprobs=5)
    cfg = dict(max_kv_tokens=32, sink_tokens=4, max_model_len=64)
    ref = run(engine(model, None, **cfg), PROMPTS[:6], params)
    for method in METHODS:
        eng = engine(model, method, draft_rows=64, **cfg)
        reqs: list = []
        assert run(eng, PROMPTS[:6], params, reqs) == ref and accepted(eng) > 0
        assert all(r.metrics.num_evicted_tokens > 0 for r in reqs)


# -- method draft: a second model proposes (engine/draft_model.py) ---------------------------------------


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_draft_model_identical_alone_and_in_a_batch_of_16(model: Path, varied: Path, params: SamplingParams) -> None:
    """The target itself as its draft (what it guesses greedily is what greedy decoding picks: every draft
    accepted, which holds only if the draft's K/V catch up on accepted tokens and roll back rejected ones
    right), and another model with the same tokenizer (its guesses mostly wrong): the same bits as off."""
    ref = run(engine(model, None), PROMPTS, params)
    for draft in (model, varied):
        batch = engine(model, f"draft:{draft}", draft_rows=64)
        assert run(batch, PROMPTS, params) == ref, f"draft {draft.name}: batch of 16"
        alone = engine(model, f"draft:{draft}", max_num_seqs=1)
        assert run(alone, PROMPTS[:6], params) == ref[:6], f"draft {draft.name}: alone"
        for eng in (batch, alone):
            s = eng.speculator.stats  # type: ignore[union-attr]
            assert s.num_draft_tokens > 0 and sum(s.accepted_per_pos) == s.num_accepted_tokens
            if draft == model and params is GREEDY:
                assert s.num_accepted_tokens == s.num_draft_tokens, s.as_dict()
            elif draft == model:
                assert s.num_accepted_tokens > 0


def test_draft_model_with_int8_kv_prefix_hits_preemption_and_a_schema(model: Path, varied: Path) -> None:
    ref = run(engine(model, None, kv_cache_dtype="int8"), PROMPTS[:8], SEEDED)
    eng = engine(model, f"draft:{model}", kv_cache_dtype="int8")
    assert run(eng, PROMPTS[:8], SEEDED) == ref
    again = run(eng, PROMPTS[:8], SEEDED)  # the target's blocks from its prefix cache; the draft recomputes
    assert again == ref and eng.scheduler.prefix_cache_hits > 0 and accepted(eng) > 0
    off = run(engine(model, None), PROMPTS[:8], GREEDY)
    per_token = engine(model, None).kv_bytes_per_token
    small = engine(model, f"draft:{model}", kv_cache_memory=40 * 4 * per_token, enable_prefix_caching=False)
    reqs: list = []
    assert run(small, PROMPTS[:8], GREEDY, reqs) == off and accepted(small) > 0  # (run: draft state all freed)
    assert sum(r.metrics.num_preemptions for r in reqs) > 0
    params = SCHEMA_SEEDED
    ref = run(engine(model, None), PROMPTS[:8], params)
    for draft in (model, varied):
        eng = engine(model, f"draft:{draft}")
        assert run(eng, PROMPTS[:8], params) == ref
        assert eng.speculator.stats.num_draft_tokens > 0  # type: ignore[union-attr]


def test_draft_model_with_another_tokenizer_refused(model: Path, tmp_path: Path) -> None:
    from tiny_models import byte_level_fields

    tokens = byte_level_fields()["tokenizer.ggml.tokens"]
    swapped = [tokens[1], tokens[0], *tokens[2:]]
    cfg = tiny_config(head_dim=32)
    for name, fields, why in (("eos", {"tokenizer.ggml.eos_token_id": len(tokens) - 1}, "eos_token_id"),
                              ("vocab", {"tokenizer.ggml.tokens": swapped}, "token/id pairs differ")):
        other = write_tiny_gguf(tmp_path / f"{name}.gguf", cfg, tensor_type="Q8_0", fields=fields)
        with pytest.raises(ParameterError) as e:
            engine(model, f"draft:{other}")
        msg = str(e.value)
        assert e.value.param == "speculative_config" and "\n" not in msg
        assert "does not share the target's tokenizer" in msg and why in msg, msg
    with pytest.raises(ParameterError) as e:
        engine(model, f"draft:{tmp_path / 'missing.gguf'}")
    assert "draft model" in str(e.value) and "\n" not in str(e.value)
    for bad in ({"method": "draft"}, {"method": "ngram", "model": str(model)}):
        with pytest.raises(ParameterError) as e:
            EngineConfig(speculative_config=bad)
        assert e.value.param == "speculative_config" and "\n" not in str(e.value)
