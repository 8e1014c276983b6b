"""`AttentionMetadata`: how one engine step's T flat rows map onto sequences, positions and cache slots.

Built once per step by the model runner (`engine/model_runner.py`: `prepare_prefill` / `prepare_decode`)
and passed explicitly through the model; nothing here is global. `kind` names the plan: a step whose
sequences each feed one row (decode) or one that carries prompt chunks (prefill, or a mixed step of
prompt chunks and decode rows). `in_place` says that every row attends over the cache's blocks with the
one native computation (attention/paged.py); without it the reference attends by plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch


class StepKind(Enum):
    """Which rows a step carries, named by what the scheduler put there."""

    PREFILL = "prefill"  # every sequence brings prompt rows (a whole prompt, or a chunk after cached blocks)
    DECODE = "decode"  # every sequence brings one row: its newest token (decode, or a 1-token prompt chunk)
    MIXED = "mixed"  # prompt chunks and single decode rows in one step


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Per-step layout of a batch of prefill chunks and decodes (T flat tokens, B sequences)."""

    kind: StepKind
    positions: torch.Tensor  # (T,) int64: position of each token in its sequence
    slot_mapping: torch.Tensor  # (T,) int64: flat cache slot (block * block_size + offset) of each token
    block_tables: torch.Tensor  # (B, max_blocks) int64 (int32 when in_place), padded with 0
    query_lens: tuple[int, ...]  # new tokens per sequence (host ints: they shape tensors)
    seq_lens: tuple[int, ...]  # context length per sequence after this step (cached + new)
    q_pad_index: torch.Tensor | None  # (T,) int64: row of each token in the (B * max_query_len) padded layout
    attn_mask: torch.Tensor | None  # (B, 1, max_query_len, max_seq_len) bool, True = may attend; None = not needed
    logits_indices: torch.Tensor  # (N,) int64: flat rows whose logits we need (a sequence's last token)
    # With the native kernels every row attends in place over the cache's blocks (attention.paged): row t
    # reads sequence row_seq[t]'s first row_ctx[t] cached tokens (its position + 1), so its bits depend
    # on its query and those K/V only, never on the rest of the step.
    in_place: bool = False
    row_seq: torch.Tensor | None = None  # (T,) int32: each row's sequence (its row in block_tables)
    row_ctx: torch.Tensor | None = None  # (T,) int32: each row's context length (position + 1)
    seq_lens_tensor: torch.Tensor | None = None  # (B,) int32 seq_lens, for the fused decode step
    # A cache whose position-0 keys are centered on k0 (kernels/kv_quant.py, KeyCenter): (B,) uint8, 1 where
    # sequence b's context starts at its position-0 key (not where a bounded cache without sinks has
    # evicted it); None: every sequence's does.
    k0_seqs: torch.Tensor | None = None
    # DECODE batches of sequences with very different lengths are attended in groups of similar length,
    # so that short sequences are not padded to the longest (attention.decode.plan_length_groups). Each
    # group is a metadata of its own whose `rows` are its tokens' rows in this batch.
    groups: tuple[AttentionMetadata, ...] = ()
    rows: torch.Tensor | None = None  # (T_group,) int64, only in a group
    # Layer groups besides group 0 (kv_cache/layer_groups.py: sliding-window layers with pools of their own):
    # per group, the (T,) slots and (B, max_blocks) block tables of its pools, laid out as the two above.
    group_slots: tuple[torch.Tensor, ...] = ()
    group_tables: tuple[torch.Tensor, ...] = ()

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
