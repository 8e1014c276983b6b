"""`/v1/chat/completions`: messages rendered by the model's chat template (sandboxed), n choices, chat
logprobs (token, logprob, bytes, top_logprobs), a role chunk first when streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from kvlm.errors import KvlmError
from kvlm.server.protocol import ChatCompletionRequest, bad_request
from kvlm.server.serving import OpenAIServing, SSEStream, _Call, _Choice, sse


class ChatServing(OpenAIServing):
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
        sub = await self._submit(specs, r.n, "messages", bool(r.stream))
        ctx = _Call(request_id, "chatcmpl", r.n, [ids], sub)
        if r.stream:
            return SSEStream(self._sse(ctx, "chat.completion.chunk", r, self._stream_chat(r, ctx)), sub)
        choices = await ctx.collect()  # closes the submission however it ends
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
