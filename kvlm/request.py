"""The request object that flows through schedule -> execute -> update (what users get back: `outputs.py`).

A `Request` holds everything about one generation: its token ids (prompt then output), how many of them
already have K/V in the cache (`num_computed_tokens`), its block table, sampling parameters, status,
streaming-text state and metrics. The scheduler, block manager, runner and engine all read and update
this one object; there are no side tables keyed by request id.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Literal

from kvlm.sampling_params import PoolingParams, SamplingParams

if TYPE_CHECKING:
    import torch

    from kvlm.kv_policy import BoundedKV
    from kvlm.lora.adapter import LoRAAdapter
    from kvlm.spec_decode.depth import DraftDepth
    from kvlm.structured.matcher import RequestGrammar
    from kvlm.structured.reasoning_budget import ReasoningBudget
    from kvlm.tokenizer.detokenizer import IncrementalDetokenizer

FinishReason = Literal["stop", "length", "abort"]


class RequestStatus(Enum):
    WAITING = "waiting"  # queued, or preempted and queued again (its KV was freed; it will recompute)
    RUNNING = "running"  # holds blocks; prefilling in chunks or decoding
    FINISHED = "finished"


@dataclass(slots=True)
class RequestMetrics:
    """Timings (time.perf_counter seconds) and cache figures of one request."""

    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose K/V were reused, not recomputed
    num_tier_tokens: int = 0  # of those, tokens loaded from the disk tier (kv_cache/tier.py) for this request
    num_prefilled_tokens: int = 0  # prompt tokens run through the model (again after a preemption)
    num_computed_tokens: int = 0  # all tokens whose K/V this request computed (prefill, decode, recompute)
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_evicted_tokens: int = 0  # tokens whose K/V a bounded cache dropped (sinks + window), counted once
    blocks_held: int = 0  # at the last step it ran
    kv_bytes_held: int = 0  # bytes of the blocks held
    kv_bytes_used: int = 0  # bytes of those blocks actually filled (held - used = paging waste)
    blocks_shared: int = 0  # of blocks_held, how many other requests also read (prefix cache)
    prefix_miss: str | None = None  # why less of the prompt was reused than an earlier request shared
    # Speculative decoding (vLLM's names): verifications with drafts, drafts verified, drafts accepted
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)  # index i: accepted as the (i+1)-th draft

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the end of the prefill that produced it."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        dt = self.finished_time - self.first_token_time
        return (self.num_generated_tokens - 1) / dt if dt > 0 else None

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "cached_tokens": self.num_cached_tokens,
            **({"tier_tokens": self.num_tier_tokens} if self.num_tier_tokens else {}),
            "prefilled_tokens": self.num_prefilled_tokens,
            "computed_tokens": self.num_computed_tokens,
            "generated_tokens": self.num_generated_tokens,
            "time_in_queue_s": self.time_in_queue,
            "ttft_s": self.ttft,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "preemptions": self.num_preemptions,
            "kv_evicted_tokens": self.num_evicted_tokens,
            "kv_blocks_held": self.blocks_held,
            "kv_blocks_shared": self.blocks_shared,
            "kv_bytes_held": self.kv_bytes_held,
            "kv_bytes_waste": self.kv_bytes_held - self.kv_bytes_used,
            "prefix_cache_miss": self.prefix_miss,
            **({"spec_draft_tokens": self.spec_num_draft_tokens, "spec_accepted_tokens": self.spec_num_accepted_tokens}
               if self.spec_num_drafts else {}),
        }


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    token_ids: list[int]  # prompt, then every generated token
    num_prompt_tokens: int
    params: SamplingParams
    prompt: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # leading tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache hash of each full block so far
    num_cached_blocks: int = 0  # leading blocks of block_table registered in the prefix cache
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    # With params.prompt_logprobs: one entry per prompt token, the first None (nothing predicts it).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    text: str = ""  # final text emitted so far (stop strings never enter it)
    pending_text: str = ""  # decoded but held back: it may be the start of a stop string
    detokenizer: IncrementalDetokenizer | None = None
    # Every random draw of this request is keyed by (seed, position of the token drawn) (engine/sampler.py):
    # params.seed, or one drawn here, at admission, for an unseeded request.
    seed: int | None = None
    # Speculative decoding (kvlm/spec_decode): tokens proposed to follow token_ids, verified in the next
    # step as extra rows (the scheduler may shorten them; the engine clears them after the step).
    draft_token_ids: list[int] = field(default_factory=list)
    draft_depth: DraftDepth | None = None  # how many to propose next (spec_decode/depth.py); None: not yet
    grammar: RequestGrammar | None = None  # with params.structured_outputs: its compile, then its matcher
    reasoning: ReasoningBudget | None = None  # params.reasoning / reasoning_budget: its <think> span, count, forcing
    # A bounded cache (kv_policy.py): its policy; evicted blocks are -1 in block_table, blocks
    # [sink_blocks, evicted_upto) of it; the sinks' keys as first computed (layers, num_sinks, kv_heads, D)
    # float, kept to re-rotate them from at each eviction, and the shift they carry now.
    # Layer groups besides group 0 (kv_cache/layer_groups.py: sliding-window layers): per group its block
    # table (EVICTED where the window left), its registered leading blocks and its evicted ones.
    group_tables: list[list[int]] = field(default_factory=list)
    group_cached: list[int] = field(default_factory=list)
    group_evicted: list[int] = field(default_factory=list)
    kv_policy: BoundedKV | None = None
    # The LoRA adapter its rows run under (kvlm/lora; None: the base model). Its K/V are keyed by it in the
    # prefix cache (`BlockManager.block_hashes`), so requests under different adapters never share blocks.
    lora: LoRAAdapter | None = None
    evicted_upto: int = 0
    sink_keys: torch.Tensor | None = None
    sink_shift: int = 0
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # A prompt-only request (an embedding, engine/pooling.py): its pooling (resolved: never None), the
    # hidden rows it keeps until its prompt is complete ((n, hidden) chunks), then its vector (hidden or
    # `dimensions`,) float32. It samples no token, and neither reads nor fills the prefix cache.
    pooling: PoolingParams | None = None
    pooled_rows: list[torch.Tensor] = field(default_factory=list)
    embedding: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.seed is None:
            self.seed = self.params.seed if self.params.seed is not None else int.from_bytes(os.urandom(8), "little")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def reset_bounded_state(self) -> None:
        """Forget what eviction did (the request holds no blocks: preempted, to be recomputed from 0)."""
        self.evicted_upto, self.sink_keys, self.sink_shift = 0, None, 0

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether admission may hand it cached blocks: not when it computes its whole prompt (prompt
        logprobs need every row's logits; an embedding neither reads nor fills the cache, engine/pooling.py)."""
        return self.params.prompt_logprobs is None and self.pooling is None

    @property
    def grammar_ready(self) -> bool:
        """False while this request's grammar is still compiling (the scheduler leaves it waiting)."""
        return self.grammar is None or self.grammar.ready

    @property
    def grammar_applies(self) -> bool:
        """Is the next token constrained by this request's grammar (it has one, and no reasoning span holds
        it back: `ReasoningBudget.grammar_waits`)?"""
        return self.grammar is not None and (self.reasoning is None or not self.reasoning.grammar_waits)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
