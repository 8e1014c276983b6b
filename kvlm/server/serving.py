"""What the OpenAI endpoints share: request -> checks -> engine requests -> response or SSE chunks.

`OpenAIServing` is the base of the two endpoint classes (`serving_completion.CompletionServing`,
`serving_chat.ChatServing`, as vLLM splits them). It turns a validated request into engine requests
(prompts x n, seeded `seed + i`), checks what the engine cannot know (the served model name, caps on n,
logprobs and stop strings, vLLM's context-length rule), translates the engine's own `ParameterError`s
into 400s, and ends every SSE stream the same way. `_Call` collects or streams one call's deltas.
It knows nothing about HTTP transport; `app` does the routing, auth, body limits and disconnects.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvlm.engine.engine import Engine
from kvlm.errors import KvlmError, ParameterError, PromptTooLongError, UnknownLoRAError
from kvlm.outputs import StreamDelta
from kvlm.request import Request
from kvlm.sampling_params import SamplingParams, StructuredOutputsParams
from kvlm.server.async_engine import AsyncEngine, QueueFullError, Submission
from kvlm.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, bad_request
from kvlm.server.structured_request import structured_outputs
from kvlm.structured.reasoning import ReasoningConfig, ReasoningPlan

_SAMPLING_FIELDS = {f for f in SamplingParams.__dataclass_fields__ if f != "stop_strings"}


@dataclass(slots=True)
class ServingOptions:
    served_model_names: list[str]
    max_logprobs: int = 20
    max_n: int = 16
    max_stop: int = 16
    max_stop_len: int = 256
    max_prompts: int = 256  # engine requests one call may create (prompts x n)
    max_stored_responses: int = 1024  # /v1/responses kept for previous_response_id and GET (LRU)
    # Is chat output split into reasoning and content, and with what default budget (--reasoning-parser,
    # --reasoning-budget): decided once at start (`ReasoningConfig.choose`); the default splits nothing.
    reasoning: ReasoningConfig = field(default_factory=lambda: ReasoningConfig.choose("none", None, None))


@dataclass(slots=True)
class _Choice:
    """What one choice accumulates (non-streaming) or still owes the client (streaming)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    started: bool = False  # chat: the role chunk was sent
    offset: int = 0  # completions: text_offset of the next token


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def param_of(e: ValueError) -> str | None:
    """The API field a sampling error names (`ParameterError.param`, or the first word of the message)."""
    if isinstance(e, ParameterError):
        return e.param
    word = str(e).split(" ", 1)[0].strip(":")
    return word if word in _SAMPLING_FIELDS else None


