"""Tests for kvlm.sampling_params: validation (ValueError naming the parameter), defaults, normalisation."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvlm.errors import ParameterError
from kvlm.sampling_params import SamplingParams

INVALID: list[tuple[dict[str, Any], str]] = [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"frequency_penalty": 2.01}, "frequency_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": 25}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"n": 2}, "n"),
    ({"seed": 1.5}, "seed"),
    # wrong types, non-finite values and huge integers, each named
    ({"temperature": "0.7"}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_p": "1"}, "top_p"),
    ({"top_k": True}, "top_k"),
    ({"top_k": "5"}, "top_k"),
    ({"min_p": math.nan}, "min_p"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"),
    ({"presence_penalty": math.nan}, "presence_penalty"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"min_tokens": True}, "min_tokens"),
    ({"seed": 10**23}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": True}, "seed"),
    ({"seed": "42"}, "seed"),
    ({"logprobs": True}, "logprobs"),
    ({"logprobs": 2.0}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": False}, "prompt_logprobs"),
    ({"n": True}, "n"),
    ({"stop": 5}, "stop"),
    ({"stop": [b"x"]}, "stop"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": "12"}, "stop_token_ids"),
    ({"stop_token_ids": 12}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"skip_special_tokens": 1}, "skip_special_tokens"),
]


@pytest.mark.parametrize(("kwargs", "name"), INVALID, ids=[f"{k}" for k, _ in INVALID])
def test_invalid_value_raises_naming_parameter(kwargs: dict[str, Any], name: str) -> None:
    """Every invalid value raises ValueError whose message starts with the offending parameter's name."""
    with pytest.raises(ParameterError) as exc:
        SamplingParams(**kwargs)
    msg = str(exc.value)
    assert isinstance(exc.value, ValueError) and exc.value.param == name
    assert msg.split()[0] == name, msg
    assert len(msg) < 160 and "\n" not in msg, msg  # one readable line, even for a huge value


def test_defaults_are_valid_and_as_documented() -> None:
    """The defaults construct, sample at temperature 1 with no filters or penalties, and stop after 16 tokens."""
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.seed is None and p.logprobs is None
    assert p.stop_strings == () and p.stop_token_ids is None and not p.ignore_eos
    assert not p.greedy


@pytest.mark.parametrize("kwargs", [
    {"temperature": 0.0}, {"temperature": 2.5}, {"top_p": 1.0}, {"top_p": 1e-6}, {"top_k": 0}, {"top_k": 1},
    {"min_p": 0.0}, {"min_p": 1.0}, {"repetition_penalty": 0.01}, {"presence_penalty": -2.0},
    {"frequency_penalty": 2.0}, {"max_tokens": None}, {"max_tokens": 1}, {"min_tokens": 4, "max_tokens": 4},
    {"min_tokens": 100, "max_tokens": None}, {"logprobs": 0}, {"logprobs": 20}, {"seed": 0}, {"stop": []},
])
def test_boundary_values_are_accepted(kwargs: dict[str, Any]) -> None:
    """Values on the edge of each valid range construct without error and are stored unchanged."""
    p = SamplingParams(**kwargs)
    for k, v in kwargs.items():
        if k != "stop":
            assert getattr(p, k) == v


def test_greedy_below_vllm_threshold() -> None:
    """`greedy` is temperature < 1e-5, vLLM's _SAMPLING_EPS."""
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=9.99e-6).greedy
    assert SamplingParams(temperature=1e-300).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    assert not SamplingParams(temperature=1e-4).greedy


def test_seed_range_and_minus_one() -> None:
    """Seeds span the signed 64-bit range vLLM's API accepts; -1 means no seed, as in vLLM."""
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_stop_string_normalised_to_tuple() -> None:
    """A single stop string becomes a one-element stop_strings tuple; a list keeps its order; None gives ()."""
    assert SamplingParams(stop="###").stop_strings == ("###",)
    assert SamplingParams(stop=["a", "bc", "a"]).stop_strings == ("a", "bc", "a")
    assert SamplingParams(stop=None).stop_strings == ()
    p = SamplingParams(stop=["x"])
    assert isinstance(p.stop_strings, tuple)


def test_stop_strings_is_not_a_constructor_argument() -> None:
    """stop_strings is derived from `stop`; passing it directly is rejected."""
    with pytest.raises(TypeError):
        SamplingParams(stop_strings=("x",))  # type: ignore[call-arg]


def test_top_k_minus_one_becomes_zero() -> None:
    """top_k=-1 (vLLM's 'disabled') is normalised to 0, the internal 'disabled'."""
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5
