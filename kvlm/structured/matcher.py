"""`RequestGrammar`: one request's grammar state, from its pending compile to the tokens it accepted.

The engine gives each constrained request one (n > 1 means n requests, so n matchers). While the
compile is pending the scheduler leaves the request waiting (`ready` is False) and runs the others.
Then the request's matcher (a private copy of the compiled prototype) fills that request's mask row
(its own buffer, so a step allocates nothing for it) before each sample and consumes each token the
output processor appends. Preemption by recompute keeps a request's output tokens (they are prefilled
again, never sampled again), so the matcher keeps its state and is never rolled back or replayed; an
aborted request drops it. Speculative decoding only looks ahead: `valid_prefix` cuts drafts the grammar
forbids, `masks_along` gives the mask after each draft and rolls the matcher back to where it was; the
tokens kept are then consumed one by one like any other.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch


class RequestGrammar:
    def __init__(self, future: Future, mask_words: int) -> None:
        self.future = future
        self.mask_words = mask_words  # int32 words of this grammar's bitmask: ceil(its vocabulary / 32)
        self._matcher: Any = None
        self.num_consumed = 0  # output tokens the matcher has accepted
        self._mask = torch.zeros(mask_words, dtype=torch.int32)  # (W,) filled by `mask`
        self._mask_ptr = self._mask.data_ptr()

    @property
    def ready(self) -> bool:
        """The compile finished (successfully or not)."""
        return self.future.done()

    @property
    def error(self) -> BaseException | None:
        return self.future.exception() if self.future.done() else None

    @property
    def matcher(self) -> Any:
        """This request's llguidance `LLMatcher` (only once `ready` and without `error`)."""
        if self._matcher is None:
            self._matcher = self.future.result().deep_copy()
        return self._matcher

    def mask(self) -> torch.Tensor:
        """(W,) int32: the allowed-token bitmask of the current state (bit t % 32 of word t // 32). A stopped
        matcher allows EOS only; one in error allows EOS only too, so the request ends. The tensor is this
        grammar's buffer, written again by the next call."""
        self.matcher.unsafe_compute_mask_ptr(self._mask_ptr, self.mask_words * 4)
        return self._mask

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar accepts from its current state (the state is unchanged)."""
        return int(self.matcher.validate_tokens(tokens))

    def masks_along(self, tokens: list[int]) -> torch.Tensor:
        """(len(tokens) + 1, W) int32: the bitmask now, then after each of `tokens` (which it must accept:
        `valid_prefix`); the matcher is rolled back to its current state after."""
        out = torch.empty(len(tokens) + 1, self.mask_words, dtype=torch.int32)
        out[0] = self.mask()
        for j, t in enumerate(tokens, 1):
            assert self.matcher.consume_token(t), "masks_along: a token the grammar refuses"
            out[j] = self.mask()
        if tokens:
            self.matcher.rollback(len(tokens))
        return out

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False if the grammar refused it (the matcher is then in error)."""
        self.num_consumed += 1
        return bool(self.matcher.consume_token(token))

    @property
    def is_stopped(self) -> bool:
        return bool(self.matcher.is_stopped())

    @property
    def is_accepting(self) -> bool:
        return bool(self.matcher.is_accepting())
