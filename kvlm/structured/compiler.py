"""`GrammarCompiler`: grammars compiled off the step loop, in one worker thread, cached per grammar.

`submit(spec)` returns a `Future` at once; the worker builds llguidance's tokenizer (first use only),
turns the spec into a grammar, checks it and builds a matcher, which becomes the cache entry. Each request
gets its own `deep_copy()` of that matcher (copying is cheap; building a parser for a large schema is not).
A bad grammar resolves the future with a `ParameterError` naming `structured_outputs`; failures are cached
too, so a client repeating a bad schema costs nothing. llguidance releases the GIL while it compiles, so the
engine loop keeps stepping other requests meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvlm.errors import ParameterError
from kvlm.sampling_params import StructuredOutputsParams
from kvlm.structured.grammar import build_tokenizer, cache_key, grammar_text
from kvlm.structured.matcher import RequestGrammar

if TYPE_CHECKING:
    import llguidance

    from kvlm.tokenizer.tokenizer import Tokenizer


class GrammarCompiler:
    """Compiles `StructuredOutputsParams` for one tokenizer; thread-safe. `max_cached` grammars are kept
    (least recently used evicted)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_cached: int = 256) -> None:
        self.tokenizer, self.vocab_size, self.max_cached = tokenizer, vocab_size, max_cached
        self._lltok: llguidance.LLTokenizer | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.compile_seconds: dict[str, float] = {}  # last compile time per cache key (bench reads it)

    @property
    def mask_words(self) -> int:
        """int32 words of one bitmask row: the grammar vocabulary is the larger of the model's and the
        tokenizer's (`build_tokenizer`)."""
        return (max(self.vocab_size, self.tokenizer.vocab_size) + 31) // 32

    def request_grammar(self, spec: StructuredOutputsParams) -> RequestGrammar:
        """A new request's grammar state, its compile submitted (or found in the cache)."""
        return RequestGrammar(self.submit(spec), self.mask_words)

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer (built on first use; call from the worker or where blocking is fine)."""
        with self._lock:
            if self._lltok is None:
                self._lltok = build_tokenizer(self.tokenizer, self.vocab_size)
            return self._lltok

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """A future of the compiled matcher prototype of `spec` (never copy-free: callers `deep_copy()`)."""
        key = cache_key(spec)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvlm-grammar")
            fut = self._pool.submit(self._compile, spec, key)
            self._cache[key] = fut
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return fut

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """Compile now (waiting for the worker); raises `ParameterError` for a bad grammar."""
        return self.submit(spec).result()

    def _compile(self, spec: StructuredOutputsParams, key: str) -> Any:
        import llguidance

        lltok = self.lltokenizer  # built once, not counted as this grammar's compile time
        t0 = time.perf_counter()
        text = grammar_text(spec)
        err = llguidance.LLMatcher.validate_grammar(text, lltok)
        if err:
            raise ParameterError("structured_outputs", f"structured_outputs: invalid {spec.kind}: {_first_line(err)}")
        matcher = llguidance.LLMatcher(lltok, text, log_level=0)
        if matcher.is_error():
            raise ParameterError("structured_outputs",
                                 f"structured_outputs: invalid {spec.kind}: {_first_line(matcher.get_error())}")
        self.compile_seconds[key] = time.perf_counter() - t0
        return matcher

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _first_line(message: str) -> str:
    """llguidance's message (often several lines, with a caret diagram) as one line of at most 300 chars."""
    line = " ".join(part.strip() for part in message.splitlines() if part.strip()) or "rejected by the compiler"
    return line if len(line) <= 300 else line[:297] + "..."
