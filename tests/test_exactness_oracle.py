"""The exactness oracle (`kvlm.exactness.first_difference`) on real runs of a tiny model: it finds where
two runs of the same requests part, and a path that returns fewer (or more) outputs than the reference
is a difference, never a pass."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest

from kvlm import LLM, SamplingParams
from kvlm.exactness import first_difference
from kvlm.outputs import RequestOutput

PROMPTS = [{"prompt_token_ids": [5 + i, 9, 17 + 3 * i]} for i in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def outputs(tiny_gguf: Path) -> list[RequestOutput]:
    return LLM(tiny_gguf).generate(PROMPTS, GREEDY, use_tqdm=False)


def test_identical_runs_have_no_difference(outputs: list[RequestOutput]) -> None:
    assert first_difference("copy", outputs, copy.deepcopy(outputs)) is None


def test_a_missing_output_is_a_difference(outputs: list[RequestOutput]) -> None:
    d = first_difference("drops one", outputs, outputs[:2])
    assert d is not None and (d.path, d.prompt, d.step) == ("drops one", 2, 0)
    assert d.token == outputs[2].outputs[0].token_ids[0] and d.other_token is None
    d = first_difference("adds one", outputs[:2], outputs)
    assert d is not None and (d.prompt, d.token, d.other_token) == (2, None, outputs[2].outputs[0].token_ids[0])
    assert first_difference("returns nothing", outputs, []) is not None


def test_a_missing_output_differs_even_when_the_reference_generated_nothing(outputs: list[RequestOutput]) -> None:
    empty = copy.deepcopy(outputs)
    empty[2].outputs[0].token_ids, empty[2].outputs[0].logprobs = [], []
    d = first_difference("drops one", empty, empty[:2])
    assert d is not None and (d.prompt, d.step, d.token, d.other_token) == (2, 0, None, None)


def test_a_changed_token_or_logprob_is_found_where_it_is(outputs: list[RequestOutput]) -> None:
    other = copy.deepcopy(outputs)
    tok = other[1].outputs[0].token_ids[3]
    other[1].outputs[0].logprobs[3][tok] = math.nextafter(other[1].outputs[0].logprobs[3][tok], math.inf)
    d = first_difference("one ulp", outputs, other)
    assert d is not None and (d.prompt, d.step, d.token, d.other_token) == (1, 3, tok, tok)
    assert d.logprob != d.other_logprob
    shorter = copy.deepcopy(outputs)
    del shorter[0].outputs[0].token_ids[4:]
    d = first_difference("stops early", outputs, shorter)
    assert d is not None and (d.prompt, d.step, d.other_token) == (0, 4, None)

