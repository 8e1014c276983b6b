"""`RequestGrammar`: one request's grammar state, from its pending compile to the tokens it accepted.

The engine gives each constrained request one (n > 1 means n requests, so n matchers). While the
compile is pending the scheduler leaves the request waiting (`ready` is False) and runs the others.
Then the request's matcher (a private copy of the compiled prototype) gives that request's mask row
before each sample and consumes each token the output processor appends. Preemption by recompute keeps
a request's output tokens (they are prefilled again, never sampled again), so the matcher keeps its state
and is never rolled back or replayed; an aborted request drops it.

With a `MaskPrefetcher`, accepting a token also queues the computation of the next mask on the
prefetcher's thread; the grammar's lock is held until it is done, and everything that reads or moves the
matcher on the engine's thread waits for it first, so the matcher is never used by two threads at once.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvlm.structured.prefetch import MaskPrefetcher


class RequestGrammar:
    def __init__(self, future: Future, mask_words: int, prefetcher: MaskPrefetcher | None = None) -> None:
        self.future = future
        self.mask_words = mask_words  # int32 words of this grammar's bitmask: ceil(its vocabulary / 32)
        self._matcher: Any = None
        self.num_consumed = 0  # output tokens the matcher has accepted
        self._prefetcher = prefetcher
        self._mask = torch.zeros(mask_words, dtype=torch.int32)  # (W,) the bitmask after `_mask_at` tokens
        self._mask_at = -1  # num_consumed when `_mask` was filled; -1: never
        self._busy = threading.Lock()  # held while the prefetcher fills `_mask`

    @property
    def ready(self) -> bool:
        """The compile finished (successfully or not)."""
        return self.future.done()

    @property
    def error(self) -> BaseException | None:
        return self.future.exception() if self.future.done() else None

    def _wait(self) -> None:
        """Until a prefetch in flight is done (only the engine's thread submits, so none starts meanwhile)."""
        if self._busy.locked():
            with self._busy:
                pass

    @property
    def matcher(self) -> Any:
        """This request's llguidance `LLMatcher` (only once `ready` and without `error`). Move it only by
        `accept` and `rollback`, which keep the mask buffer in step."""
        self._wait()
        if self._matcher is None:
            self._matcher = self.future.result().deep_copy()
        return self._matcher

    def mask(self) -> torch.Tensor:
        """(W,) int32: the allowed-token bitmask of the current state (bit t % 32 of word t // 32), the
        prefetched one when it is for this state. A stopped matcher allows EOS only; one in error allows EOS
        only too, so the request ends. The tensor is this grammar's buffer: read it before the next `accept`."""
        m = self.matcher  # waits for a prefetch in flight
        if self._mask_at != self.num_consumed:
            m.unsafe_compute_mask_ptr(self._mask.data_ptr(), self.mask_words * 4)
            self._mask_at = self.num_consumed
        return self._mask

    def _prefetch(self) -> None:
        """On the prefetcher's thread, holding `_busy` (released here): fill `_mask` for the current state."""
        try:
            self._matcher.unsafe_compute_mask_ptr(self._mask.data_ptr(), self.mask_words * 4)
            self._mask_at = self.num_consumed
        finally:
            self._busy.release()

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False if the grammar refused it (the matcher is then in error).
        With a prefetcher, the next mask is then computed on its thread."""
        m = self.matcher
        self.num_consumed += 1
        ok = bool(m.consume_token(token))
        if self._prefetcher is not None:
            self._busy.acquire()
            self._prefetcher.submit(self)
        return ok

    def rollback(self, num_tokens: int) -> bool:
        """Undo the last `num_tokens` accepted tokens (the engine never needs to; tests do)."""
        ok = bool(self.matcher.rollback(num_tokens))
        self.num_consumed -= num_tokens
        self._mask_at = -1
        return ok

    @property
    def is_stopped(self) -> bool:
        return bool(self.matcher.is_stopped())

    @property
    def is_accepting(self) -> bool:
        return bool(self.matcher.is_accepting())
