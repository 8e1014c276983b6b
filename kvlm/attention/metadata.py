"""`AttentionMetadata`: how one engine step's T flat rows map onto sequences, positions and cache slots.

Built once per step by the model runner (`engine/model_runner.py`: `prepare_prefill` / `prepare_decode`)
and passed explicitly through the model; nothing here is global. `kind` names the plan: a step whose
sequences each feed one row (decode) or one that carries prompt chunks (prefill, or a mixed step of
prompt chunks and decode rows). The fields are what every attention backend and cache reads (positions,
slots, tables, lengths); `attn` is what the step's backend derived for itself: `PagedRows` when every row
attends over the cache's blocks in place (attention/paged.py), `GatheredRows` when the reference attends
each sequence's gathered context by plan (attention/prefill.py, decode.py). What a cache's policies need
per step (a centered cache's position-0 keys, a bounded cache's virtual tables) it derives from these
fields and its own state.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvlm.lora.rows import LoRARows


class StepKind(Enum):
    """Which rows a step carries, named by what the scheduler put there."""

    PREFILL = "prefill"  # every sequence brings prompt rows (a whole prompt, or a chunk after cached blocks)
    DECODE = "decode"  # every sequence brings one row: its newest token (decode, or a 1-token prompt chunk)
    MIXED = "mixed"  # prompt chunks and single decode rows in one step


@dataclass(frozen=True, slots=True)
class PagedRows:
    """What the in-place paged attention derives for a step (`attention/paged.py`, `paged_rows`): row t
    reads sequence row_seq[t]'s first row_ctx[t] tokens (its position + 1, less a bounded cache's shift)
    through that sequence's block table, so its bits depend on its query and those K/V only."""

    row_seq: torch.Tensor  # (T,) int32: each row's sequence (its row in the block tables)
    row_ctx: torch.Tensor  # (T,) int32: each row's context length
    seq_lens: torch.Tensor  # (B,) int32: AttentionMetadata.seq_lens as the native kernels take them


@dataclass(frozen=True, slots=True)
class GatheredRows:
    """What the gathered SDPA reference derives for a step (`attention/prefill.py`, `decode.py`): each
    sequence's context fetched as (B, kv_heads, L, D), queries padded and masked where sequences differ."""

    q_pad_index: torch.Tensor | None  # (T,) int64: row of each token in the (B * max_query_len) padded layout
    attn_mask: torch.Tensor | None  # (B, 1, max_query_len, max_seq_len) bool, True = may attend; None = not needed
    # DECODE batches of sequences with very different lengths are attended in groups of similar length,
    # so that short sequences are not padded to the longest (decode.plan_length_groups). Each group is
    # a metadata of its own whose `rows` are its tokens' rows in this batch.
    groups: tuple[AttentionMetadata, ...] = ()
    rows: torch.Tensor | None = None  # (T_group,) int64, only in a group


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Per-step layout of a batch of prefill chunks and decodes (T flat rows, B sequences): what every
    attention backend and every cache reads; `attn` is what the backend's own builder derived from it."""

    kind: StepKind
    positions: torch.Tensor  # (T,) int64: position of each row in its sequence
    # Per layer group (kv_cache/layer_groups.py; group 0 the full-attention layers, then each sliding
    # window's own pool): (T,) int64 flat cache slot (block * block_size + offset) of each row ...
    slots: tuple[torch.Tensor, ...]
    # ... and (B, max_blocks) block tables (int32 for the paged kernels, else int64), padded
    tables: tuple[torch.Tensor, ...]
    query_lens: tuple[int, ...]  # new rows per sequence (host ints: they shape tensors)
    seq_lens: tuple[int, ...]  # tokens each sequence's last row attends (cached + new; a bounded cache's fewer)
    logits_indices: torch.Tensor  # (N,) int64: flat rows whose logits we need (a sequence's last row)
    attn: PagedRows | GatheredRows
    # Which rows run under which LoRA adapter (kvlm/lora/rows.py), read by the model's projections after
    # their base matmul; None: every row is the base model's. Attention and the caches never read it.
    lora: LoRARows | None = None

    @property
    def slot_mapping(self) -> torch.Tensor:
        """Group 0's slots (T,)."""
        return self.slots[0]

    @property
    def block_tables(self) -> torch.Tensor:
        """Group 0's block tables (B, max_blocks)."""
        return self.tables[0]

    @property
    def in_place(self) -> bool:
        """Whether every row attends over the cache's blocks in place (`attention/paged.py`)."""
        return isinstance(self.attn, PagedRows)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens)

    @property
    def is_decode(self) -> bool:
        return self.kind is StepKind.DECODE


def build_attn_mask(query_lens: list[int], seq_lens: list[int], device: torch.device) -> torch.Tensor:
    """(B, 1, max_q, max_L) causal mask for sequences whose new tokens sit at the end of their context.

    Query i of sequence b is at position seq_len_b - query_len_b + i and may see keys j <= that position.
    Padding query rows get position 0 so they still see key 0 (no all-masked row, hence no NaN).
    """
    q = torch.tensor(query_lens, device=device)
    s = torch.tensor(seq_lens, device=device)
    i = torch.arange(max(query_lens), device=device)
    pos = (s - q)[:, None] + i[None, :]  # (B, max_q)
    pos = torch.where(i[None, :] < q[:, None], pos, torch.zeros_like(pos))
    j = torch.arange(max(seq_lens), device=device)
    return (j[None, None, :] <= pos[:, :, None]).unsqueeze(1)
