"""Per-layer cache policies: a model's layers in groups that keep K/V alike, each with its own block pool and
block manager (vLLM's hybrid KV cache manager, mlx-lm's `make_cache()`). Plain Python, no torch.

The model declares each layer's policy through `ModelConfig.layer_windows`: None (`full`: every earlier
token) or W (`sliding(W)`: a query sees its last W tokens, its own included). Group 0 holds the full
layers (all of them for a model without a pattern); each distinct W gets a group of its own, and each
group its spec (`specs`: `FullAttention`, `SlidingWindow(W)`, `kv_cache/spec.py`). A request
keeps one block table per group, over the same token positions: group 0's is `Request.block_table`,
the others' are `Request.group_tables`. A sliding group gives blocks back as the window leaves them
(`SlidingWindow.evict_upto`), so its memory follows the window, not the sequence; the entries left behind are EVICTED
and read, masked, as the pool's zero-filled null block (the attention kernel reads a window's first
chunk whole and masks the tokens before the window: they must be finite, their weight is exactly 0).

A prefix hit needs, in a sliding group, only the blocks inside the window of the first token computed:
`BlockManager.find_window_blocks` looks those up by hash and tokens, and the hit is the longest prefix
every group can serve (`Scheduler`).

To give a third model family its own policies, set `layer_types` (or another pattern that fills
`layer_windows`) in its `ModelConfig`; the groups, pools and tables follow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvlm.kv_cache.spec import FullAttention, GroupSpec, SlidingWindow
from kvlm.request import Request


@dataclass(frozen=True, slots=True)
class LayerGroups:
    """group_of[layer] -> group; windows[g] -> None (group 0, full) or the sliding window W of group g."""

    group_of: tuple[int, ...]
    windows: tuple[int | None, ...]

    @classmethod
    def of(cls, layer_windows: Sequence[int | None] | None, num_layers: int) -> LayerGroups:
        wins = list(layer_windows) if layer_windows else [None] * num_layers
        order: list[int | None] = [None] + sorted({w for w in wins if w is not None})
        return cls(tuple(order.index(w) for w in wins), tuple(order))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def layers(self, g: int) -> list[int]:
        return [i for i, x in enumerate(self.group_of) if x == g]

    @property
    def sliding(self) -> bool:
        """Whether any layer keeps only a window (then there are groups besides group 0)."""
        return self.num_groups > 1

    @property
    def chunk_cap(self) -> int | None:
        """The most rows of one request per step: a prefill chunk's K/V are all written before attention,
        so a sliding group holds window + chunk tokens of it for a moment; capping the chunk at the
        smallest window keeps a sliding pool near its window (None: no sliding group)."""
        return min(w for w in self.windows if w is not None) if self.sliding else None

    def specs(self, block_size: int) -> tuple[GroupSpec, ...]:
        """Each group's spec: group 0 full attention, group g the sliding window windows[g]."""
        return tuple(FullAttention(block_size) if w is None else SlidingWindow(block_size, w) for w in self.windows)

    def blocks_per_seq(self, g: int, block_size: int) -> int | None:
        """Blocks one running request may hold at once in group g (None: group 0, as many as it needs)."""
        return self.specs(block_size)[g].blocks_per_seq(self.chunk_cap)


def _group_entry(field: str) -> property:
    """A `GroupView` attribute: group g's entry of the request's per-group list `field`, read and written."""

    def get(view: GroupView) -> Any:
        return getattr(view.req, field)[view.g - 1]

    def put(view: GroupView, value: Any) -> None:
        getattr(view.req, field)[view.g - 1] = value

    return property(get, put)


class GroupView:
    """A request as the block manager of extra group g sees it: that group's table and counters, the
    request's tokens and hashes. (`BlockManager` reads these attributes only, so one class serves all.)"""

    __slots__ = ("req", "g")

    def __init__(self, req: Request, g: int) -> None:
        self.req, self.g = req, g

    block_table = _group_entry("group_tables")
    num_cached_blocks = _group_entry("group_cached")
    evicted_upto = _group_entry("group_evicted")

    # shared with the request
    request_id = property(lambda self: self.req.request_id)
    token_ids = property(lambda self: self.req.token_ids)
    num_tokens = property(lambda self: self.req.num_tokens)
    block_hashes = property(lambda self: self.req.block_hashes)
    num_computed_tokens = property(lambda self: self.req.num_computed_tokens)
    # A bounded request's: its sinks stay listed (their block, never read: outside the window), and a
    # sliding group registers nothing of it once it evicts (K/V computed under the policy are its own).
    kv_policy = property(lambda self: self.req.kv_policy)
    lora = property(lambda self: self.req.lora)  # the hash chain's root (`BlockManager.block_hashes`)

    def reset_bounded_state(self) -> None:
        self.evicted_upto = 0
