"""The OpenAI endpoints' behaviour: request -> checks -> engine requests -> response or SSE chunks.

`OpenAIServing` turns a validated `CompletionRequest` / `ChatCompletionRequest` into engine requests
(prompts x n, seeded `seed + i`), checks what the engine cannot know (the served model name, caps on n,
logprobs and stop strings, unsupported fields, the context length with vLLM's wording), and shapes the
engine's deltas into OpenAI responses: one JSON body, or `data: {json}` chunks ending in `data: [DONE]`.
It knows nothing about HTTP transport; `app` does the routing, auth, body limits and disconnects.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvlm.engine.engine import Engine
from kvlm.errors import KvlmError, ParameterError, PromptTooLongError
from kvlm.outputs import StreamDelta
from kvlm.request import Request
from kvlm.sampling_params import SamplingParams
from kvlm.server.async_engine import AsyncEngine, QueueFullError, Submission
from kvlm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
)

_SAMPLING_FIELDS = {f for f in SamplingParams.__dataclass_fields__ if f != "stop_strings"}


@dataclass(slots=True)
class ServingOptions:
    served_model_names: list[str]
    max_logprobs: int = 20
    max_n: int = 16
    max_stop: int = 16
    max_stop_len: int = 256
    max_prompts: int = 256  # engine requests one call may create (prompts x n)


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
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.opts.served_model_names:
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
            raise bad_request(f"temperature must be in [0, 2], got {r.temperature}", "temperature")
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

    def _check_prompt(self, ids: list[int], max_tokens: int | None, param: str) -> int:
        """The max_tokens to use (default: the rest of the context), and vLLM's rule that prompt + max_tokens
        must fit the context (the engine would stop at the context's end instead), in vLLM's wording. The
        prompt's ids are the engine's check (`_submit`)."""
        n, m = self.max_model_len, len(ids)
        if m >= n:
            raise bad_request(
                f"This model's maximum context length is {n} tokens. However, your request has {m} input tokens. "
                "Please reduce the length of the input messages.", param, "context_length_exceeded")
        if max_tokens is None:
            return n - m
        if max_tokens < 1:
            raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        if m + max_tokens > n:
            raise bad_request(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
                f"length is {n} tokens and your request has {m} input tokens ({max_tokens} > {n} - {m}).",
                "max_tokens", "context_length_exceeded")
        return max_tokens

    def _params(self, r: CompletionRequest | ChatCompletionRequest, max_tokens: int, i: int,
                logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        kw: dict[str, Any] = dict(
            temperature=1.0 if r.temperature is None else r.temperature, max_tokens=max_tokens,
            presence_penalty=r.presence_penalty, frequency_penalty=r.frequency_penalty, min_tokens=r.min_tokens,
            stop=r.stop, stop_token_ids=r.stop_token_ids, ignore_eos=r.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=r.skip_special_tokens,
            include_stop_str_in_output=r.include_stop_str_in_output,
            seed=None if r.seed is None else r.seed + i)
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
                      prompt_param: str) -> Submission:
        """Start the requests; the engine validates them once (`Engine.add_request`), and its
        `ParameterError`s become 400s here, in vLLM's wording where vLLM has one."""
        try:
            return await self.aengine.submit(specs, reserved)
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

    # ------------------------------------------------------------------------------------- completions
    def completion_prompts(self, r: CompletionRequest) -> list[list[int] | str]:
        p = r.prompt
        if isinstance(p, str):
            prompts: list[list[int] | str] = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]  # type: ignore[arg-type]
        else:
            prompts = list(p)  # type: ignore[arg-type]
        if not prompts or any(len(x) == 0 for x in prompts):
            raise bad_request("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        return prompts

    async def completions(self, r: CompletionRequest, request_id: str) -> dict[str, Any] | SSEStream:
        self.check_model(r.model)
        if r.suffix is not None:
            raise bad_request("suffix is not supported", "suffix")
        if r.logprobs is not None and not 0 <= r.logprobs <= self.opts.max_logprobs:
            raise bad_request(f"logprobs must be in [0, {self.opts.max_logprobs}], got {r.logprobs}", "logprobs")
        prompts = self.completion_prompts(r)
        self._check_common(r, len(prompts))
        count = len(prompts) * r.n
        self.reserve(count)
        try:
            specs, prompt_ids = [], []
            for pi, p in enumerate(prompts):
                ids = self.tokenizer.encode(p) if isinstance(p, str) else p
                mt = self._check_prompt(ids, r.max_tokens, "prompt")
                prompt_ids.append(ids)
                for i in range(r.n):
                    plp = r.logprobs if r.echo and r.logprobs is not None else None
                    rid = request_id if count == 1 else f"{request_id}-{pi * r.n + i}"
                    specs.append((ids, self._params(r, mt, i, r.logprobs, plp), rid))
        except BaseException:
            self.aengine.release(count)
            raise
        sub = await self._submit(specs, count, "prompt")
        ctx = _Call(request_id, "cmpl", r.n, prompt_ids, sub)
        if r.stream:
            return SSEStream(self._sse(ctx, "text_completion", r, self._stream_completion(r, ctx)), sub)
        try:
            choices = await ctx.collect()
        finally:
            sub.close()
        out = []
        for idx, c in enumerate(choices):
            ids = prompt_ids[idx // r.n]
            text, lp = c.text, None
            prefix = self.tokenizer.decode(ids, skip_special_tokens=False) if r.echo else ""
            if r.logprobs is not None:
                lp = self._completion_logprobs(c.token_ids, c.logprobs, len(prefix))
                if r.echo:
                    plp = ctx.prompt_logprobs(idx) or [None] * len(ids)
                    lp = self._merge_echo(self._completion_logprobs(ids, plp, 0), lp)
            out.append({"index": idx, "text": prefix + text, "logprobs": lp, "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason})
        return {"id": ctx.id, "object": "text_completion", "created": ctx.created, "model": self.model_name,
                "choices": out, "usage": ctx.usage()}

    def _completion_logprobs(self, ids: list[int], lps: list[dict[int, float] | None], offset: int) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for t, d in zip(ids, lps):
            s = self.token_text(t)
            tokens.append(s)
            token_lps.append(None if d is None else d[t])
            tops.append(None if d is None else self._top_by_text(d))
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _top_by_text(self, d: dict[int, float]) -> dict[str, float]:
        """OpenAI keys top logprobs by token text; distinct ids with the same text keep the larger value."""
        out: dict[str, float] = {}
        for k, v in sorted(d.items(), key=lambda kv: kv[1]):
            out[self.token_text(k)] = v
        return out

    @staticmethod
    def _merge_echo(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        return {k: a[k] + b[k] for k in a}

    async def _sse(self, ctx: _Call, obj: str, r: CompletionRequest | ChatCompletionRequest,
                   chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """How every SSE stream ends: the usage chunk when asked, an error event if the stream failed, then
        `[DONE]`; the submission is closed (its requests aborted if unfinished) whatever happens."""
        try:
            async for chunk in chunks:
                yield chunk
            if r.stream_options and r.stream_options.include_usage:
                yield sse({"id": ctx.id, "object": obj, "created": ctx.created, "model": self.model_name,
                           "choices": [], "usage": ctx.usage()})
        except APIError as e:
            yield sse(e.body())
        except Exception:
            yield sse(APIError(500, f"internal error (request {ctx.id})", "internal_server_error").body())
        finally:
            ctx.sub.close()
        yield "data: [DONE]\n\n"

    async def _stream_completion(self, r: CompletionRequest, ctx: _Call) -> AsyncIterator[str]:
        state = [_Choice() for _ in range(len(ctx.prompt_ids) * r.n)]
        async for idx, d in ctx.deltas():
            c = state[idx]
            text = d.text
            lp = None
            if r.echo and not c.started:
                ids = ctx.prompt_ids[idx // r.n]
                prefix = self.tokenizer.decode(ids, skip_special_tokens=False)
                text = prefix + text
                if r.logprobs is not None:
                    plp = d.prompt_logprobs or [None] * len(ids)
                    lp = self._completion_logprobs(ids, plp, 0)
                c.offset = len(prefix)
            c.started = True
            if r.logprobs is not None and d.logprobs:
                c.token_ids += d.token_ids
                c.logprobs += d.logprobs
            if not text and not d.finished:
                continue  # never an empty text chunk; the token's logprobs go with the next one
            if r.logprobs is not None and c.token_ids:
                new = self._completion_logprobs(c.token_ids, c.logprobs, c.offset)
                c.offset += sum(len(s) for s in new["tokens"])
                lp = new if lp is None else self._merge_echo(lp, new)
                c.token_ids, c.logprobs = [], []
            choice = {"index": idx, "text": text, "logprobs": lp, "finish_reason": d.finish_reason,
                      "stop_reason": ctx.stop_reason(d)}
            yield sse({"id": ctx.id, "object": "text_completion", "created": ctx.created,
                       "model": self.model_name, "choices": [choice]})

    # -------------------------------------------------------------------------------------------- chat
    def chat_prompt(self, r: ChatCompletionRequest) -> list[int]:
        if not r.messages:
            raise bad_request("messages must not be empty", "messages")
        msgs = []
        for i, m in enumerate(r.messages):
            if isinstance(m.content, list):
                parts = []
                for j, p in enumerate(m.content):
                    if p.type != "text" or p.text is None:
                        raise bad_request(f"content part type {p.type!r} is not supported (only text)",
                                          f"messages[{i}].content[{j}]")
                    parts.append(p.text)
                content = "".join(parts)
            else:
                content = m.content
            msg = {"role": m.role, "content": content}
            if m.name is not None:
                msg["name"] = m.name
            msgs.append(msg)
        try:
            text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=r.add_generation_prompt)
        except KvlmError as e:
            raise bad_request(str(e), "messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _check_chat(self, r: ChatCompletionRequest) -> None:
        if r.chat_template is not None:
            raise bad_request("a request-supplied chat_template is refused; the model's own template is used",
                              "chat_template")
        if r.tools or r.functions:
            raise bad_request("tools are not supported", "tools")
        if r.tool_choice not in (None, "none"):
            raise bad_request("tool_choice is not supported", "tool_choice")
        if r.response_format is not None and r.response_format.get("type", "text") != "text":
            raise bad_request("response_format other than text is not supported", "response_format")
        if r.continue_final_message:
            raise bad_request("continue_final_message is not supported", "continue_final_message")
        if r.top_logprobs is not None:
            if not r.logprobs:
                raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
            if not 0 <= r.top_logprobs <= self.opts.max_logprobs:
                raise bad_request(f"top_logprobs must be in [0, {self.opts.max_logprobs}], got {r.top_logprobs}",
                                  "top_logprobs")

    async def chat(self, r: ChatCompletionRequest, request_id: str) -> dict[str, Any] | SSEStream:
        self.check_model(r.model)
        self._check_chat(r)
        self._check_common(r, 1)
        self.reserve(r.n)
        try:
            ids = self.chat_prompt(r)
            limit = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
            mt = self._check_prompt(ids, limit, "messages")
            k = (r.top_logprobs or 0) if r.logprobs else None
            specs = [(ids, self._params(r, mt, i, k, None), request_id if r.n == 1 else f"{request_id}-{i}")
                     for i in range(r.n)]
        except BaseException:
            self.aengine.release(r.n)
            raise
        sub = await self._submit(specs, r.n, "messages")
        ctx = _Call(request_id, "chatcmpl", r.n, [ids], sub)
        if r.stream:
            return SSEStream(self._sse(ctx, "chat.completion.chunk", r, self._stream_chat(r, ctx)), sub)
        try:
            choices = await ctx.collect()
        finally:
            sub.close()
        out = [{"index": i, "message": {"role": "assistant", "content": c.text},
                "logprobs": self._chat_logprobs(c.token_ids, c.logprobs) if r.logprobs else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for i, c in enumerate(choices)]
        return {"id": ctx.id, "object": "chat.completion", "created": ctx.created, "model": self.model_name,
                "choices": out, "usage": ctx.usage()}

    def _chat_logprobs(self, ids: list[int], lps: list[dict[int, float]]) -> dict[str, Any]:
        def entry(t: int, v: float) -> dict[str, Any]:
            s = self.token_text(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

        content = []
        for t, d in zip(ids, lps):
            tops = sorted(((k, v) for k, v in d.items()), key=lambda kv: -kv[1])
            content.append({**entry(t, d[t]), "top_logprobs": [entry(k, v) for k, v in tops if k != t or len(tops)]})
        return {"content": content}

    async def _stream_chat(self, r: ChatCompletionRequest, ctx: _Call) -> AsyncIterator[str]:
        state = [_Choice() for _ in range(r.n)]

        def chunk(choice: dict[str, Any]) -> str:
            return sse({"id": ctx.id, "object": "chat.completion.chunk", "created": ctx.created,
                        "model": self.model_name, "choices": [choice]})

        for i in range(r.n):
            yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})
        async for idx, d in ctx.deltas():
            c = state[idx]
            if r.logprobs and d.logprobs:
                c.token_ids += d.token_ids
                c.logprobs += d.logprobs
            if not d.text and not d.finished:
                continue
            lp = None
            if r.logprobs and c.token_ids:
                lp = self._chat_logprobs(c.token_ids, c.logprobs)
                c.token_ids, c.logprobs = [], []
            yield chunk({"index": idx, "delta": {"content": d.text} if d.text else {}, "logprobs": lp,
                         "finish_reason": d.finish_reason, "stop_reason": ctx.stop_reason(d)})


@dataclass(slots=True)
class SSEStream:
    """A streaming answer: the `data:` lines, and the submission to close however the response ends."""

    lines: AsyncIterator[str]
    submission: Submission


class _Call:
    """One API call's engine requests: choice index = prompt index x n + i."""

    def __init__(self, request_id: str, kind: str, n: int, prompt_ids: list[list[int]], sub: Submission) -> None:
        self.id, self.n, self.prompt_ids, self.sub = f"{kind}-{request_id}", n, prompt_ids, sub
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
        choices = [_Choice() for _ in self.requests]
        async for idx, d in self.sub:
            c = choices[idx]
            c.text += d.text
            c.token_ids += d.token_ids
            if d.logprobs:
                c.logprobs += d.logprobs
            if d.finished:
                c.finish_reason = d.finish_reason
                c.stop_reason = self.requests[idx].stop_reason
        return choices

    def usage(self) -> dict[str, Any]:
        firsts = self.requests[:: self.n]  # one per prompt: the n copies share the prompt
        prompt = sum(r.num_prompt_tokens for r in firsts)
        completion = sum(r.num_output_tokens for r in self.requests)
        cached = sum(r.metrics.num_cached_tokens for r in firsts)
        held = sum(r.metrics.kv_bytes_held for r in self.requests)  # at each request's last step
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}, "kv_bytes_held": held}
