"""Streaming detokenization that never splits a UTF-8 character (see `IncrementalDetokenizer`)."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Sequence

from kvlm.errors import TokenizerError

if TYPE_CHECKING:
    from kvlm.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    """Streaming, UTF-8-safe detokenizer for one generated sequence.

    Contract:
    * `push(token_id)` returns only newly *finalized* text (possibly ""): text that no later token
      can change. It never returns part of a multi-byte character, and never returns U+FFFD unless
      the full decode has U+FFFD at that same place (a genuinely invalid byte the model produced).
    * `"".join(pushes) + flush() == tokenizer.decode(generated_ids, skip_special_tokens)` when
      `prompt_ids` is empty. With `prompt_ids`, the result is the text the generated ids add after
      the prompt, i.e. `decode(prompt + generated)[len(decode(prompt)):]`; it differs from
      `decode(generated)` only where decoding depends on context (sentencepiece's leading space).
    * `text` is everything emitted so far. `flush()` emits whatever is still held back (including
      a trailing U+FFFD if the sequence really ends in an incomplete character).

    How: each push decodes a small window (the last emitted chunk plus pending ids) and emits what
    it adds beyond the chunk; the window moves on once the decoded text ends cleanly, so the cost
    per token stays small (it grows only while a character is incomplete).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        prompt = list(prompt_ids)
        # Keep a few prompt ids as left context; walk back until they decode to something, because
        # a window that starts on empty text would let sentencepiece strip a real leading space.
        start = max(len(prompt) - 6, 0)
        while start > 0 and not self._decode(prompt[start:]):
            start = max(start - 6, 0)
        self._ids = prompt[start:]
        self._prefix = 0  # window start: first id of the last emitted chunk (or of the context)
        self._read = len(self._ids)  # ids before this have been emitted
        self._prefix_text: str | None = None
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _advance(self, final: bool) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        window = self._decode(self._ids[self._prefix:])
        if not final and (len(window) <= len(self._prefix_text) or window.endswith("\ufffd")
                          or not window.startswith(self._prefix_text)):
            return ""  # nothing new, or the text may still change (incomplete character)
        delta = window[len(self._prefix_text):]
        self._prefix, self._read, self._prefix_text = self._read, len(self._ids), None
        self.text += delta
        return delta

    def push(self, token_id: int) -> str:
        token_id = operator.index(token_id)
        if not 0 <= token_id < self._tok.vocab_size:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary (size {self._tok.vocab_size})")
        self._ids.append(token_id)
        if token_id in self._tok.byte_ids or (self._skip and token_id in self._tok.special_ids):
            # A byte piece may join the next one (a skipped special token is invisible between them),
            # and a bad group turns wholly into U+FFFD, so neither can finalize anything yet.
            return ""
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True) if self._read < len(self._ids) else ""
