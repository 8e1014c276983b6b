"""The reasoning parser: `<think>...</think>` split from the answer, whole and streamed (no model)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlm.errors import ParameterError
from kvlm.structured.reasoning import (
    ReasoningConfig,
    ReasoningPlan,
    ReasoningSplit,
    ReasoningStream,
    effort_budget,
    prompt_opens_reasoning,
    split_reasoning,
    template_kwargs,
    template_thinks,
)


@pytest.mark.parametrize(("text", "opened", "want"), [
    ("Let me see.\n</think>\n\nFour.", True, ReasoningSplit("Let me see.\n", "\n\nFour.")),  # template opened it
    ("Let me see", True, ReasoningSplit("Let me see", "")),  # cut before `</think>`: all reasoning
    ("</think>Four", True, ReasoningSplit("", "Four")),
    ("Four.", False, ReasoningSplit(None, "Four.")),  # no span (enable_thinking=false closed it in the prompt)
    ("\n<think>hm</think>Four", False, ReasoningSplit("hm", "Four")),  # the model opened it itself
    ("Four <think>x</think>", False, ReasoningSplit(None, "Four <think>x</think>")),  # not at the start: content
    ("a</think>b</think>c", True, ReasoningSplit("a", "b</think>c")),  # only the first tag closes
    ("a</thin", True, ReasoningSplit("a</thin", "")),  # a partial tag at the very end is text
    ("<thin", False, ReasoningSplit(None, "<thin")),
    ("", True, ReasoningSplit("", "")),
])
def test_split(text: str, opened: bool, want: ReasoningSplit) -> None:
    assert split_reasoning(text, opened) == want


def test_stream_holds_back_tag_prefixes() -> None:
    s = ReasoningStream(in_reasoning=True)
    assert s.feed("I think</") == ("I think", "")
    assert s.feed("thi") == ("", "")
    assert s.feed("nk>\n\nA") == ("", "\n\nA")
    assert s.feed("nswer é", final=True) == ("", "nswer é")
    start = ReasoningStream(in_reasoning=False)
    assert start.feed("  <th") == ("", "") and start.feed("ink>why") == ("why", "") and start.opened


PIECES = ["<think>", "</think>", "<", "</", "</th", "think>", ">", "\n", " ", "a", "é", "日本", "🙂", "x</thin"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=14), st.booleans(), st.data())
def test_any_split_into_deltas_equals_the_whole(pieces: list[str], opened: bool, data: st.DataObject) -> None:
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    stream, reasoning, content = ReasoningStream(opened), "", ""
    for k, d in enumerate(deltas):
        r, c = stream.feed(d, final=k == len(deltas) - 1)
        assert "</think>" not in r and (not content or not r)  # no tag sent; reasoning never after content
        reasoning, content = reasoning + r, content + c
    whole = split_reasoning(text, opened)
    assert (reasoning if stream.opened else None, content) == (whole.reasoning, whole.content)
    if whole.reasoning is None:  # nothing lost either way: the parts and the tags rebuild the text
        assert whole.content == text
    else:
        body = text if opened else text.lstrip()[len("<think>"):]
        assert body == whole.reasoning + ("</think>" + whole.content if "</think>" in body else whole.content)


def test_prompt_and_template_detection() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    assert template_thinks("{% if enable_thinking %}...") and template_thinks("<think>") and not template_thinks(None)
    assert template_kwargs("{{ enable_thinking }}", None) == {"enable_thinking": True}  # vLLM's default, explicit
    assert template_kwargs("{{ enable_thinking }}", {"enable_thinking": False}) == {"enable_thinking": False}
    assert template_kwargs("<think>", {"x": 1}) == {"x": 1}  # a template that does not take it is not given it


def test_config_decides_once() -> None:
    auto = ReasoningConfig.choose("auto", "{{ '<think>' }}", 100)
    assert auto.parser == "think" and auto.default_budget == 100 and "auto" in auto.describe()
    assert ReasoningConfig.choose("auto", "plain", 100).parser is None  # no thinking template: no split, no budget
    assert ReasoningConfig.choose("auto", "plain", 100).default_budget is None
    assert ReasoningConfig.choose("think", None, None).parser == "think"
    assert ReasoningConfig.choose("none", "<think>", None).parser is None
    assert auto.budget(7, "low") == 7 and auto.budget(None, "low") == 256 and auto.budget(None, None) == 100
    assert effort_budget("xhigh") is None and effort_budget("max") is None and effort_budget("none") == 0
    with pytest.raises(ParameterError, match="^reasoning_effort must be one of") as e:
        auto.budget(None, "extreme")
    assert e.value.param == "reasoning_effort"
    with pytest.raises(ParameterError, match="^reasoning_budget must be an integer >= 0"):
        auto.budget(-1, None)
    opened, closed = "assistant\n<think>\n", "assistant\n<think>\n\n</think>\n\n"
    assert auto.plan(opened) == ReasoningPlan(True, True, 100)
    assert auto.plan(closed, effort="low") == ReasoningPlan(True, False, 256)
    assert auto.plan(opened, 5, constrained=True) == ReasoningPlan(True, True, 5)  # the grammar waits for </think>
    assert auto.plan(opened).sampling == {"reasoning": True, "reasoning_budget": 100}
    assert auto.plan(closed, constrained=True) == ReasoningPlan(False, False, None)  # a grammar from token one
    assert auto.plan(opened).parts("a</think>b") == ReasoningSplit("a", "b")
    assert auto.plan(closed, constrained=True).parts("a</think>b") == ReasoningSplit(None, "a</think>b")
    with pytest.raises(ParameterError, match="^reasoning_effort"):  # refused even where nothing thinks
        ReasoningConfig.choose("none", None, None).plan(opened, effort="hard")
    with pytest.raises(ParameterError, match="^reasoning_parser"):
        ReasoningConfig.choose("deepseek", None, None)
    with pytest.raises(ParameterError, match="^reasoning_budget"):
        ReasoningConfig.choose("think", None, -1)
