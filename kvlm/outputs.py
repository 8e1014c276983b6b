"""What users receive: `RequestOutput` / `CompletionOutput` and `EmbeddingRequestOutput` (vLLM's shapes) and
streaming `StreamDelta`s.

Built from a `Request` (request.py) by the engine and `LLM`; the CLI and the server only consume them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlm.request import FinishReason, Request, RequestMetrics
from kvlm.structured.tool_parser import ToolCall


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    tool_calls: list[ToolCall] | None = None  # `LLM.chat(..., tools=...)`: the calls parsed out of `text`


@dataclass(slots=True)
class RequestOutput:
    """What `LLM.generate` returns per prompt (vLLM's shape): `.outputs[0].text`, `.outputs[0].token_ids`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @classmethod
    def from_request(cls, req: Request) -> RequestOutput:
        out = CompletionOutput(0, req.text, req.output_token_ids, req.finish_reason, req.stop_reason,
                               None if req.logprobs is None else list(req.logprobs))
        return cls(req.request_id, req.prompt, req.prompt_token_ids, [out], req.is_finished, req.metrics,
                   None if req.prompt_logprobs is None else list(req.prompt_logprobs))


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]  # float32 values; unit L2 norm unless normalize=False

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt (vLLM's shape): `.outputs.embedding`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool
    metrics: RequestMetrics

    @classmethod
    def from_request(cls, req: Request) -> EmbeddingRequestOutput:
        assert req.embedding is not None, "not a finished embedding request"
        return cls(req.request_id, req.prompt_token_ids, EmbeddingOutput(req.embedding.tolist()), req.is_finished,
                   req.metrics)


@dataclass(slots=True)
class StreamDelta:
    """One streaming update: text and token ids new since the last delta of this request."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    logprobs: list[dict[int, float]] | None = None  # one per token in token_ids, when params.logprobs is set
    prompt_logprobs: list[dict[int, float] | None] | None = None  # on a request's first delta only
    embedding: list[float] | None = None  # a prompt-only request's vector (`PoolingParams`), on its final delta
