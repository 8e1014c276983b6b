"""Reasoning budgets: the bookkeeping on fake tag ids (no model), then the engine on a tiny thinking model:
`</think>` forced exactly after N reasoning tokens, and a forced request's neighbours (and the request
itself) the same token ids and logprobs alone or batched."""

from __future__ import annotations

import pytest
import torch
from tiny_models import write_tiny_thinking_gguf

from kvlm import SamplingParams
from kvlm.engine.engine import Engine
from kvlm.errors import ParameterError
from kvlm.sampling_params import StructuredOutputsParams
from kvlm.structured.reasoning_budget import ReasoningBudget, ThinkTokens

TAGS = ThinkTokens(start_ids=(1,), end_ids=(2,), force_ids=(9, 2, 9))


def run(b: ReasoningBudget, model_tokens: list[int]) -> list[int]:
    """The tokens a request appends when the model would pick `model_tokens` in turn."""
    out, it = [], iter(model_tokens)
    while len(out) < 12:
        t = b.forced if b.forced is not None else next(it, None)
        if t is None:
            break
        out.append(t)
        b.observe(t)
    return out


def test_budget_forces_end_after_n_reasoning_tokens() -> None:
    b = ReasoningBudget.start(TAGS, 3, prompt_ids=[5, 1, 7])  # the prompt opened the span
    assert b.in_reasoning and b.forced is None
    assert run(b, [40, 41, 42, 43, 44, 45]) == [40, 41, 42, 9, 2, 9, 43, 44, 45]
    assert b.done and not b.in_reasoning and b.spent == 3


def test_budget_zero_forces_at_once_and_closed_prompts_never_force() -> None:
    assert run(ReasoningBudget.start(TAGS, 0, [1]), [40, 41]) == [9, 2, 9, 40, 41]
    closed = ReasoningBudget.start(TAGS, 0, [1, 3, 2, 4])  # enable_thinking=false: <think></think> in the prompt
    assert not closed.in_reasoning and run(closed, [40, 41, 42]) == [40, 41, 42]


def test_model_opens_and_closes_the_span_itself() -> None:
    b = ReasoningBudget.start(TAGS, 2, [5])
    assert run(b, [40, 1, 41, 42, 43]) == [40, 1, 41, 42, 9, 2, 9, 43]
    within = ReasoningBudget.start(TAGS, 5, [1])
    assert run(within, [40, 2, 41, 42, 43, 44, 45, 46]) == [40, 2, 41, 42, 43, 44, 45, 46]  # closed in time
    assert within.done and within.spent == 1


def test_multi_token_tags_are_matched_as_sequences() -> None:
    tags = ThinkTokens(start_ids=(1, 2), end_ids=(3, 4), force_ids=(3, 4))
    assert tags.prompt_opens([7, 1, 2, 8]) and not tags.prompt_opens([1, 2, 3, 4]) and not tags.prompt_opens([2, 1])
    b = ReasoningBudget.start(tags, 10, [1, 2])
    assert run(b, [40, 3, 4, 41]) == [40, 3, 4, 41] and b.done and b.spent == 2  # "3" counted: a tag's lead piece


def test_tracking_without_a_budget_never_forces_and_holds_the_grammar_back() -> None:
    b = ReasoningBudget.start(TAGS, None, [1])
    assert b.grammar_waits and run(b, [40, 41, 42, 2, 43]) == [40, 41, 42, 2, 43]
    assert b.done and not b.grammar_waits and b.spent == 3
    forcing = ReasoningBudget.start(TAGS, 1, [1])
    for t in (40, 9, 2):
        forcing.observe(t)
        assert forcing.grammar_waits  # forcing `</think>`, up to its last token: still the grammar's to wait for
    forcing.observe(9)
    assert not forcing.grammar_waits and forcing.done


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_budget_is_validated(bad: object) -> None:
    with pytest.raises(ParameterError, match="^reasoning_budget must be an integer >= 0") as e:
        SamplingParams(reasoning_budget=bad)  # type: ignore[arg-type]
    assert e.value.param == "reasoning_budget"


