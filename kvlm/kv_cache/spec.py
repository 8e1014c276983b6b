"""Cache specs: what each layer group's KV cache keeps, and how a token's K/V are stored, as small frozen
values the block managers, the storage and the byte accounting act on (vLLM v1's `KVCacheSpec` and
`KVCacheConfig`, and its one manager per attention type). Plain Python, no torch.

Attention specs (one per layer group; each group has its own block manager, `BlockManager.spec`):

* `FullAttention`: a query sees every earlier token; a request's blocks grow with it.
* `SlidingWindow(W)`: a query sees its last W tokens, its own included; the blocks the window has left go
  back to the pool (`evict_upto`), so a running request holds at most `blocks_per_seq` of them.
* sinks(S) + window(W), a request's bounded cache: `kv_policy.BoundedKV`, which lives with the request
  (it is chosen per request) and which a full group acts for that request (`FullAttention.for_request`).
  A sliding group keeps evicting by its own window, but lists the request's sinks and names its blocks
  as the policy does (`SlidingWindow.for_request`).

Each answers the block manager's questions: which leading blocks are always kept (`sink_blocks`), which
blocks row p and every later row no longer read (`evict_upto`), which blocks of a cached prefix a
request needs (`hit_start`: what the first token computed after it attends), and under which name a
full block is registered in the prefix cache (`block_name`: its prefix hash, keyed by the policy past
`registrable_blocks`, where its K/V depend on what the policy kept).

`KVFormat` is how a token's K/V are stored in every layer: the element type (float32 / float16 / bfloat16,
or a quantized int8 / int4 format with its scales) and, for the quantized ones, the key centers (mu per
layer and the position-0 key k0, `kv_cache/k_center.py`). `KVCacheConfig` ties them together: the format,
the block size and shape, and per layer group its spec, its layers and its block count. It is built once
per engine (`pool.kv_cache_config`, from the model config and the engine args); the storage
(`PagedKVCache`) and `KVBytes` read it.

Adding a cache policy: write a frozen dataclass with the methods of `FullAttention` (the `AttentionSpec`
protocol, plus `for_request`, `blocks_per_seq`, `tokens_held` and `window`), have `LayerGroups.specs`
give it to the layers the model declares for it (`ModelConfig.layer_windows` or a new field), and test
it in tests/kv_cache/test_spec.py; the managers, the pool's sizing, `kvlm kv-size` and the snapshots
follow. A policy that rewrites cached K/V (as the bounded cache re-rotates its sinks) also yields the
step's block copies through `KVCacheManager.allocate` (`StepKV`), which the storage applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvlm.kv_policy import BoundedKV

UNBOUNDED = 1 << 62  # `registrable_blocks` of a policy whose every block any request computes alike


class AttentionSpec(Protocol):
    """What a block manager asks of the policy one request's blocks follow in one layer group."""

    block_size: int

    @property
    def sink_blocks(self) -> int:
        """Leading blocks kept whatever the window (0 but for a bounded cache's sinks)."""
        ...

    @property
    def registrable_blocks(self) -> int:
        """Leading blocks whose K/V any request computes alike: named by their prefix hash alone."""
        ...

    def evict_upto(self, p: int) -> int:
        """Blocks [sink_blocks, evict_upto(p)) hold no token that row p, or any later row, attends."""
        ...

    def hit_start(self, num_blocks: int) -> int:
        """The prefix-hit rule: of a cached prefix of `num_blocks` blocks, a request needs the blocks from
        hit_start on (besides its sinks): what the first token computed after it attends."""
        ...

    def block_name(self, i: int, prefix_hash: bytes) -> bytes:
        """The prefix-cache name of block i, whose prefix hash is `prefix_hash`."""
        ...

    def attended(self, p: int) -> int:
        """How many tokens row p attends."""
        ...


@dataclass(frozen=True, slots=True)
class FullAttention:
    """Every earlier token is attended: nothing is evicted, every block is named by its prefix."""

    block_size: int

    window = None  # no window (a class constant, not a field)
    sink_blocks = 0
    registrable_blocks = UNBOUNDED

    def evict_upto(self, p: int) -> int:
        return 0

    def hit_start(self, num_blocks: int) -> int:
        return 0

    def block_name(self, i: int, prefix_hash: bytes) -> bytes:
        return prefix_hash

    def attended(self, p: int) -> int:
        """How many tokens row p attends."""
        return p + 1

    def for_request(self, policy: BoundedKV | None) -> AttentionSpec:
        """The spec a request's blocks follow here: its bounded cache's policy if it has one."""
        return self if policy is None else policy

    def blocks_per_seq(self, chunk_cap: int | None) -> int | None:
        """Blocks one running request may hold at once (None: as many as its tokens need)."""
        return None

    def tokens_held(self, context: int) -> int:
        """Tokens of a `context`-token sequence whose K/V this group holds (`kvlm kv-size`)."""
        return context


