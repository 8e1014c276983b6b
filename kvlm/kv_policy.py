"""Bounded KV caches: attention sinks plus a recent window, for chats and generations that run past the
model's context with flat memory (StreamingLLM, arXiv:2309.17453). Plain Python, no torch.

A request with `BoundedKV(max_tokens=N, sink_tokens=S)` keeps the K/V of its first S tokens (the
"sinks", rounded up to whole blocks: `num_sinks`) and of its most recent tokens, at most N in all.
Blocks between them go back to the pool, whole blocks at a time. Which tokens row p (the token at
position p) attends is a function of p alone, so every path that computes row p computes the same:

    p < N:   tokens 0 .. p (nothing evicted yet: the same K/V as an unbounded cache)
    p >= N:  the sinks 0 .. num_sinks - 1, then tokens kept_start(p) .. p, where
             kept_start(p) = block_size * ceil((p + 1 - window) / block_size), window = N - num_sinks

so it attends between N - block_size + 1 and N tokens. The rows of one step of one request share
`kept_start` (`chunk_limit` cuts a prompt chunk where it changes), so one block table serves them.

Positions. Attention reads the kept tokens as one sequence: [sinks | kept_start .. p] (the runner's
*virtual* block table). RoPE is relative, so what the model must see consistently is each key's distance
to the query. Queries and kept keys keep their absolute positions (rows past the RoPE table get their
angles computed in float64, `model.llama.rope_rows`); the sinks' keys are re-rotated, at each eviction,
from their original values to sit just before the kept tokens: sink i at kept_start(p) - num_sinks + i.
The model then sees the contiguous geometry of [sinks + kept] recomputed from position 0, for the cost
of rotating num_sinks keys per block of tokens (re-rotating the kept window instead would rotate
`window` keys per eviction and, on an int8/int4 cache, requantize each kept key again every time).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kvlm.errors import ParameterError


@dataclass(frozen=True, slots=True)
class BoundedKV:
    """The cache policy `sinks(sink_tokens) + window(max_tokens - sinks)` of one request: the spec its
    blocks follow in a full layer group (`kv_cache.spec`: `sink_blocks`, `evict_upto`, `block_name`)."""

    max_tokens: int  # N: the most tokens whose K/V are kept (and attended)
    sink_tokens: int  # S: leading tokens always kept (rounded up to whole blocks)
    block_size: int

    @classmethod
    def make(cls, max_tokens: int, sink_tokens: int, block_size: int, max_model_len: int) -> BoundedKV:
        """Validated: N a multiple of the block size, room for two blocks of window past the sinks, and
        N no larger than the model's context (the distances the model sees stay within it)."""
        def bad(name: str, rule: str) -> ParameterError:
            return ParameterError(name, f"{name} {rule}")

        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise bad("max_kv_tokens", f"must be a positive integer, got {max_tokens!r}")
        if not isinstance(sink_tokens, int) or isinstance(sink_tokens, bool) or sink_tokens < 0:
            raise bad("sink_tokens", f"must be an integer >= 0, got {sink_tokens!r}")
        if max_tokens % block_size:
            raise bad("max_kv_tokens", f"must be a multiple of the block size {block_size}, got {max_tokens}")
        if max_tokens > max_model_len:
            raise bad("max_kv_tokens", f"must be at most the context length {max_model_len}, got {max_tokens}")
        policy = cls(max_tokens, sink_tokens, block_size)
        if policy.window < 2 * block_size:
            raise bad("max_kv_tokens", f"must leave at least {2 * block_size} tokens of window after "
                      f"{policy.num_sinks} sink tokens, got {max_tokens}")
        return policy

    @property
    def sink_blocks(self) -> int:
        return -(-self.sink_tokens // self.block_size)

    @property
    def num_sinks(self) -> int:
        """Sink tokens actually kept: `sink_tokens` rounded up to whole blocks."""
        return self.sink_blocks * self.block_size

    @property
    def window(self) -> int:
        """The most recent tokens kept besides the sinks."""
        return self.max_tokens - self.num_sinks

    def kept_start(self, p: int) -> int:
        """The first non-sink token row p attends; 0 while nothing is evicted (p < max_tokens)."""
        if p < self.max_tokens:
            return 0
        bs = self.block_size
        return bs * -(-(p + 1 - self.window) // bs)

    def attended(self, p: int) -> int:
        """How many tokens row p attends."""
        f = self.kept_start(p)
        return p + 1 if f == 0 else self.num_sinks + p + 1 - f

    def ctx_shift(self, p: int) -> int:
        """Row p's position minus its index in the virtual sequence [sinks | kept] (0: none evicted)."""
        f = self.kept_start(p)
        return 0 if f == 0 else f - self.num_sinks

    def chunk_limit(self, start: int, n: int) -> int:
        """At most n rows from `start` whose `kept_start` is the same (one block table serves a step)."""
        end, f = start + n, self.kept_start(start)
        if end <= self.max_tokens or n <= 1:
            return n
        if f == 0:
            return self.max_tokens - start  # up to the first eviction
        # kept_start changes when p + 1 - window passes a multiple of the block size
        nxt = f + self.window  # the first p with a larger kept_start
        return min(n, nxt - start)

    def evict_upto(self, p: int) -> int:
        """Blocks [sink_blocks, evict_upto(p)) of the block table hold no token row p attends."""
        return self.kept_start(p) // self.block_size

    def hit_start(self, num_blocks: int) -> int:
        """Of a cached prefix of `num_blocks` blocks, the first block past the sinks that the next row reads."""
        return self.evict_upto(num_blocks * self.block_size)

    def virtual_table(self, table: list[int], p: int) -> list[int]:
        """The blocks row p reads, in the order attention reads them (the sinks, then the kept ones)."""
        f = self.kept_start(p)
        if f == 0:
            return table
        return table[: self.sink_blocks] + table[f // self.block_size :]

    @property
    def registrable_blocks(self) -> int:
        """Leading blocks computed exactly as an unbounded cache computes them (wholly before the first
        eviction): named by their prefix hash alone."""
        return self.max_tokens // self.block_size

    def block_name(self, i: int, prefix_hash: bytes) -> bytes:
        """Block i's prefix-cache name (the `kv_cache.spec.AttentionSpec` this policy is)."""
        return prefix_hash if i < self.registrable_blocks else self.block_hash(prefix_hash)

    def block_hash(self, prefix_hash: bytes) -> bytes:
        """The prefix-cache name of a block computed after the first eviction: its prefix hash keyed by the
        policy (its K/V depend on what the policy kept, so only a request with the same policy may reuse it)."""
        return hashlib.sha256(b"kvlm-bounded\0%d,%d,%d\0" % (self.max_tokens, self.num_sinks, self.block_size)
                              + prefix_hash).digest()

    def describe(self) -> str:
        rounded = f" ({self.sink_tokens} rounded up to whole blocks)" if self.num_sinks != self.sink_tokens else ""
        return f"sinks({self.num_sinks}){rounded} + window({self.window})"