# --------------------------------------------------------------------------- the engine, a thinking model
@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return Engine(write_tiny_thinking_gguf(tmp_path_factory.mktemp("think") / "think.gguf"), quiet=True)


def prompt(engine: Engine, text: str, thinking: bool = True) -> list[int]:
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], enable_thinking=thinking)
    return engine.tokenizer.encode(rendered, add_special_tokens=False)


def params(budget: int | None, seed: int | None = None) -> SamplingParams:
    # EOS and `</think>` banned, so only the budget can close the span; temperature 0.8 with a seed draws
    return SamplingParams(temperature=0 if seed is None else 0.8, seed=seed, max_tokens=14, logprobs=2,
                          reasoning_budget=budget, logit_bias={262: -100, 264: -100})


def generate(engine: Engine, reqs: list[tuple[list[int], SamplingParams]]) -> list[tuple[list[int], list]]:
    handles = [engine.add_request(ids, p) for ids, p in reqs]
    while engine.has_unfinished:
        engine.step()
    return [(r.output_token_ids, r.logprobs) for r in handles]


def test_engine_forces_end_exactly_after_budget(engine: Engine) -> None:
    tags = engine.input_processor.think_tokens
    assert tags.start_ids == (263,) and tags.end_ids == (264,)  # the added tokens, one id each
    ids = prompt(engine, "hello")
    for budget in (0, 3, 6):
        out, _ = generate(engine, [(ids, params(budget))])[0]
        assert out[budget:budget + len(tags.force_ids)] == list(tags.force_ids)
        assert 264 not in out[:budget] and out.count(264) == 1
    free, _ = generate(engine, [(ids, params(None))])[0]
    assert 264 not in free  # without a budget nothing closes the span (it is banned)
    closed, _ = generate(engine, [(prompt(engine, "hello", thinking=False), params(2))])[0]
    assert 264 not in closed  # enable_thinking=false: the prompt closed it, nothing to count


def test_forcing_leaves_rows_alone_vs_batched(engine: Engine) -> None:
    a, b, c = prompt(engine, "hello"), prompt(engine, "what is two and two"), prompt(engine, "hi", thinking=False)
    reqs = [(a, params(3)), (b, params(None, seed=7)), (c, params(5, seed=3)), (b, params(1, seed=11))]
    alone = [generate(engine, [r])[0] for r in reqs]
    batched = generate(engine, reqs)
    for (ta, la), (tb, lb) in zip(alone, batched):
        assert ta == tb
        for x, y in zip(la, lb):  # the raw logprobs, forced tokens' included, bit for bit
            assert x.keys() == y.keys() and torch.equal(torch.tensor(list(x.values())), torch.tensor(list(y.values())))
    assert alone[0][0][3:7] == [10, 264, 10, 10] and alone[3][0][1:5] == [10, 264, 10, 10]


def test_grammar_waits_for_the_end_of_the_span(engine: Engine) -> None:
    """A constraint on a thinking request applies from the token after `</think>` (forced or the model's);
    without `reasoning` it applies from the first token, and no span is tracked."""
    choice = StructuredOutputsParams(choice=["yes", "no"])
    engine.grammars.compile(choice)
    ids = prompt(engine, "hello")
    enc = lambda s: engine.tokenizer.encode(s, add_special_tokens=False)  # noqa: E731

    def run_with(**kw) -> list[int]:
        p = SamplingParams(temperature=0, max_tokens=14, logit_bias={t: 100 for t in range(97, 123)},
                           structured_outputs=choice, **kw)
        return generate(engine, [(ids, p)])[0][0]

    thought = run_with(reasoning=True, reasoning_budget=3)
    answer = thought[7:-1] if thought[-1] == 262 else thought[7:]
    assert thought[3:7] == [10, 264, 10, 10] and answer in (enc("yes"), enc("no")), thought
    assert 264 not in run_with()  # the grammar from token one: the choice at once
    assert engine.tokenizer.decode(run_with()) in ("yes", "no")
