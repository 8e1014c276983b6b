"""Block manager: which KV-cache blocks are free and which request holds which (plain Python, no torch).

The cache is a pool of `num_blocks` blocks of `block_size` token slots. A request's `block_table` lists
its blocks in order; token i of the request lives in slot `block_table[i // block_size] * block_size +
i % block_size`. Invariants (checked by `check()` and the tests):
  * every block is either on the free list (ref count 0) or referenced by >= 1 block table;
  * free + used == num_blocks; ref counts are never negative;
  * a freed (finished, aborted or preempted) request holds no blocks.
"""

from __future__ import annotations

from collections import deque

from kvlm.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts: list[int] = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, req: Request, num_tokens: int) -> bool:
        """Could `req` hold slots for its first `num_tokens` tokens with the blocks free now?"""
        return self.blocks_for(num_tokens) - len(req.block_table) <= len(self.free_blocks)

    def allocate(self, req: Request, num_tokens: int) -> None:
        """Grow `req.block_table` to cover `num_tokens` tokens. Call `can_allocate` first."""
        need = self.blocks_for(num_tokens) - len(req.block_table)
        if need > len(self.free_blocks):
            raise RuntimeError(f"out of KV blocks: need {need}, have {len(self.free_blocks)}")
        for _ in range(need):
            b = self.free_blocks.popleft()
            self.ref_counts[b] = 1
            req.block_table.append(b)

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Release the blocks beyond those needed for the first `num_tokens` tokens."""
        keep = self.blocks_for(num_tokens)
        while len(req.block_table) > keep:
            self._release(req.block_table.pop())

    def free(self, req: Request) -> None:
        """Return every block of `req` (finished, aborted or preempted)."""
        for b in reversed(req.block_table):
            self._release(b)
        req.block_table.clear()

    def _release(self, b: int) -> None:
        self.ref_counts[b] -= 1
        assert self.ref_counts[b] >= 0, f"block {b} released twice"
        if self.ref_counts[b] == 0:
            self.free_blocks.append(b)

    def check(self, requests: list[Request] = ()) -> None:  # type: ignore[assignment]
        """Assert the invariants; `requests` are all requests that may hold blocks."""
        free = set(self.free_blocks)
        assert len(free) == len(self.free_blocks), "a block is on the free list twice"
        counts = [0] * self.num_blocks
        for r in requests:
            for b in r.block_table:
                counts[b] += 1
        for b in range(self.num_blocks):
            assert self.ref_counts[b] >= 0
            assert self.ref_counts[b] == counts[b], f"block {b}: ref count {self.ref_counts[b]} != {counts[b]} holders"
            assert (b in free) == (counts[b] == 0), f"block {b} free-list state disagrees with its holders"
        assert len(free) + sum(1 for c in counts if c) == self.num_blocks
