"""`/v1/embeddings`: OpenAI's embeddings API over the engine's prompt-only requests (`PoolingParams`).

`input` is a string, a list of strings, a list of token ids or a list of such lists; each item becomes one
engine request, all submitted together so the engine batches their prefills, and each comes back as the
pooled, normalized final-norm hidden state of its prompt (engine/pooling.py: the model's pooling, or
`--pooling`). `encoding_format` "float" gives JSON numbers, "base64" the little-endian float32 bytes
OpenAI's SDK decodes (its default); `dimensions` only where the model is Matryoshka; `usage` counts the
prompt tokens. Errors are OpenAI's shape through `OpenAIServing`'s checks; this module also registers its
route (`add_embeddings_route`), so the app adds it with one call.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from kvlm.errors import ParameterError
from kvlm.sampling_params import PoolingParams
from kvlm.server.async_engine import AsyncEngine
from kvlm.server.protocol import APIError, TokenId, _Request, bad_request
from kvlm.server.serving import OpenAIServing

MAX_INPUTS = 2048  # items in one `input`, OpenAI's limit


class EmbeddingRequest(_Request):
    """OpenAI's embeddings request, plus vLLM's `normalize` (false: the raw pooled hidden state)."""

    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    normalize: bool = True


class EmbeddingServing(OpenAIServing):
    def inputs(self, r: EmbeddingRequest) -> list[list[int]]:
        """Every item of `input` as token ids; an empty input or item, or too many items, is a 400."""
        x = r.input
        items: list[Any] = [x] if isinstance(x, str) or (x and all(isinstance(t, int) for t in x)) else list(x)
        if not items or any(len(i) == 0 for i in items):
            raise bad_request("input must not be empty (nor hold an empty string or list)", "input")
        if len(items) > MAX_INPUTS:
            raise bad_request(f"input must hold at most {MAX_INPUTS} items, got {len(items)}", "input")
        ids = [self.tokenizer.encode(i) if isinstance(i, str) else list(i) for i in items]
        n = self.max_model_len
        for k, p in enumerate(ids):
            if len(p) > n:  # the chat route's rule, with no room needed for an output token
                raise bad_request(
                    f"This model's maximum context length is {n} tokens. However, your request has {len(p)} "
                    f"input tokens{f' in input[{k}]' if len(items) > 1 else ''}. Please reduce the length of "
                    "the input.", "input", "context_length_exceeded")
        return ids

    async def embeddings(self, r: EmbeddingRequest, request_id: str) -> dict[str, Any]:
        lora = self.check_model(r.model)
        if not isinstance(self.aengine, AsyncEngine):  # replicas (serve_ray) run generation requests only
            raise APIError(501, "embeddings are not available with --replicas", "invalid_request_error")
        try:  # `dimensions` against this model (Matryoshka only), before anything is queued
            params = self.engine.pooling.resolve(PoolingParams(None, r.normalize, r.dimensions))
        except ParameterError as e:
            raise bad_request(str(e), e.param) from None
        ids = self.inputs(r)
        self.reserve(len(ids))
        specs = [(p, params, request_id if len(ids) == 1 else f"{request_id}-{i}") for i, p in enumerate(ids)]
        sub = await self._submit(specs, len(ids), "input", lora=lora)  # type: ignore[arg-type]
        vectors: list[list[float] | None] = [None] * len(ids)
        try:
            async for idx, d in sub:
                if d.finished:
                    vectors[idx] = d.embedding
        finally:
            sub.close()
        if any(v is None for v in vectors):  # aborted: the server is shutting down
            raise APIError(503, "the request was aborted (the server is shutting down)", "service_unavailable",
                           None, 503)
        data = [{"object": "embedding", "index": i, "embedding": _encode(v, r.encoding_format)}  # type: ignore[arg-type]
                for i, v in enumerate(vectors)]
        tokens = sum(len(p) for p in ids)
        return {"object": "list", "data": data, "model": lora or self.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encode(v: list[float], fmt: str) -> list[float] | str:
    """A vector as JSON numbers, or as base64 of its little-endian float32 bytes (what OpenAI's SDK decodes
    with `np.frombuffer(base64.b64decode(s), dtype="float32")`)."""
    return v if fmt == "float" else base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")


def add_embeddings_route(route: Callable[..., None], serving: EmbeddingServing) -> None:
    """`POST /v1/embeddings`, through the app's `route` (body limit, schema, availability, disconnects)."""
    route("/v1/embeddings", EmbeddingRequest, serving.embeddings)
