"""Draft proposers: from a request's token ids (prompt + output) guess up to k tokens that follow.

One small interface (`Proposer`): `propose(key, tokens, k)` returns at most k token ids, `finish(key,
tokens)` tells it a request ended (its tokens may feed later guesses), `forget(key)` drops its state.
`key` is the caller's handle for a request (the engine passes the `Request` itself; nothing here reads it).
Guesses never change what is generated: the engine keeps only the drafts the target model itself picks
(`kvlm.engine.speculator`), so a proposer is judged by acceptance and cost alone.

* `ngram` (prompt lookup, HF `prompt_lookup_num_tokens`, vLLM `ngram`): the longest tail of the history,
  between `min_n` and `max_n` tokens, that occurred before; propose what followed its latest earlier
  occurrence (its first one when the latest is followed by fewer than k tokens, as in a repeating run).
  The index of earlier n-grams grows with the request (`_TailIndex`), so a proposal costs O(max_n)
  dictionary lookups, not a scan of the history.
* `suffix` (after SuffixDecoding, arXiv:2411.04975, vLLM's `suffix`, and llama.cpp's ngram-cache): counts of
  which token followed each context of `min_n`..`max_n` tokens, over the request's own history and the last
  `max_cached_requests` finished requests. A proposal walks forward k times: the longest context with a
  count, its most frequent continuation (the request's own counts first), appended to the context.
  Agent loops and repeated tool outputs, where earlier requests already said what comes next, gain most.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from typing import Protocol

from kvlm.config import SPEC_METHODS as METHODS


class Proposer(Protocol):
    def propose(self, key: Hashable, tokens: Sequence[int], k: int) -> list[int]:
        """At most k tokens guessed to follow `tokens` (the request's whole history)."""
        ...

    def finish(self, key: Hashable, tokens: Sequence[int]) -> None:
        """The request behind `key` ended with `tokens`; its state may be dropped."""
        ...

    def forget_finished(self) -> None:
        """Drop whatever finished requests left behind (nothing, for a proposer that keeps none)."""
        ...


class _TailIndex:
    """For one token sequence, growing at its end: per n in [min_n, max_n], each n-gram's latest end
    position j that has a continuation (tokens[j] exists), and counts of what followed it."""

    __slots__ = ("min_n", "max_n", "first", "last", "follow", "indexed")

    def __init__(self, min_n: int, max_n: int, counts: bool) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.first: dict[tuple[int, ...], int] = {}  # n-gram -> earliest j with tokens[j - n : j] == it
        self.last: dict[tuple[int, ...], int] = {}  # n-gram -> latest such j
        self.follow: dict[tuple[int, ...], Counter[int]] | None = {} if counts else None
        self.indexed = 0  # ends j < indexed are in the index

    def update(self, tokens: Sequence[int]) -> None:
        """Index every end j < len(tokens) (each one with its continuation tokens[j])."""
        for j in range(max(self.indexed, self.min_n), len(tokens)):
            for n in range(self.min_n, min(self.max_n, j) + 1):
                gram = tuple(tokens[j - n : j])
                self.first.setdefault(gram, j)
                self.last[gram] = j
                if self.follow is not None:
                    self.follow.setdefault(gram, Counter())[tokens[j]] += 1
        self.indexed = max(self.indexed, len(tokens))


class NgramProposer:
    """Prompt lookup over the request's own prompt and output (see the module docstring)."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram: need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.index: dict[Hashable, _TailIndex] = {}

    def propose(self, key: Hashable, tokens: Sequence[int], k: int) -> list[int]:
        idx = self.index.get(key)
        if idx is None:
            idx = self.index[key] = _TailIndex(self.min_n, self.max_n, counts=False)
        idx.update(tokens)
        L = len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            gram = tuple(tokens[L - n :])
            j = idx.last.get(gram)
            if j is not None:  # j < L: an earlier occurrence, followed by tokens[j:]
                if L - j < k:  # too close to the end to follow for k tokens (a repeating run): the first one
                    j = idx.first[gram]
                return list(tokens[j : min(j + k, L)])
        return []

    def finish(self, key: Hashable, tokens: Sequence[int]) -> None:
        self.index.pop(key, None)

    def forget_finished(self) -> None:
        pass  # it keeps nothing of finished requests


class SuffixProposer:
    """Continuation counts over the request's history and recent finished requests (module docstring)."""

    def __init__(self, min_n: int = 1, max_n: int = 8, max_cached_requests: int = 64) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"suffix: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n, self.max_cached = min_n, max_n, max_cached_requests
        self.index: dict[Hashable, _TailIndex] = {}
        # finished requests' counts, summed (`shared`), and each one's, to subtract when it ages out
        self.shared: dict[tuple[int, ...], Counter[int]] = {}
        self.recent: OrderedDict[Hashable, dict[tuple[int, ...], Counter[int]]] = OrderedDict()

    def propose(self, key: Hashable, tokens: Sequence[int], k: int) -> list[int]:
        idx = self.index.get(key)
        if idx is None:
            idx = self.index[key] = _TailIndex(self.min_n, self.max_n, counts=True)
        idx.update(tokens)
        own = idx.follow
        assert own is not None
        ctx = list(tokens[-self.max_n :])
        out: list[int] = []
        while len(out) < k:
            nxt = None
            for n in range(min(self.max_n, len(ctx)), self.min_n - 1, -1):
                gram = tuple(ctx[len(ctx) - n :])
                c = own.get(gram) or self.shared.get(gram)
                if c:
                    nxt = c.most_common(1)[0][0]  # ties: the continuation seen first
                    break
            if nxt is None:
                break
            out.append(nxt)
            ctx.append(nxt)
        return out

    def forget_finished(self) -> None:
        """Drop what finished requests taught it (a benchmark repeating one prompt measures it cold)."""
        self.shared.clear()
        self.recent.clear()

    def finish(self, key: Hashable, tokens: Sequence[int]) -> None:
        idx = self.index.pop(key, None)
        if idx is None or idx.follow is None:
            return
        idx.update(tokens)
        self.recent[object()] = idx.follow  # (the request's key may be reused; its counts stay anonymous)
        for gram, c in idx.follow.items():
            self.shared.setdefault(gram, Counter()).update(c)
        while len(self.recent) > self.max_cached:
            _, old = self.recent.popitem(last=False)
            for gram, c in old.items():
                left = self.shared[gram]
                left.subtract(c)
                left += Counter()  # drop counts that reached 0
                if not left:
                    del self.shared[gram]
                else:
                    self.shared[gram] = left


def make_proposer(method: str, min_n: int | None = None, max_n: int | None = None) -> Proposer:
    """The proposer named `method` ("ngram" or "suffix"), with its n-gram lengths (None: its defaults)."""
    if method == "ngram":
        return NgramProposer(min_n or 2, max_n or 4)
    if method == "suffix":
        return SuffixProposer(min_n or 1, max_n or 8)
    raise ValueError(f"speculative method must be one of {', '.join(METHODS)}; got {method!r}")