class OpenAIServing:
    def __init__(self, engine: Engine, aengine: AsyncEngine, options: ServingOptions) -> None:
        self.engine, self.aengine, self.opts = engine, aengine, options
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.model_name = options.served_model_names[0]
        self._token_text: dict[int, str] = {}

    # ------------------------------------------------------------------------------------------ checks
    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter `name` selects (vLLM: the `model` field names an adapter), None for the base;
        404 in OpenAI's shape for a name that is neither."""
        if name is None or name in self.opts.served_model_names:
            return None
        if isinstance(self.engine, Engine) and name in self.engine.loras:
            return name
        raise APIError(404, f"The model `{name}` does not exist.", "NotFoundError", "model", "model_not_found")

    def token_text(self, tid: int) -> str:
        t = self._token_text.get(tid)
        if t is None:
            t = self._token_text[tid] = self.tokenizer.decode([tid], skip_special_tokens=False)
        return t

    def _check_common(self, r: CompletionRequest | ChatCompletionRequest, num_prompts: int) -> None:
        o = self.opts
        if r.best_of is not None and r.best_of != r.n:
            raise bad_request("best_of is not supported (only best_of == n)", "best_of")
        if not 1 <= r.n <= o.max_n:
            raise bad_request(f"n must be in [1, {o.max_n}], got {r.n}", "n")
        if r.n > 1 and r.temperature == 0:
            raise bad_request(f"n must be 1 when using greedy sampling, got {r.n}", "n")
        if r.temperature is not None and not 0 <= r.temperature <= 2:
            raise bad_request(f"temperature must be a finite number in [0, 2] (OpenAI's range), got {r.temperature}",
                              "temperature")
        if num_prompts * r.n > o.max_prompts:
            raise bad_request(f"prompts x n must be at most {o.max_prompts}", "n")
        stops = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
        if any(not s for s in stops):
            raise bad_request("stop cannot contain an empty string", "stop")
        if len(stops) > o.max_stop:
            raise bad_request(f"at most {o.max_stop} stop strings are allowed, got {len(stops)}", "stop")
        if any(len(s) > o.max_stop_len for s in stops):
            raise bad_request(f"stop strings must be at most {o.max_stop_len} characters", "stop")
        self._logit_bias(r)

    def _logit_bias(self, r: CompletionRequest | ChatCompletionRequest) -> dict[int, float] | None:
        """OpenAI's {"token id": bias} as the engine takes it: keys that are not integers and non-finite values
        are 400, values clamped to [-100, 100]. Ids outside the vocabulary are the engine's check (`_submit`)."""
        if not r.logit_bias:
            return None
        out: dict[int, float] = {}
        bad = [k for k in r.logit_bias if not k.strip().lstrip("-").isdigit()]
        if bad:
            raise bad_request(f"logit_bias keys must be token ids, got {bad}", "logit_bias")
        for k, v in r.logit_bias.items():
            tid = int(k)
            if not math.isfinite(v):
                raise bad_request(f"logit_bias values must be finite, got {v}", "logit_bias")
            out[tid] = max(-100.0, min(100.0, float(v)))
        return out

    def _check_prompt(self, ids: list[int], max_tokens: int | None, param: str, default: int | None = None,
                      bounded: bool = False) -> int:
        """The max_tokens to use, and vLLM's rule that prompt + max_tokens must fit the context (the engine
        would stop at the context's end instead), in vLLM's wording. Without max_tokens: `default` tokens
        (completions: 16), or the rest of the context when that is less or when `default` is None (chat).
        A default is never refused for not fitting: the client did not ask for it. The prompt's ids are the
        engine's check (`_submit`). A bounded cache (max_kv_tokens) is not held to the context: without
        max_tokens it gets a context's worth of new tokens."""
        n, m = self.max_model_len, len(ids)
        if bounded:
            if max_tokens is not None and max_tokens < 1:
                raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
            return max_tokens if max_tokens is not None else (n if default is None else default)
        if m >= n:
            raise bad_request(
                f"This model's maximum context length is {n} tokens. However, your request has {m} input tokens. "
                "Please reduce the length of the input messages.", param, "context_length_exceeded")
        if max_tokens is None:
            return n - m if default is None else min(default, n - m)
        if max_tokens < 1:
            raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        if m + max_tokens > n:
            raise bad_request(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
                f"length is {n} tokens and your request has {m} input tokens ({max_tokens} > {n} - {m}).",
                "max_tokens", "context_length_exceeded")
        return max_tokens

    async def _constraint(self, r: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
        """The request's output constraint, compiled (off the engine loop; cached) so that a bad schema or
        regex is a 400 naming the field the client used, before anything is queued."""
        spec, name = structured_outputs(r)
        if spec is not None:
            await self.compile_grammar(spec, name)
        return spec

    async def compile_grammar(self, spec: StructuredOutputsParams, param: str) -> None:
        try:
            await asyncio.wrap_future(self.engine.grammars.submit(spec))
        except ParameterError as e:
            raise bad_request(str(e).replace("structured_outputs", param, 1), param) from None

    def _bounded(self, r: CompletionRequest | ChatCompletionRequest) -> bool:
        """Does this request run on a bounded KV cache (its own max_kv_tokens, or the engine's)?"""
        return r.max_kv_tokens is not None or self.engine.max_kv_tokens is not None

    def _params(self, r: CompletionRequest | ChatCompletionRequest, max_tokens: int, i: int,
                logprobs: int | None, prompt_logprobs: int | None,
                structured: StructuredOutputsParams | None = None,
                reasoning: ReasoningPlan | None = None) -> SamplingParams:
        kw: dict[str, Any] = dict(
            temperature=1.0 if r.temperature is None else r.temperature, max_tokens=max_tokens,
            presence_penalty=r.presence_penalty, frequency_penalty=r.frequency_penalty, min_tokens=r.min_tokens,
            stop=r.stop, stop_token_ids=r.stop_token_ids, ignore_eos=r.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=r.skip_special_tokens,
            include_stop_str_in_output=r.include_stop_str_in_output,
            seed=None if r.seed is None else r.seed + i, structured_outputs=structured,
            max_kv_tokens=r.max_kv_tokens, sink_tokens=r.sink_tokens, **(reasoning.sampling if reasoning else {}))
        for name in ("top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(r, name) is not None:
                kw[name] = getattr(r, name)
        bias = self._logit_bias(r)
        if bias:
            kw["logit_bias"] = bias
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            raise bad_request(str(e), param_of(e)) from None

    async def _submit(self, specs: list[tuple[list[int], SamplingParams, str]], reserved: int,
                      prompt_param: str, stream: bool = True, lora: str | None = None) -> Submission:
        """Start the requests; the engine validates them once (`Engine.add_request`), and its
        `ParameterError`s become 400s here, in vLLM's wording where vLLM has one. `lora`: `check_model`'s."""
        try:
            return await self.aengine.submit(specs, reserved, stream, lora=lora)
        except UnknownLoRAError as e:  # unloaded since check_model
            raise APIError(404, f"The model `{e.name}` does not exist.", "NotFoundError", "model",
                           "model_not_found") from None
        except PromptTooLongError as e:
            raise bad_request(str(e), "max_tokens") from None
        except ParameterError as e:
            raise self._engine_error(e, prompt_param) from None
        except (KvlmError, ValueError) as e:
            raise bad_request(str(e)) from None

    def _engine_error(self, e: ParameterError, prompt_param: str) -> APIError:
        v = self.vocab_size
        if e.param == "prompt_token_ids":
            return bad_request(f"token ids in {prompt_param} must be in [0, {v}) (out of vocabulary)", prompt_param)
        if e.param == "prompt":
            return bad_request(f"{prompt_param} must not be empty", prompt_param)
        if e.param == "stop_token_ids":
            return bad_request(f"stop_token_ids must be in [0, {v})", "stop_token_ids")
        return bad_request(str(e), e.param)

    def reserve(self, count: int) -> None:
        try:
            self.aengine.reserve(count)
        except QueueFullError as e:
            raise APIError(503, f"{e}; retry later", "service_unavailable", None, 503, {"Retry-After": "1"}) from None

    async def _sse(self, ctx: _Call, obj: str, r: CompletionRequest | ChatCompletionRequest,
                   chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """How every OpenAI SSE stream ends: the usage chunk when asked, an error event if the stream failed
        (`guarded`), then `[DONE]`."""

        async def body() -> AsyncIterator[str]:
            async for chunk in chunks:
                yield chunk
            if r.stream_options and r.stream_options.include_usage:
                yield sse({"id": ctx.id, "object": obj, "created": ctx.created, "model": ctx.model,
                           "choices": [], "usage": ctx.usage()})

        async for line in guarded(ctx, body(), lambda e: sse(e.body())):
            yield line
        yield "data: [DONE]\n\n"


async def guarded(ctx: _Call, lines: AsyncIterator[str], error_line: Callable[[APIError], str]) -> AsyncIterator[str]:
    """Every stream's guard, whatever its protocol: the lines, then one error event (in the protocol's shape,
    `error_line`) if they failed; the submission is closed (its requests aborted if unfinished) however it ends."""
    try:
        async for line in lines:
            yield line
    except APIError as e:
        yield error_line(e)
    except Exception:
        yield error_line(APIError(500, f"internal error (request {ctx.id})", "internal_server_error"))
    finally:
        ctx.sub.close()


@dataclass(slots=True)
class SSEStream:
    """A streaming answer: the `data:` lines, and the submission to close however the response ends."""

    lines: AsyncIterator[str]
    submission: Submission


class _Call:
    """One API call's engine requests: choice index = prompt index x n + i."""

    def __init__(self, request_id: str, kind: str, n: int, prompt_ids: list[list[int]], sub: Submission,
                 model: str) -> None:
        self.id, self.n, self.prompt_ids, self.sub = f"{kind}-{request_id}", n, prompt_ids, sub
        self.model = model  # the response's `model`: the LoRA adapter's name when the call named one (vLLM's)
        self.created = int(time.time())
        self.requests: list[Request] = sub.requests

    async def deltas(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        async for idx, d in self.sub:
            yield idx, d

    def stop_reason(self, d: StreamDelta) -> str | int | None:
        return self.requests[self._index(d)].stop_reason if d.finished else None

    def _index(self, d: StreamDelta) -> int:
        return self.sub.request_ids.index(d.request_id)

    def prompt_logprobs(self, idx: int) -> list[dict[int, float] | None] | None:
        return self.requests[idx].prompt_logprobs

    async def collect(self) -> list[_Choice]:
        """Every choice's whole answer (non-streaming); the submission is closed however this ends."""
        choices = [_Choice() for _ in self.requests]
        try:
            async for idx, d in self.sub:
                c = choices[idx]
                c.text += d.text
                c.token_ids += d.token_ids
                if d.logprobs:
                    c.logprobs += d.logprobs
                if d.finished:
                    c.finish_reason = d.finish_reason
                    c.stop_reason = self.requests[idx].stop_reason
        finally:
            self.sub.close()
        return choices

    def usage(self) -> dict[str, Any]:
        firsts = self.requests[:: self.n]  # one per prompt: the n copies share the prompt
        prompt = sum(r.num_prompt_tokens for r in firsts)
        completion = sum(r.num_output_tokens for r in self.requests)
        cached = sum(r.metrics.num_cached_tokens for r in firsts)
        held = sum(r.metrics.kv_bytes_held for r in self.requests)  # at each request's last step
        evicted = sum(r.metrics.num_evicted_tokens for r in self.requests)  # a bounded cache dropped them
        out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
               "prompt_tokens_details": {"cached_tokens": cached}, "kv_bytes_held": held,
               "kv_evicted_tokens": evicted}
        drafted = sum(r.metrics.spec_num_draft_tokens for r in self.requests)
        if drafted:  # speculative decoding, in OpenAI's predicted-outputs fields: drafts kept and refused
            accepted = sum(r.metrics.spec_num_accepted_tokens for r in self.requests)
            out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                                "rejected_prediction_tokens": drafted - accepted}
        return out
