"""Block manager: which KV-cache blocks are free, which request reads which, and which full blocks are
cached by content for other requests to reuse (plain Python, no torch).

The cache is a pool of `num_blocks` blocks of `block_size` token slots. A request's `block_table` lists
its blocks in order; token i of the request lives in slot `block_table[i // block_size] * block_size +
i % block_size`.

Prefix caching (`enable_prefix_caching=True`; the engine turns it on for the paged layout). A *full*
block is named by a hash chained over its parent block's hash and its own token ids; the chain starts
from a root hash over everything else that changes K/V (model, dtype, KV layout, block size), so a
block's hash stands for the whole prefix up to its last token. `hash_to_block` maps hashes to cached
blocks. A hash is only an index: a lookup is accepted only if the block's stored token ids equal the
request's and its stored parent is the block just matched (block id and registration generation), so a
colliding (or forged) hash can never hand out another prefix's K/V.

Life cycle of a block:

    free (ref 0, no hash) --allocate--> used (ref >= 1) --release to ref 0--> free, or cached-free
    cached-free (ref 0, hash kept, LRU) --a prefix hit--> used again (ref += 1, no recompute)
    cached-free --the pool needs a block and no plain free block is left--> evicted: hash forgotten

Only full blocks get a hash, and a request only ever writes into blocks past its cached prefix, so no
request writes into a block another one reads.

Bounded caches (`kv_policy.BoundedKV`: sinks + window). `evict` releases a request's blocks that its
window has left, leaving EVICTED (-1) in their place so block i still holds tokens i * block_size ..;
`make_private` swaps a block for a private copy (the sinks, before their keys are re-rotated in place).
Blocks wholly before the first eviction (tokens < max_tokens, computed exactly as an unbounded cache
computes them) are registered under their prefix hash; later ones under that hash keyed by the policy
(`BoundedKV.block_name`), for requests with the same policy only. Row p of such a request attends the sinks
and tokens kept_start(p) .. p, a function of p and the tokens alone, so a hit of k blocks past the first
eviction needs only what row k * block_size attends: the sink blocks and the blocks from kept_start(k *
block_size) on (`extend_hit`): the next turn of an endless chat, or a preempted bounded request
coming back, reuses the blocks its window kept.

Invariants (checked by `check()` and the tests):
  * ref counts are never negative and equal the number of block tables holding the block;
  * free + cached-free + used == num_blocks, each block in exactly one of the three;
  * a hash maps to at most one block and a cached block's hash maps back to it;
  * a freed (finished, aborted or preempted) request holds no blocks;
  * debug mode (`enable_debug()`): no block is released by, or handed out while, a request reads it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from kvlm.kv_cache.spec import AttentionSpec, FullAttention, GroupSpec
from kvlm.request import Request

Parent = tuple[int, int]  # (block id, its registration generation)
EVICTED = -1  # a block_table entry whose block a bounded cache gave back


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """sha256(parent hash || token ids as int64): the name of a full block's whole prefix."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


def lora_root(root_hash: bytes, lora_key: str) -> bytes:
    """The hash chain's root for requests under the LoRA adapter named by `lora_key` (its content digest):
    K/V computed under an adapter differ from the base's, so its blocks are named apart."""
    return hashlib.sha256(root_hash + b"lora\0" + lora_key.encode()).digest()


