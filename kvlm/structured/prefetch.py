"""`MaskPrefetcher`: one thread that computes each grammar's next bitmask while the engine goes on.

A request's next mask depends only on the tokens its matcher has accepted, so it can be computed as soon
as the output processor accepts a token: the rest of that step's bookkeeping, the next step's scheduling
and its forward pass run meanwhile, and the sampler finds the mask ready (vLLM and SGLang overlap it
the same way). llguidance releases the GIL while it fills a mask, so the engine thread is not held up;
it is held up only where the sampler needs a mask still being computed (`RequestGrammar.mask` waits).

The thread starts on first use and serves grammars in the order they were submitted. It knows nothing of
matchers: it runs `RequestGrammar._prefetch` on each, which releases that grammar's lock when done.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvlm.structured.matcher import RequestGrammar

log = logging.getLogger("kvlm")


class MaskPrefetcher:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[RequestGrammar | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, grammar: RequestGrammar) -> None:
        """Queue `grammar._prefetch()` (the caller holds the grammar's lock; the worker releases it)."""
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=_serve, args=(self._queue,), daemon=True,
                                                    name="kvlm-mask")
                    self._thread.start()
        self._queue.put(grammar)

    def close(self) -> None:
        """Stop the thread once what is queued is done."""
        if self._thread is not None:
            self._queue.put(None)


def _serve(q: queue.SimpleQueue[RequestGrammar | None]) -> None:
    while (g := q.get()) is not None:
        try:
            g._prefetch()
        except Exception:  # noqa: BLE001 - the engine thread computes the mask again and meets the error there
            log.debug("kvlm: mask prefetch failed", exc_info=True)
