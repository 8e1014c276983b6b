"""Model runner: turns a `ScheduledBatch` into tensors, runs the model once, samples.

It owns the model, the KV cache tensors and the device. Per step it builds the flat input (token ids and
positions of every scheduled token, all requests concatenated), the `AttentionMetadata` (slot mapping,
block tables, lengths, mask) once, runs one forward pass, computes logits only for requests whose
scheduled tokens reach the end of their sequence (a prefill chunk in the middle of a prompt samples
nothing), and calls the sampler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvlm.attention.decode import decode_rows
from kvlm.attention.metadata import AttentionMetadata, GatheredRows, StepKind
from kvlm.attention.paged import paged_rows
from kvlm.attention.prefill import prefill_rows
from kvlm.engine.pooling import keep_rows
from kvlm.engine.sampler import sample
from kvlm.engine.scheduler import ScheduledBatch
from kvlm.kernels.backend import Backend
from kvlm.kv_cache.storage import KVCache, PagedKVCache
from kvlm.lora.rows import LoRARows
from kvlm.model.fused_decode import FusedDecoder
from kvlm.model.llama import LlamaForCausalLM
from kvlm.request import Request


@dataclass(frozen=True, slots=True)
class StepResult:
    """Requests that produced a token this step, with their tokens, logprobs and float32 logits (N, V). A request
    verifying k drafts has k + 1 consecutive rows (its pick after its last token, then after each draft)."""

    requests: list[Request]
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    logits: torch.Tensor | None


@dataclass(slots=True)
class _StepRows:
    """A step's rows on the host, before they become tensors: one per scheduled token, requests in order.

    Attention sees sequences: a request's rows are one sequence (a chunk, or a decode row), except that a
    request verifying drafts brings each of its rows as a one-row sequence over its own block table (row
    j attends positions <= its own, all written before any row attends): every row of the step is then a
    decode row, so such a step keeps the decode plan (and the fused native step where it applies), and a
    row's bits are those of the same token decoded alone."""

    requests: list[Request]  # per sequence
    starts: list[int]  # per sequence: its first row's position (num_computed_tokens before the step for a chunk)
    ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    tables: list[list[int]]  # block tables padded with 0 to the longest (what attention reads)
    shifts: list[int]  # per sequence: its rows' position minus their index in what attention reads
    logits_rows: list[int]  # rows that end their sequence, or verify a draft: each samples a token
    samplers: list[Request]  # per logits row its request (repeated for a request's drafts)
    offsets: list[int]  # per logits row: 0, or which draft's successor it picks (speculative decoding)
    # layer groups 1.. (sliding-window layers' own pools): per group, the rows' slots and the padded tables
    group_slots: list[list[int]]
    group_tables: list[list[list[int]]]

    @classmethod
    def collect(cls, batch: ScheduledBatch, block_size: int, null_blocks: tuple[int, ...] = ()) -> _StepRows:
        """null_blocks[g - 1]: the id extra group g's evicted entries read (its zero-filled null block)."""
        r = cls([], starts=[], ids=[], positions=[], slots=[], query_lens=[], seq_lens=[],
                tables=[], shifts=[], logits_rows=[], samplers=[], offsets=[],
                group_slots=[[] for _ in null_blocks],
                group_tables=[])
        tables = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start = req.num_computed_tokens
            # speculative decoding: the rows past its tokens are its drafts (K/V written like any row's),
            # each its own one-row sequence (see the class docstring)
            drafts = req.draft_token_ids  # (read in place: no copy of the request's tokens per step)
            seqs = [(start + j, 1) for j in range(n)] if drafts else [(start, n)]
            bt, policy = req.block_table, req.kv_policy
            for s0, m in seqs:
                r.requests.append(req)
                r.starts.append(s0)
                d0 = s0 - req.num_tokens  # >= 0: a draft's row (m = 1)
                r.ids.extend(req.token_ids[s0 : s0 + m] if d0 < 0 else drafts[d0 : d0 + m])
                r.positions.extend(range(s0, s0 + m))
                r.slots.extend(bt[p // block_size] * block_size + p % block_size for p in range(s0, s0 + m))
                r.query_lens.append(m)
                if policy is None:
                    r.seq_lens.append(s0 + m)
                    r.shifts.append(0)
                    tables.append(bt)
                else:  # a bounded cache: attention reads [sinks | kept], one table for the step's rows
                    r.seq_lens.append(policy.attended(s0 + m - 1))
                    r.shifts.append(policy.ctx_shift(s0))
                    tables.append(policy.virtual_table(bt, s0))
            if start + n >= req.num_tokens and req.pooling is None:  # the end: a token (an embedding gets none)
                last = req.num_tokens - 1  # its last token's row picks the next one; each draft's row the one after
                for p in range(last, start + n):
                    r.logits_rows.append(len(r.ids) - (start + n - p))
                    r.samplers.append(req)
                    r.offsets.append(p - last)
        max_blocks = max(len(t) for t in tables)
        r.tables = [t + [0] * (max_blocks - len(t)) for t in tables]
        for g, null in enumerate(null_blocks):
            slots, gt = r.group_slots[g], []
            for req, s0, m in zip(r.requests, r.starts, r.query_lens):
                raw = req.group_tables[g]  # the blocks this step writes are held, never EVICTED
                slots.extend(raw[p // block_size] * block_size + p % block_size for p in range(s0, s0 + m))
                # a bounded request reads [sinks | kept] in every group (its sinks outside a sliding window)
                t = raw if req.kv_policy is None else req.kv_policy.virtual_table(raw, s0)
                gt.append([null if b < 0 else b for b in t])  # EVICTED entries read the null block
            r.group_tables.append([t + [null] * (max_blocks - len(t)) for t in gt])
        return r


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device, backend: Backend,
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
        # The backend (kernels/backend.py, decided once by the engine) says how attention runs: every row
        # of every step over the cache's blocks in place (attention/paged.py: one computation for
        # prefill, decode, mixed and recompute rows), or K/V gathered per sequence and attended by SDPA.
        self.in_place = backend.in_place
        # DECODE steps on the paged cache run every layer in one native call where the model allows
        # (model/fused_decode.py), with the same per-row attention; the backend records which and why.
        self.fused, why = FusedDecoder.create(model, kv_cache, backend)
        self.backend = backend.with_decode("fused" if self.fused is not None else "modules", why)
        # Layer groups 1.. (sliding layers' own pools, kv_cache/layer_groups.py): their null blocks' ids.
        self.null_blocks = tuple(kv_cache.group_blocks[1:]) if isinstance(kv_cache, PagedKVCache) else ()
        assert not self.null_blocks or self.fused is None, "the fused decode step reads one block table"
        # Teacher-forced scoring (`Engine.prompt_logits`): called after each step's forward with every
        # request's (request, first position, its rows' final hidden states (n, hidden)); None: not called.
        self.hidden_observer: Callable[[Request, int, torch.Tensor], None] | None = None

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, AttentionMetadata, _StepRows]:
        """Flat input ids (T,) and the step's metadata; also the step's rows (`samplers`: the request of each
        logits row, `offsets`: which of its drafts that row follows).

        Every scheduled token becomes one row, requests laid out in order. A step whose requests each
        bring one row is planned as decode (`prepare_decode`); one that carries prompt chunks as
        prefill (`prepare_prefill`, which also takes the decode rows of a mixed step). With the native
        kernels every row then attends in place over the cache (`meta.in_place`): one computation for
        every row, whatever the plan."""
        rows = _StepRows.collect(batch, self.kv_cache.block_size, self.null_blocks)
        if all(n == 1 for n in rows.query_lens):
            meta = self.prepare_decode(rows)
        else:
            meta = self.prepare_prefill(rows)
        return torch.tensor(rows.ids, device=self.device), meta, rows

    def prepare_prefill(self, rows: _StepRows) -> AttentionMetadata:
        """PREFILL (every request brings a prompt chunk) or MIXED (chunks and decode rows). In place: row t
        of a chunk attends its sequence's first position + 1 cached tokens. Reference: K/V gathered per
        sequence, attended with a causal mask offset by each chunk's cached history."""
        is_prompt = [start < req.num_prompt_tokens for req, start in zip(rows.requests, rows.starts)]
        kind = StepKind.PREFILL if all(is_prompt) else StepKind.MIXED
        return self._metadata(rows, kind, lambda: prefill_rows(rows.query_lens, rows.seq_lens, self.device))

    def prepare_decode(self, rows: _StepRows) -> AttentionMetadata:
        """DECODE: one row per request. In place: each row attends its whole cached context (and a paged
        step may run as one fused native call). Reference: K/V gathered per sequence, in groups of similar
        length when that saves padding (`plan_length_groups`)."""
        return self._metadata(rows, StepKind.DECODE, lambda: decode_rows(
            rows.tables, rows.seq_lens, self.kv_cache.block_size, self.device, self.min_group_batch, self.group_cost))

    def _metadata(self, rows: _StepRows, kind: StepKind,
                  gathered: Callable[[], GatheredRows]) -> AttentionMetadata:
        """The step's common metadata, and the backend's own part: `paged_rows` in place, else `gathered`."""
        dev = self.device
        positions = torch.tensor(rows.positions, device=dev)
        table_dtype = torch.int32 if self.in_place else torch.int64  # int32, as the native kernels take them
        attn = (paged_rows(positions, rows.query_lens, rows.seq_lens, rows.shifts) if self.in_place
                else gathered())
        return AttentionMetadata(
            kind=kind,
            positions=positions,
            slots=(torch.tensor(rows.slots, device=dev), *(torch.tensor(s, device=dev) for s in rows.group_slots)),
            tables=tuple(torch.tensor(t, dtype=table_dtype, device=dev) for t in (rows.tables, *rows.group_tables)),
            query_lens=tuple(rows.query_lens),
            seq_lens=tuple(rows.seq_lens),
            logits_indices=torch.tensor(rows.logits_rows, device=dev),
            attn=attn,
            lora=LoRARows.of([r.lora for r in rows.requests], rows.query_lens, dev),
        )

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, keep_logits: bool = False) -> StepResult:
        input_ids, meta, rows = self.prepare(batch)
        samplers = rows.samplers
        if batch.kv.block_copies or batch.kv.sink_moves:
            cache = self.kv_cache
            assert isinstance(cache, PagedKVCache), "bounded caches need the paged layout"
            cache.apply_step(batch.kv, self.model.shift_keys)
        self.num_tokens_processed += len(input_ids)
        # A chunk of q tokens ending at sequence length s has contexts s-q+1 .. s.
        self.num_context_tokens += sum(q * s - q * (q - 1) // 2 for q, s in zip(meta.query_lens, meta.seq_lens))
        self.kv_cache.begin_step(meta)  # the cache's own per-block records (kv_cache/storage.py)
        # LoRA rows (meta.lora) run in the fused step too: it adds each adapter's update after each base
        # projection with the module path's kernel and order, so its bits are the module path's
        # (tests/lora/test_lora_exact.py compares them).
        fused = self.fused is not None and meta.in_place and meta.kind is StepKind.DECODE
        if fused and not self.fused.fits(meta.positions):  # type: ignore[union-attr]
            fused = False  # too many rows past the context for the RoPE table's scratch: the module path
        if fused:
            hidden = self.fused(input_ids, meta, self.kv_cache)  # (B, hidden), all layers in one native call
        else:
            hidden = self.model(input_ids, meta.positions, self.kv_cache, meta)  # (T, hidden)
        if any(r.params.prompt_logprobs is not None for r in batch.requests):
            self._prompt_logprobs(batch, hidden)
        if any(r.pooling is not None for r in batch.requests):
            keep_rows(batch, hidden)  # embeddings: their rows kept, pooled when the prompt is complete
        if self.hidden_observer is not None:
            row = 0
            for req, n in zip(batch.requests, batch.num_new_tokens):
                self.hidden_observer(req, req.num_computed_tokens, hidden[row : row + n])
                row += n
        if not samplers:
            return StepResult([], [], [], None)
        logits = self.model.compute_logits(hidden[meta.logits_indices])  # (N, vocab) float32
        offsets = rows.offsets if any(rows.offsets) else None  # (draft rows: the sampler keys them by position)
        out = sample(logits, samplers, self.eos_token_ids, writable=not keep_logits,  # kept logits stay unmasked
                     offsets=offsets)
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
