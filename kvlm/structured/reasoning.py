"""Reasoning out of generated text: a `<think>...</think>` span split from the answer, whole or streamed.

Models that think in `<think>...</think>` (Qwen3, DeepSeek-R1 distills, SmolLM3) write their reasoning
first, then the answer. `ReasoningStream` takes one choice's text deltas and gives back, for each, the part
that is reasoning and the part that is content (what vLLM's `--reasoning-parser` `deepseek_r1` / `qwen3`
and llama.cpp's `--reasoning-format deepseek` return as `reasoning` and `content`); `split_reasoning` is the
same machine fed the whole text at once, so streamed and whole answers cannot disagree.

The rules (vLLM's, with the prompt deciding where the output starts):
* The chat template may already have opened `<think>` in the prompt (Qwen3, R1 distills): the output then
  starts inside the reasoning (`in_reasoning=True`, from `prompt_opens_reasoning`). Otherwise a `<think>`
  at the very start of the output (after whitespace) opens it; anywhere else it is plain content.
* Everything up to `</think>` is reasoning; the tags themselves are in neither part; what follows is
  content, verbatim. A reasoning span never closed (max_tokens cut it) is all reasoning, no content.
* A template told `enable_thinking=False` closes the span in the prompt (`<think>\\n\\n</think>`): the output
  is all content.
* Streaming never sends a tag, or a piece of one, in either part: a tail that could still grow into the
  tag it waits for is held back until the next delta (or the last one) decides it. Deltas are `str`s
  from the engine's detokenizer, which never splits a UTF-8 character, so neither does this.

Which requests get split, and with what reasoning budget, is decided in `ReasoningConfig` below: the
server asks it, nothing re-derives it. The engine's side (counting reasoning tokens, forcing `</think>`
when a budget is spent) is `reasoning_budget.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvlm.errors import ParameterError

THINK_START, THINK_END = "<think>", "</think>"

# `reasoning_effort` (OpenAI's values) -> reasoning budget in tokens (None: no budget). kvlm's own table: neither
# vLLM nor llama.cpp maps efforts to budgets (an effort is a hint to models trained on it; a budget works on
# any thinking model).
EFFORT_BUDGETS: dict[str, int | None] = {"none": 0, "minimal": 64, "low": 256, "medium": 1024, "high": 4096,
                                         "xhigh": None, "max": None}
PARSERS = ("think", "none", "auto")


@dataclass(frozen=True, slots=True)
class ReasoningSplit:
    """A whole answer's parts: reasoning is None when no reasoning span was opened."""

    reasoning: str | None
    content: str


