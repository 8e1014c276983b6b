"""Prefix-cache miss diagnostics: why a request reused less of its prompt than an earlier request shared
(plain Python, no torch).

The scheduler shows each newly admitted request to a `PrefixHistory`, which remembers the token ids of
recent requests. It finds the earlier request sharing the longest common prefix with the new one and
compares what that prefix would have allowed (its full blocks, minus the last prompt token, which always
runs) with what the cache actually gave:

* `evicted`: the shared blocks were cached once but are gone (evicted for room, or never cached because
  the other request was aborted or asked for prompt logprobs);
* `short`: the shared prefix is shorter than one block, and only full blocks are shared;
* `diverged`: everything shareable was reused, but the two prompts part at token P, inside what the other
  request had cached: the text around P shows why (a date the chat template renders, changed whitespace,
  a reply re-tokenized differently from how it was generated).

It knows token ids and, through the `describe` callable the engine passes, text; nothing about blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from kvlm.request import Request

MissReason = Literal["diverged", "evicted", "short"]
CONTEXT_TOKENS = 8  # tokens shown on each side of a divergence


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (slices compare in C; then narrow down token by token)."""
    n, i, step = min(len(a), len(b)), 0, 256
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True, slots=True)
class PrefixMiss:
    reason: MissReason
    other_request_id: str  # the earlier request sharing the longest prefix
    shared_tokens: int  # tokens in common with it
    reused_tokens: int  # tokens this request took from the cache
    possible_tokens: int  # tokens it could have taken had every block of the other request stayed cached
    position: int  # first differing token (diverged, short) or first token not found any more (evicted)
    before: str = ""  # text of the tokens before `position`
    ours: str = ""  # text of this request from `position`
    theirs: str = ""  # text of the other request from `position`
    tier: bool = False  # a disk tier was looked up too (and did not have those blocks)

    def __str__(self) -> str:
        head = f"reused {self.reused_tokens} of {self.shared_tokens} tokens shared with {self.other_request_id}: "
        if self.reason == "evicted":
            return head + (f"blocks from token {self.position} to {self.possible_tokens} were evicted "
                           "(or never cached) before this request came" + (", and the KV tier had not got them "
                                                                          "(tier miss)" if self.tier else ""))
        if self.reason == "short":
            return head + f"the shared prefix ({self.shared_tokens} tokens) is shorter than one block"
        return head + (f"diverged at token {self.position}: {self.before!r} then {self.ours!r} here "
                       f"vs {self.theirs!r} there")


class PrefixHistory:
    """The last `max_requests` requests' token ids, to explain prefix-cache misses."""

    def __init__(self, block_size: int, max_requests: int = 64,
                 describe: Callable[[list[int]], str] | None = None) -> None:
        self.block_size = block_size
        self.recent: deque[Request] = deque(maxlen=max_requests)
        self.describe = describe or (lambda ids: " ".join(map(str, ids)))
        self.tier = False  # the engine has a disk tier: an eviction miss is a tier miss too

    def explain(self, req: Request, reused: int) -> PrefixMiss | None:
        """Why `req` (just admitted, `reused` tokens from the cache) did not reuse more; None when it took
        everything an earlier request shared with it (or nothing was shared)."""
        best, shared = None, 0
        for other in self.recent:
            if other is req:
                continue
            n = common_prefix_len(req.token_ids, other.token_ids)
            if n > shared:
                best, shared = other, n
        if best is None:
            return None
        bs = self.block_size
        other_cached = len(best.token_ids) - 1  # the last token of a request never got its K/V computed
        possible = min(min(shared, other_cached) // bs * bs, (req.num_tokens - 1) // bs * bs)
        pos = shared
        if reused < possible:
            return PrefixMiss("evicted", best.request_id, shared, reused, possible, reused, tier=self.tier)
        if shared < bs and shared < req.num_tokens - 1:
            reason: MissReason = "short"
        elif shared < min(other_cached, req.num_tokens - 1):
            reason = "diverged"
        else:
            return None
        lo = max(0, pos - CONTEXT_TOKENS)
        return PrefixMiss(reason, best.request_id, shared, reused, possible, pos,
                          self.describe(req.token_ids[lo:pos]),
                          self.describe(req.token_ids[pos : pos + CONTEXT_TOKENS]),
                          self.describe(best.token_ids[pos : pos + CONTEXT_TOKENS]))

    def add(self, req: Request) -> None:
        self.recent.append(req)