@dataclass(frozen=True, slots=True)
class SlidingWindow:
    """A query attends its last `window` tokens. `bounded`: the bounded cache of the request this spec
    was made for (`for_request`), whose sinks stay listed (their blocks never read: outside the window)
    and whose blocks past its first eviction are named by its policy (their K/V are its own)."""

    block_size: int
    window: int
    bounded: BoundedKV | None = None

    @property
    def sink_blocks(self) -> int:
        return 0 if self.bounded is None else self.bounded.sink_blocks

    @property
    def registrable_blocks(self) -> int:
        return UNBOUNDED if self.bounded is None else self.bounded.registrable_blocks

    def evict_upto(self, p: int) -> int:
        return max(0, p - self.window + 1) // self.block_size

    def hit_start(self, num_blocks: int) -> int:
        return self.evict_upto(num_blocks * self.block_size)

    def block_name(self, i: int, prefix_hash: bytes) -> bytes:
        return prefix_hash if self.bounded is None else self.bounded.block_name(i, prefix_hash)

    def attended(self, p: int) -> int:
        n = min(p + 1, self.window)
        return n if self.bounded is None else min(n, self.bounded.attended(p))

    def for_request(self, policy: BoundedKV | None) -> AttentionSpec:
        # (the constructor, not dataclasses.replace: this runs for every block operation of such a request)
        return self if policy is None else SlidingWindow(self.block_size, self.window, policy)

    def blocks_per_seq(self, chunk_cap: int | None) -> int | None:
        """Window + a chunk (at most `chunk_cap` rows) + the block being filled and the one the window
        starts in: a prefill chunk's K/V are all written before attention reads them."""
        cap = self.window if chunk_cap is None else chunk_cap
        return -(-(self.window + cap) // self.block_size) + 2

    def tokens_held(self, context: int) -> int:
        return min(context, self.window)


GroupSpec = FullAttention | SlidingWindow  # what a layer group's spec is (a request may refine it: for_request)


@dataclass(frozen=True, slots=True)
class KVFormat:
    """How one token's K/V are stored in a layer: `name` (`--kv-cache-dtype`'s), `bytes_per_value` (codes
    and scales of a quantized format), `element` (the torch dtype or the `KVQuantFormat`, which the
    storage encodes to) and `center` (a `KeyCenter`: keys stored minus mu, the position-0 key minus k0;
    None: uncentered, every float format)."""

    name: str
    bytes_per_value: float
    element: Any = field(compare=False)  # storage.KVElement (a torch type: kept opaque here)
    center: Any = field(default=None, compare=False)  # kernels.kv_quant.KeyCenter | None

    @property
    def centered(self) -> bool:
        return self.center is not None

    @property
    def has_k0(self) -> bool:
        """Whether position-0 keys are stored against their own center k0."""
        return self.center is not None and self.center.k0 is not None

    def token_bytes(self, kv_heads: int, head_dim: int) -> float:
        """K and V bytes of one token in one layer."""
        return 2 * kv_heads * head_dim * self.bytes_per_value


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """One layer group of a cache: its spec, its layers and the blocks of its pool."""

    spec: GroupSpec
    layers: tuple[int, ...]
    num_blocks: int


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """A whole cache: its format and shape, and per layer group (group 0 first: the full layers, whose block
    table is `Request.block_table`) the spec it keeps K/V by. A contiguous cache is one full group whose
    block is a sequence's whole row."""

    format: KVFormat
    block_size: int
    kv_heads: int
    head_dim: int
    groups: tuple[KVCacheGroup, ...]

    @classmethod
    def full(cls, fmt: KVFormat, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
             head_dim: int) -> KVCacheConfig:
        """One group of full-attention layers (every model without sliding layers; a contiguous cache with
        block_size = a sequence's whole row and num_blocks = its rows)."""
        return cls(fmt, block_size, kv_heads, head_dim,
                   (KVCacheGroup(FullAttention(block_size), tuple(range(num_layers)), num_blocks),))

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    @property
    def group_of(self) -> tuple[int, ...]:
        """group_of[layer] -> its group."""
        out = [0] * self.num_layers
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                out[layer] = g
        return tuple(out)

    @property
    def num_blocks(self) -> int:
        """Group 0's blocks (the pool a request's prompt must fit in)."""
        return self.groups[0].num_blocks

    def page_size_bytes(self, g: int) -> float:
        """Bytes of one block of group g over all its layers, by the format's formula."""
        return self.format.token_bytes(self.kv_heads, self.head_dim) * self.block_size * len(self.groups[g].layers)