def _partial(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningStream:
    """Feed one choice's text deltas; get back (reasoning delta, content delta) for each.

    `in_reasoning`: the prompt opened `<think>` (`prompt_opens_reasoning`), so the output starts inside it.
    `opened` says whether a reasoning span was seen at all (the non-streamed `reasoning` is None if not)."""

    def __init__(self, in_reasoning: bool) -> None:
        self.mode = "reasoning" if in_reasoning else "start"  # start -> reasoning | content; reasoning -> content
        self.opened = in_reasoning
        self.pending = ""  # held back: a possible tag prefix (or, at the start, leading whitespace)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and content text to send for this delta (either may be "")."""
        self.pending += text
        reasoning = content = ""
        if self.mode == "start":
            head = self.pending.lstrip()
            if head.startswith(THINK_START):
                self.mode, self.opened, self.pending = "reasoning", True, head[len(THINK_START):]
            elif not final and (not head or THINK_START.startswith(head)):
                return "", ""  # still undecided: whitespace, or a beginning of "<think>"
            else:
                self.mode = "content"
        if self.mode == "reasoning":
            i = self.pending.find(THINK_END)
            if i == -1:
                cut = len(self.pending) - (0 if final else _partial(self.pending, THINK_END))
                reasoning, self.pending = self.pending[:cut], self.pending[cut:]
                return reasoning, ""
            reasoning, self.pending, self.mode = self.pending[:i], self.pending[i + len(THINK_END):], "content"
        content, self.pending = self.pending, ""
        return reasoning, content


def split_reasoning(text: str, in_reasoning: bool) -> ReasoningSplit:
    """A whole answer's (reasoning, content): `ReasoningStream` fed `text` as one final delta."""
    stream = ReasoningStream(in_reasoning)
    reasoning, content = stream.feed(text, final=True)
    return ReasoningSplit(reasoning if stream.opened else None, content)


def prompt_opens_reasoning(prompt: str) -> bool:
    """Does the rendered prompt end inside an open `<think>` (the template opened it for the model)?"""
    start = prompt.rfind(THINK_START)
    return start != -1 and prompt.find(THINK_END, start) == -1


def template_thinks(chat_template: str | None) -> bool:
    """Does this chat template declare thinking (it writes `<think>` or takes `enable_thinking`)?"""
    return chat_template is not None and (THINK_START in chat_template or "enable_thinking" in chat_template)


def template_kwargs(chat_template: str | None, requested: dict[str, Any] | None) -> dict[str, Any]:
    """A request's template variables (vLLM's `chat_template_kwargs`), with `enable_thinking=True` made
    explicit for a template that takes it (vLLM's default) unless the request set it."""
    given = dict(requested or {})
    if chat_template and "enable_thinking" in chat_template:
        given.setdefault("enable_thinking", True)
    return given


def _check_budget(value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ParameterError("reasoning_budget", f"reasoning_budget must be an integer >= 0, got {value!r}")


def effort_budget(effort: str) -> int | None:
    """The reasoning budget `reasoning_effort` stands for (`EFFORT_BUDGETS`); another value is refused."""
    if effort not in EFFORT_BUDGETS:
        raise ParameterError("reasoning_effort", f"reasoning_effort must be one of {', '.join(EFFORT_BUDGETS)}, "
                                                 f"got {effort!r}")
    return EFFORT_BUDGETS[effort]


@dataclass(frozen=True, slots=True)
class ReasoningPlan:
    """One request's reasoning: is its output split, does it start inside `<think>`, and its budget
    (`SamplingParams.reasoning_budget`; None: none)."""

    split: bool
    in_reasoning: bool
    budget: int | None

    def parts(self, text: str) -> ReasoningSplit:
        """A whole answer's parts (all content when the output is not split)."""
        return split_reasoning(text, self.in_reasoning) if self.split else ReasoningSplit(None, text)

    def stream(self) -> ReasoningStream | None:
        """The parser for one streamed choice (None when the output is not split)."""
        return ReasoningStream(self.in_reasoning) if self.split else None

    @property
    def sampling(self) -> dict[str, Any]:
        """The `SamplingParams` fields this plan sets: the span tracked (a grammar waits for its end) where
        the prompt opened it, and the budget."""
        return {"reasoning": self.split and self.in_reasoning, "reasoning_budget": self.budget}


@dataclass(frozen=True, slots=True)
class ReasoningConfig:
    """The one decision about reasoning for a served model: is the output split (`parser` "think" or None),
    and the default budget (`--reasoning-budget`; None: none). `why` says how it was chosen, for the
    server's ready line."""

    parser: str | None
    default_budget: int | None
    why: str

    @classmethod
    def choose(cls, flag: str, chat_template: str | None, default_budget: int | None) -> ReasoningConfig:
        """`flag`: --reasoning-parser (think, none, or auto: think where the template declares thinking)."""
        if flag not in PARSERS:
            raise ParameterError("reasoning_parser", f"reasoning_parser must be one of {', '.join(PARSERS)}, "
                                                     f"got {flag!r}")
        _check_budget(default_budget)
        if flag == "auto":
            thinks = template_thinks(chat_template)
            parser = "think" if thinks else None
            why = "auto: the chat template thinks" if thinks else "auto: the chat template does not think"
        else:
            parser, why = (None if flag == "none" else "think"), f"--reasoning-parser {flag}"
        return cls(parser, default_budget if parser else None, why)

    def budget(self, explicit: int | None, effort: str | None) -> int | None:
        """A request's budget: its own `reasoning_budget`, else its `reasoning_effort`'s, else the default.
        Bad values are refused (`ParameterError`) whether or not this model thinks."""
        _check_budget(explicit)
        by_effort = effort_budget(effort) if effort is not None else self.default_budget
        return explicit if explicit is not None else by_effort

    def plan(self, prompt: str, explicit: int | None = None, effort: str | None = None,
             constrained: bool = False) -> ReasoningPlan:
        """What one request gets: `prompt` is its rendered prompt (did the template open `<think>`?);
        `constrained`: a grammar would decide the output from its first token (a JSON schema, a required
        tool call). Where the prompt opened `<think>`, the grammar then waits for `</think>`
        (`SamplingParams.reasoning`); where it did not, the model cannot think: no split, no budget."""
        budget = self.budget(explicit, effort)
        opens = prompt_opens_reasoning(prompt)
        if self.parser is None or (constrained and not opens):
            return ReasoningPlan(False, False, None)
        return ReasoningPlan(True, opens, budget)

    def describe(self) -> str:
        if self.parser is None:
            return f"reasoning parser none ({self.why})"
        budget = "none" if self.default_budget is None else f"{self.default_budget} tokens"
        return f"reasoning parser {self.parser} ({self.why}), budget {budget}"
