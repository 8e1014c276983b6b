"""What travels between a replica and the `kvlm serve` process besides `StreamDelta`s: a finished
request's summary (the fields the OpenAI endpoints read from a `Request`: usage, stop reason, prompt
logprobs), what a replica says about itself, and how an engine error crosses the process boundary."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlm.config import ModelConfig
from kvlm.errors import KvlmError, ParameterError, PromptTooLongError
from kvlm.request import Request
from kvlm.tokenizer.tokenizer import Tokenizer


@dataclass(slots=True)
class RemoteMetrics:
    num_cached_tokens: int = 0
    kv_bytes_held: int = 0
    num_evicted_tokens: int = 0
    spec_num_draft_tokens: int = 0  # speculative decoding: drafts verified and accepted (usage's details)
    spec_num_accepted_tokens: int = 0


@dataclass(slots=True)
class RemoteRequest:
    """A request as the endpoints see it once it finished on a replica (`_Call` reads these fields);
    before that, zeros."""

    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    stop_reason: str | int | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: RemoteMetrics = field(default_factory=RemoteMetrics)

    @classmethod
    def of(cls, r: Request) -> RemoteRequest:
        return cls(r.num_prompt_tokens, r.num_output_tokens, r.stop_reason, r.prompt_logprobs,
                   RemoteMetrics(r.metrics.num_cached_tokens, r.metrics.kv_bytes_held, r.metrics.num_evicted_tokens,
                                 r.metrics.spec_num_draft_tokens, r.metrics.spec_num_accepted_tokens))


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """What the serving process needs of the model without loading it: the endpoints tokenize, apply
    the chat template and check lengths before a request reaches any replica."""

    tokenizer: Tokenizer
    model_config: ModelConfig
    max_model_len: int
    model_path: Path
    block_size: int
    num_blocks: int
    root_hash: bytes  # the pool's prefix-hash root: the router hashes prompts from it
    cache_line: str  # describe_cache(), for the ready line
    max_kv_tokens: int | None = None  # the replicas' engine-wide bounded cache (None: unbounded)


def error_record(e: BaseException) -> tuple[str, str, str, str | None]:
    """An engine error as plain data (kvlm's exceptions take other arguments than they pickle)."""
    kind = ("too_long" if isinstance(e, PromptTooLongError) else "param" if isinstance(e, ParameterError)
            else "kvlm" if isinstance(e, KvlmError) else "value" if isinstance(e, ValueError) else "other")
    return ("error", kind, str(e), getattr(e, "param", None) if isinstance(e, ParameterError) else None)


def raise_record(rec: tuple[Any, ...]) -> None:
    _, kind, msg, param = rec
    if kind == "too_long":
        raise PromptTooLongError(msg)
    if kind == "param":
        raise ParameterError(param or "", msg)
    if kind == "kvlm":
        raise KvlmError(msg)
    if kind == "value":
        raise ValueError(msg)
    raise RuntimeError(msg)