def prefix_block_hashes(root_hash: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chain of hashes of `token_ids`' full blocks, starting from `root_hash` (a pool's `root_hash`)."""
    out: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        out.append(hash_block(out[-1] if out else root_hash, token_ids[i * block_size : (i + 1) * block_size]))
    return out

def held_blocks(req: Request) -> list[int]:
    """The blocks `req`'s table still holds, without scanning its EVICTED run: past the first few (sinks)
    every entry before `evicted_upto` is EVICTED and none after it, so an endless request costs O(window)."""
    s = req.kv_policy.sink_blocks if req.kv_policy is not None else 0
    t = req.block_table
    return [b for b in t[:s] if b != EVICTED] + t[max(s, req.evicted_upto) :]


class BlockManager:
    """The blocks of one layer group's pool, handed out and cached by the group's `spec` (`kv_cache/spec.py`:
    full attention unless told otherwise; a request refines it with its bounded cache, `spec_for`)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 spec: GroupSpec | None = None) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.spec: GroupSpec = spec or FullAttention(block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self.free_blocks: deque[int] = deque(range(num_blocks))  # ref 0 and no hash: handed out first
        # ref 0 but still holding a cached prefix; oldest first, so eviction pops from the front.
        self.cached_free: OrderedDict[int, None] = OrderedDict()
        self.ref_counts: list[int] = [0] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.block_parent: list[Parent | None] = [None] * num_blocks
        self.generation: list[int] = [0] * num_blocks  # bumped whenever a block's hash is forgotten
        self.root_hash = hashlib.sha256(b"kvlm-prefix").digest()
        self.readers: list[set[str]] | None = None  # debug mode: request ids reading each block
        self.num_evictions = 0
        # Called with a cached-free block about to be evicted, its hash and K/V still intact (the KV tier
        # keeps it on disk: kv_cache/tier_pool.py); None: evicted blocks are simply forgotten.
        self.on_evict: Callable[[int], None] | None = None
        self.num_freed = 0  # blocks whose last reader let go (to free or cached-free), since the start

    # -- counts ------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: plain free plus cached-free (evicted on demand)."""
        return len(self.free_blocks) + len(self.cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose content is registered (used or cached-free)."""
        return len(self.hash_to_block)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def spec_for(self, req: Request) -> AttentionSpec:
        """The spec `req`'s blocks follow here: the group's, refined by the request's bounded cache."""
        return self.spec.for_request(req.kv_policy)

    # -- hashing -----------------------------------------------------------------------------------
    def set_extra_keys(self, extra: str) -> None:
        """Start the hash chain from `extra` (model identity, dtype, KV layout, block size). Call before
        any block is cached: hashes made from another root would no longer be found."""
        assert not self.hash_to_block, "the hash root must be set before anything is cached"
        self.root_hash = hashlib.sha256(b"kvlm-prefix\0" + extra.encode()).digest()

    def hash_block(self, parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
        """sha256(parent hash || token ids as int64): the name of a full block's whole prefix."""
        return hash_block(parent_hash, token_ids)

    def prompt_block_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """The hashes the prompt's full blocks would have here (what a router compares with a replica's)."""
        return prefix_block_hashes(self.root_hash, token_ids, self.block_size)

    def block_hashes(self, req: Request, num_full: int) -> list[bytes]:
        """`req.block_hashes` extended to its first `num_full` full blocks (token ids never change once
        written, so hashes are computed once per block)."""
        hs, bs = req.block_hashes, self.block_size
        root = self.root_hash if req.lora is None else lora_root(self.root_hash, req.lora.key)
        while len(hs) < num_full:
            i = len(hs)
            hs.append(self.hash_block(hs[-1] if hs else root, req.token_ids[i * bs : (i + 1) * bs]))
        return hs

    def _matches(self, b: int, tokens: tuple[int, ...], parent: Parent | None) -> bool:
        return self.block_tokens[b] == tokens and self.block_parent[b] == parent

    def _parent(self, table: list[int], i: int) -> Parent | None:
        return None if i == 0 or table[i - 1] == EVICTED else (table[i - 1], self.generation[table[i - 1]])

    # -- prefix lookup -----------------------------------------------------------------------------
    def find_cached_prefix(self, req: Request, max_blocks: int | None = None) -> list[int]:
        """The longest run of cached blocks equal to `req`'s leading full blocks (none taken yet).

        By default at most `(num_tokens - 1) // block_size` blocks: the last token always runs, so the
        request has logits to sample from."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        limit = (req.num_tokens - 1) // bs if max_blocks is None else min(max_blocks, req.num_tokens // bs)
        limit = min(limit, self.spec_for(req).registrable_blocks)
        hashes = self.block_hashes(req, limit)
        hit: list[int] = []
        for i in range(limit):
            b = self.hash_to_block.get(hashes[i])
            parent = None if i == 0 else (hit[-1], self.generation[hit[-1]])
            if b is None or not self._matches(b, tuple(req.token_ids[i * bs : (i + 1) * bs]), parent):
                break
            hit.append(b)
        return hit

    def find_window_blocks(self, req: Request, num_blocks: int, first: int) -> list[int] | None:
        """A sliding group's part of a prefix hit of `num_blocks` blocks: its cached blocks [first,
        num_blocks) (those inside the window of the first token computed after the hit), or None if one
        is missing. The first is matched by hash and tokens (its predecessor is gone by design), each
        later one by hash, tokens and parent, as `find_cached_prefix` matches them."""
        if not self.enable_prefix_caching:
            return None if num_blocks else []
        bs, hashes = self.block_size, self.block_hashes(req, num_blocks)
        out: list[int] = []
        for i in range(first, num_blocks):
            b = self.hash_to_block.get(self.hash_at(req, hashes, i))
            tokens = tuple(req.token_ids[i * bs : (i + 1) * bs])
            parent = (out[-1], self.generation[out[-1]]) if out else None
            if b is None or self.block_tokens[b] != tokens or (out and self.block_parent[b] != parent):
                return None
            out.append(b)
        return out

    def extend_hit(self, req: Request, hit: list[int]) -> list[int]:
        """`hit` (from `find_cached_prefix`, at most the blocks named by their prefix alone) extended as far
        as the cache holds what `req`'s spec keeps past them (a bounded cache: its sinks and kept window):
        sink blocks, EVICTED entries, then the window's blocks. Unchanged when every block of `req` is
        named by its prefix (no bounded cache) or nothing past them is cached."""
        spec, bs = self.spec_for(req), self.block_size
        sinks = spec.sink_blocks
        if not self.enable_prefix_caching or len(hit) < sinks:
            return hit
        for k in range((req.num_tokens - 1) // bs, spec.registrable_blocks, -1):  # the last token always runs
            first = spec.hit_start(k)
            found = self.find_window_blocks(req, k, first)
            if found is not None:
                return hit[:sinks] + [EVICTED] * (first - sinks) + found
        return hit

    # -- allocation --------------------------------------------------------------------------------
    def can_allocate(self, req: Request, num_tokens: int, cached: Sequence[int] = (), extra: int = 0,
                     skip: int = 0) -> bool:
        """Could `req` hold slots for its first `num_tokens` tokens (taking the `cached` prefix blocks
        first, after `skip` entries a sliding group needs no more), and `extra` more blocks (private
        copies), with the blocks free now?"""
        need = self.blocks_for(num_tokens) - len(req.block_table) - skip - len(cached) + extra
        revived = sum(1 for b in cached if b != EVICTED and self.ref_counts[b] == 0)  # leave the cached-free pool
        return need <= self.num_free_blocks - revived

    def allocate(self, req: Request, num_tokens: int, cached: Sequence[int] = (), skip: int = 0) -> None:
        """Grow `req.block_table` to cover `num_tokens` tokens: first `skip` EVICTED entries (a sliding
        group's blocks before the window of a prefix hit), then the `cached` prefix blocks (shared, from
        `find_cached_prefix` / `find_window_blocks`), then fresh ones. Call `can_allocate` first."""
        if not self.can_allocate(req, num_tokens, cached, skip=skip):
            need = self.blocks_for(num_tokens) - len(req.block_table) - skip - len(cached)
            raise RuntimeError(f"out of KV blocks: need {need}, have {self.num_free_blocks}")
        assert not (cached or skip) or not req.block_table, "a cached prefix is taken at admission only"
        if skip:
            req.block_table.extend([EVICTED] * skip)
            req.evicted_upto = skip
        for b in cached:  # (a bounded request's hit past its first eviction holds EVICTED entries)
            if b != EVICTED:
                self._take(b, req)
            req.block_table.append(b)
        req.num_cached_blocks = max(req.num_cached_blocks, skip + len(cached))
        for _ in range(self.blocks_for(num_tokens) - len(req.block_table)):
            b = self._pop_free()
            self._take(b, req)
            req.block_table.append(b)

    def hash_at(self, req: Request, hashes: list[bytes], i: int) -> bytes:
        """The name block i of `req` is registered under (its spec's `block_name`; see the module
        docstring, bounded caches)."""
        return self.spec_for(req).block_name(i, hashes[i])

    def evict(self, req: Request, p: int) -> int:
        """Give back `req`'s blocks that row p and every later row no longer read: [sink_blocks, upto) of
        its table, upto its spec's `evict_upto(p)` (a bounded cache's window moved on, or a sliding layer
        group's); returns how many were given back now."""
        spec = self.spec_for(req)
        upto = spec.evict_upto(p)
        if upto <= req.evicted_upto:
            return 0  # nothing new (full attention never evicts)
        start = max(req.evicted_upto, spec.sink_blocks)
        n, own = 0, spec.registrable_blocks
        for i in range(start, min(upto, len(req.block_table))):
            b = req.block_table[i]
            self._release(b, req)
            req.block_table[i] = EVICTED
            n += 1
            if i >= own and b in self.cached_free:
                # A block only this policy's requests can reuse, and only with the window it left: free it
                # outright, so the next allocation takes this warm block, not an untouched page (RSS stays flat).
                del self.cached_free[b]
                self._forget(b)
                self.free_blocks.appendleft(b)
        req.evicted_upto = max(req.evicted_upto, upto)
        return n

    def make_private(self, req: Request, i: int) -> tuple[int, int]:
        """Swap block i of `req` for a fresh block only it holds (call `can_allocate`-style room check
        first: one free block). Returns (old, new): the caller copies old's K/V into new before the old
        one is overwritten (it may be handed out in this same step)."""
        old = req.block_table[i]
        new = self._pop_free()
        self._take(new, req)
        req.block_table[i] = new
        self._release(old, req)
        return old, new

    def _take(self, b: int, req: Request) -> None:
        if self.ref_counts[b] == 0:
            self.cached_free.pop(b, None)
        self.ref_counts[b] += 1
        if self.readers is not None:
            assert req.request_id not in self.readers[b], f"block {b} taken twice by {req.request_id}"
            self.readers[b].add(req.request_id)

    def _pop_free(self) -> int:
        """A block to overwrite: a plain free one, else the least recently freed cached one (evicted)."""
        if self.free_blocks:
            b = self.free_blocks.popleft()
        else:
            b, _ = self.cached_free.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(b)
            self._forget(b)
            self.num_evictions += 1
        if self.readers is not None:
            assert not self.readers[b] and self.ref_counts[b] == 0, f"block {b} handed out while read"
        return b

    def _forget(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None and self.hash_to_block.get(h) == b:
            del self.hash_to_block[h]
        self.block_hash[b] = self.block_tokens[b] = self.block_parent[b] = None
        self.generation[b] += 1

    # -- caching computed blocks -------------------------------------------------------------------
    def cache_full_blocks(self, req: Request) -> None:
        """Register `req`'s blocks that are now full of computed tokens (after each step), in order.

        A block whose content is already cached under another id (two requests computed the same prefix
        in the same step) is swapped for the cached one and its own copy freed, so one hash names one
        block. A stale cached-free block under the same hash (a collision, or an orphan whose parent was
        evicted) is evicted for ours; a colliding block that someone reads stops registration here."""
        if not self.enable_prefix_caching:
            return
        bs, table = self.block_size, req.block_table
        num_full = min(req.num_computed_tokens // bs, len(table))
        if num_full <= req.num_cached_blocks:
            return
        hashes = self.block_hashes(req, num_full)
        for i in range(req.num_cached_blocks, num_full):
            h, mine = self.hash_at(req, hashes, i), table[i]
            if mine == EVICTED:
                break  # (registration fell behind a bounded cache's window: those blocks are gone)
            tokens = tuple(req.token_ids[i * bs : (i + 1) * bs])
            parent = self._parent(table, i)
            other = self.hash_to_block.get(h)
            if other == mine:
                pass
            elif other is not None and self._matches(other, tokens, parent):
                self._take(other, req)  # same K/V already cached: share it, free our copy
                table[i] = other
                self._release(mine, req)
            else:
                if other is not None:
                    if self.ref_counts[other]:
                        break  # a genuine collision with a block in use: leave the rest uncached
                    del self.cached_free[other]
                    self._forget(other)
                    self.free_blocks.append(other)
                self.hash_to_block[h] = mine
                self.block_hash[mine], self.block_tokens[mine], self.block_parent[mine] = h, tokens, parent
            req.num_cached_blocks = i + 1

    def reset_prefix_cache(self) -> int:
        """Forget every cached-free block (used blocks keep their hashes); returns how many."""
        n = len(self.cached_free)
        while self.cached_free:
            b, _ = self.cached_free.popitem(last=False)
            self._forget(b)
            self.free_blocks.append(b)
        return n

    # -- release -----------------------------------------------------------------------------------
    def free(self, req: Request) -> None:
        """Return every block of `req` (finished, aborted or preempted). The tail goes first, so a cached
        prefix's last blocks are evicted before its first ones (which more requests share)."""
        for b in reversed(req.block_table):
            if b != EVICTED:
                self._release(b, req)
        req.block_table.clear()
        req.num_cached_blocks = 0
        req.reset_bounded_state()

    def free_tail(self, req: Request, keep: int) -> None:
        """Return `req`'s blocks after its first `keep` (tail first), which hold no registered token."""
        assert keep >= req.num_cached_blocks, "a registered block is never given back alone"
        while len(req.block_table) > keep:
            b = req.block_table.pop()
            if b != EVICTED:
                self._release(b, req)

    def _release(self, b: int, req: Request) -> None:
        self.ref_counts[b] -= 1
        assert self.ref_counts[b] >= 0, f"block {b} released twice"
        if self.readers is not None:
            assert req.request_id in self.readers[b], f"block {b} released by {req.request_id}, which does not read it"
            self.readers[b].discard(req.request_id)
            assert bool(self.readers[b]) == (self.ref_counts[b] > 0), f"block {b} freed while read"
        if self.ref_counts[b] == 0:
            self.num_freed += 1
            if self.block_hash[b] is not None:
                self.cached_free[b] = None  # most recently freed: evicted last
            else:
                self.free_blocks.appendleft(b)  # reused first: its pages are resident already

    # -- checks ------------------------------------------------------------------------------------
    def enable_debug(self) -> None:
        """Track which request reads each block and assert on every release and hand-out that no block is
        freed or overwritten while read. Call before any block is used."""
        assert self.num_used_blocks == 0, "enable debug mode on an idle pool"
        self.readers = [set() for _ in range(self.num_blocks)]

    def assert_writable(self, req: Request, start: int, end: int) -> None:
        """Debug check before a step: `req` reads all its blocks, and the blocks it writes (token
        positions [start, end)) are neither shared nor cached."""
        bs = self.block_size
        for b in req.block_table:
            if b == EVICTED:
                continue
            assert self.ref_counts[b] > 0, f"{req.request_id} reads free block {b}"
            if self.readers is not None:
                assert req.request_id in self.readers[b], f"{req.request_id} reads block {b} it does not hold"
        for i in range(start // bs, self.blocks_for(end)):
            b = req.block_table[i]
            assert self.ref_counts[b] == 1 and self.block_hash[b] is None, \
                f"{req.request_id} would write into shared or cached block {b}"

    def check(self, requests: Sequence[Request] = ()) -> None:
        """Assert the invariants; `requests` are all requests that may hold blocks."""
        free, cached = set(self.free_blocks), set(self.cached_free)
        assert len(free) == len(self.free_blocks), "a block is on the free list twice"
        assert not free & cached, "a block is both free and cached-free"
        counts = [0] * self.num_blocks
        for r in requests:
            held = [b for b in r.block_table if b != EVICTED]
            assert held_blocks(r) == held, f"{r.request_id}: an EVICTED entry outside its evicted run"
            assert len(set(held)) == len(held), f"{r.request_id} holds a block twice"
            for b in held:
                counts[b] += 1
        for b in range(self.num_blocks):
            assert self.ref_counts[b] >= 0
            assert self.ref_counts[b] == counts[b], f"block {b}: ref count {self.ref_counts[b]} != {counts[b]} holders"
            assert (b in free or b in cached) == (counts[b] == 0), \
                f"block {b} free-list state disagrees with its holders"
            assert (b in cached) <= (self.block_hash[b] is not None), f"cached-free block {b} has no hash"
            assert (b in free) <= (self.block_hash[b] is None), f"free block {b} still has a hash"
            if self.readers is not None:
                assert len(self.readers[b]) == self.ref_counts[b], f"block {b}: readers disagree with ref count"
        used = sum(1 for c in counts if c)
        assert len(free) + len(cached) + used == self.num_blocks
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h, f"hash table entry for block {b} is stale"
        assert sum(h is not None for h in self.block_hash) == len(self.hash_to_block), "a block has an unindexed hash"
