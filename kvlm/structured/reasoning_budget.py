"""A reasoning budget: count one request's tokens inside `<think>...</think>`, then force `</think>`.

`ThinkTokens` holds the token ids of the tags, found once from the tokenizer (`<think>` / `</think>` as
added tokens are one id each; elsewhere their encodings, matched as sequences) and of what the budget
forces: `FORCED_END` encoded. `ReasoningBudget` is one request's bookkeeping, plain Python: the input
processor makes it (with the prompt, which tells whether the template already opened `<think>`), the
output processor shows it every appended token (`observe`), and while it forces, the sampler replaces the
row's chosen token by `forced` (`kvlm.engine.sampler`). The row's logits and logprobs are untouched, and
no other row is read or written, so a request's tokens are the same alone or in any batch.

Counting: every output token while the span is open is a reasoning token (the `<think>` the model may
write itself is not; a multi-token `</think>` counts its leading pieces). Once `budget` are spent, the next
`len(force_ids)` tokens are forced, one per step; then the request is out of its reasoning and the
budget is done. A span the model closes itself ends the count. With `budget` None the span is only tracked:
a request's grammar waits for its end (`grammar_waits`; the sampler does not mask those rows, the output
processor does not feed those tokens to the matcher), so a thinking model reasons freely, then answers in
the constrained form.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvlm.structured.reasoning import THINK_END, THINK_START

# What a spent budget forces: the close tag on a line of its own, then the blank line Qwen3's template puts
# between reasoning and answer.
FORCED_END = "\n" + THINK_END + "\n\n"


def _ends_with(seq: Sequence[int], tail: Sequence[int]) -> bool:
    return len(seq) >= len(tail) > 0 and list(seq[len(seq) - len(tail):]) == list(tail)


def _last_index(seq: Sequence[int], sub: Sequence[int]) -> int:
    """Start of the last occurrence of `sub` in `seq`, or -1."""
    n = len(sub)
    for i in range(len(seq) - n, -1, -1):
        if seq[i] == sub[0] and list(seq[i:i + n]) == list(sub):
            return i
    return -1


@dataclass(frozen=True, slots=True)
class ThinkTokens:
    """Token ids of `<think>`, `</think>` and of what a spent budget forces (`FORCED_END`)."""

    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    force_ids: tuple[int, ...]

    @classmethod
    def from_encoder(cls, encode: Callable[[str], list[int]]) -> ThinkTokens:
        """`encode`: text -> ids without BOS/EOS (`Tokenizer.encode(text, add_special_tokens=False)`)."""
        return cls(tuple(encode(THINK_START)), tuple(encode(THINK_END)), tuple(encode(FORCED_END)))

    def prompt_opens(self, prompt_ids: Sequence[int]) -> bool:
        """Does the prompt end inside an open `<think>` (the last start tag is not closed after it)?"""
        start = _last_index(prompt_ids, self.start_ids)
        return start != -1 and _last_index(prompt_ids[start:], self.end_ids) == -1


@dataclass(slots=True)
class ReasoningBudget:
    """One request's reasoning budget: `spent` reasoning tokens of `budget`; `forced` is the token the next
    step must take (None: the model chooses)."""

    tokens: ThinkTokens
    budget: int | None  # None: the span is only tracked (for a grammar that waits for its end)
    in_reasoning: bool
    spent: int = 0
    done: bool = False  # the span closed (by the model or by forcing): nothing more to count
    forcing: list[int] = field(default_factory=list)  # forced tokens still to come, next first
    recent: list[int] = field(default_factory=list)  # the last output tokens, as long as the longest tag

    @classmethod
    def start(cls, tokens: ThinkTokens, budget: int | None, prompt_ids: Sequence[int]) -> ReasoningBudget:
        b = cls(tokens, budget, tokens.prompt_opens(prompt_ids))
        b._check_spent()
        return b

    @property
    def forced(self) -> int | None:
        return self.forcing[0] if self.forcing else None

    @property
    def grammar_waits(self) -> bool:
        """Inside the span (or forcing its end): a grammar does not constrain these tokens nor see them."""
        return self.in_reasoning or bool(self.forcing)

    def observe(self, token: int) -> None:
        """The request appended `token` (the forced one while forcing)."""
        if self.done:
            return
        if self.forcing:
            self.forcing.pop(0)
            if not self.forcing:
                self.in_reasoning, self.done = False, True
            return
        t = self.tokens
        self.recent = (self.recent + [token])[-max(len(t.start_ids), len(t.end_ids)):]
        if not self.in_reasoning:
            self.in_reasoning = _ends_with(self.recent, t.start_ids)  # the model opened the span itself
        elif _ends_with(self.recent, t.end_ids):
            self.in_reasoning, self.done = False, True
        else:
            self.spent += 1
        self._check_spent()

    def _check_spent(self) -> None:
        if self.in_reasoning and self.budget is not None and self.spent >= self.budget:
            self.forcing = list(self.tokens.force_ids)
