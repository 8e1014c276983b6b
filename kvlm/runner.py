"""Model runner: turns a `ScheduledBatch` into tensors, runs the model once, samples.

It owns the model, the KV cache tensors and the device. Per step it builds the flat input (token ids and
positions of every scheduled token, all requests concatenated), the `AttentionMetadata` (slot mapping,
block tables, lengths, mask) once, runs one forward pass, computes logits only for requests whose
scheduled tokens reach the end of their sequence (a prefill chunk in the middle of a prompt samples
nothing), and calls the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlm.attention import AttentionMetadata, build_attn_mask, plan_length_groups
from kvlm.fused_decode import FusedDecoder
from kvlm.kv_cache import KVCache, PagedKVCache
from kvlm.model import LlamaForCausalLM
from kvlm.request import Request
from kvlm.sampler import sample
from kvlm.scheduler import ScheduledBatch


def _native_kernels() -> bool:
    from kvlm.kernels.native import active_isa

    return active_isa() != "reference"


@dataclass(frozen=True, slots=True)
class StepResult:
    """Requests that produced a token this step, with their tokens, logprobs and float32 logits (N, V)."""

    requests: list[Request]
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    logits: torch.Tensor | None


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.model, self.kv_cache, self.device = model, kv_cache, device
        self.eos_token_ids = eos_token_ids  # banned until a request reaches min_tokens
        # Decode batches this large may be split into length groups (plan_length_groups); the
        # contiguous cache's rows are views only when B == 1, so grouping would just add gathers there.
        self.min_group_batch = 4 if isinstance(kv_cache, PagedKVCache) else 1 << 30
        self.group_cost = 1024  # padded token slots one more group is worth (per-call overhead)
        # Work done, counted as it happens (benchmarks check their closed forms against these):
        self.num_tokens_processed = 0  # tokens fed through the model
        self.num_context_tokens = 0  # sum over those tokens of their context length (attention work)
        # Decode steps read the paged blocks in place when the native kernels are built (no gather, no
        # padding, so no length groups either); else gather + SDPA, the reference.
        self.paged_decode = isinstance(kv_cache, PagedKVCache) and device.type == "cpu" and _native_kernels()
        # Decode-only steps run every layer in one native call where the model allows (fused_decode.py).
        self.fused = FusedDecoder.create(model, kv_cache) if self.paged_decode else None

    def build_metadata(self, batch: ScheduledBatch) -> tuple[torch.Tensor, AttentionMetadata, list[Request]]:
        """Flat input ids (T,) and the step's metadata; also the requests that sample this step."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        samplers: list[Request] = []
        bs = self.kv_cache.block_size
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start = req.num_computed_tokens
            ids.extend(req.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            bt = req.block_table
            slots.extend(bt[p // bs] * bs + p % bs for p in range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            if start + n == req.num_tokens:  # this chunk reaches the end: the request gets a token
                logits_rows.append(len(ids) - 1)
                samplers.append(req)
        B = len(query_lens)
        max_blocks = max(len(r.block_table) for r in batch.requests)
        tables = [r.block_table + [0] * (max_blocks - len(r.block_table)) for r in batch.requests]
        single_full = B == 1 and (query_lens[0] == 1 or query_lens[0] == seq_lens[0])
        q_pad_index = mask = None
        if B > 1:
            max_q = max(query_lens)
            q_pad_index = torch.tensor(
                [b * max_q + i for b, n in enumerate(query_lens) for i in range(n)], device=self.device
            )
        if not single_full:
            mask = build_attn_mask(query_lens, seq_lens, self.device)
        dev = self.device
        groups: tuple[AttentionMetadata, ...] = ()
        context_lens = None
        if self.paged_decode and max(query_lens) == 1:
            context_lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        elif B >= self.min_group_batch and max(query_lens) == 1:
            plan = plan_length_groups(seq_lens, group_cost=self.group_cost)
            if len(plan) > 1:
                groups = tuple(self._group_metadata(idx, tables, seq_lens) for idx in plan)
        meta = AttentionMetadata(
            positions=torch.tensor(positions, device=dev),
            slot_mapping=torch.tensor(slots, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int64 if context_lens is None else torch.int32, device=dev),
            query_lens=tuple(query_lens),
            seq_lens=tuple(seq_lens),
            q_pad_index=q_pad_index,
            attn_mask=mask,
            logits_indices=torch.tensor(logits_rows, device=dev),
            groups=groups,
            context_lens=context_lens,
        )
        return torch.tensor(ids, device=dev), meta, samplers

    def _group_metadata(self, idx: list[int], tables: list[list[int]], seq_lens: list[int]) -> AttentionMetadata:
        """Metadata of a group of decoding sequences (one token each, so token row == sequence index)."""
        dev = self.device
        lens = [seq_lens[i] for i in idx]
        nblk = -(-max(lens) // self.kv_cache.block_size)
        rows = torch.tensor(idx, device=dev)
        return AttentionMetadata(
            positions=rows, slot_mapping=rows,  # unused: a group only fetches
            block_tables=torch.tensor([tables[i][:nblk] for i in idx], device=dev),
            query_lens=(1,) * len(idx), seq_lens=tuple(lens), q_pad_index=None,
            attn_mask=None if len(idx) == 1 else build_attn_mask([1] * len(idx), lens, dev),
            logits_indices=rows, rows=rows,
        )

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, keep_logits: bool = False) -> StepResult:
        input_ids, meta, samplers = self.build_metadata(batch)
        self.num_tokens_processed += len(input_ids)
        # A chunk of q tokens ending at sequence length s has contexts s-q+1 .. s.
        self.num_context_tokens += sum(q * s - q * (q - 1) // 2 for q, s in zip(meta.query_lens, meta.seq_lens))
        if self.fused is not None and meta.context_lens is not None:
            hidden = self.fused(input_ids, meta, self.kv_cache)  # (B, hidden), all layers in one native call
        else:
            hidden = self.model(input_ids, meta.positions, self.kv_cache, meta)  # (T, hidden)
        if any(r.params.prompt_logprobs is not None for r in batch.requests):
            self._prompt_logprobs(batch, hidden)
        if not samplers:
            return StepResult([], [], [], None)
        logits = self.model.compute_logits(hidden[meta.logits_indices])  # (N, vocab) float32
        out = sample(logits, samplers, self.eos_token_ids)
        return StepResult(samplers, out.token_ids, out.logprobs, logits if keep_logits else None)

    def _prompt_logprobs(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        """Append to `req.prompt_logprobs` the log-probabilities of the prompt tokens this chunk predicts.

        The hidden state at position p predicts token p + 1, so a chunk covering positions [start, start + n)
        scores prompt tokens start + 1 .. min(start + n, prompt_len) - 1; the last prompt position predicts
        the first output token (the sampler's job). Entries are kept by position, so a chunk computed again
        (after preemption, or without a KV cache) adds nothing. Each entry holds the top-k and the actual token.
        """
        row = 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start, k = req.num_computed_tokens, req.params.prompt_logprobs
            if k is not None:
                if req.prompt_logprobs is None:
                    req.prompt_logprobs = [None]  # the first prompt token has no context to predict it
                first = len(req.prompt_logprobs) - 1  # next position whose successor is unscored
                end = min(start + n, req.num_prompt_tokens - 1)  # exclusive
                if first < end and first >= start:
                    pos = torch.arange(first, end, device=hidden.device)
                    logp = self.model.compute_logits(hidden[row + pos - start]).log_softmax(-1)  # (m, vocab)
                    target = torch.tensor(req.token_ids[first + 1 : end + 1], device=hidden.device)
                    chosen = logp.gather(1, target[:, None])[:, 0].tolist()
                    top_v, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
                    for t, c, vs, ids in zip(target.tolist(), chosen, top_v.tolist(), top_i.tolist()):
                        d = dict(zip(ids, vs))
                        d[t] = c
                        req.prompt_logprobs.append(d)
            row += n
