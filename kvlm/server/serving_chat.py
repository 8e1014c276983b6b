"""`/v1/chat/completions`: messages rendered by the model's chat template (sandboxed), n choices, chat
logprobs (token, logprob, bytes, top_logprobs), a role chunk first when streamed; output constraints
(`response_format`, `structured_outputs`) and tool calls (`tools`, `tool_choice`, `parallel_tool_calls`:
see `chat_tools`), whose text is never streamed as content but as tool-call deltas by index; reasoning
models' `<think>` span as `reasoning` (and vLLM's older `reasoning_content`) beside the answer's content,
whole or as deltas, with its budget (`reasoning_effort`, `reasoning_budget`) and the template's
`chat_template_kwargs` (`enable_thinking`). Tool calls are parsed from the content part."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from kvlm.errors import KvlmError, ParameterError
from kvlm.server.chat_tools import ToolPlan, tool_plan
from kvlm.server.protocol import ChatCompletionRequest, bad_request
from kvlm.server.serving import OpenAIServing, SSEStream, _Call, _Choice, sse
from kvlm.server.structured_request import constraint_fields
from kvlm.structured.reasoning import ReasoningPlan, template_kwargs
from kvlm.structured.tool_parser import ToolCallStream
from kvlm.structured.tools import chat_inputs

# Template variables the server itself sets: a request's chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_KWARGS = {"messages", "add_generation_prompt", "tools", "documents", "bos_token", "eos_token"}


class ChatServing(OpenAIServing):
    def chat_prompt(self, r: ChatCompletionRequest, plan: ToolPlan | None = None) -> list[int]:
        return self.tokenizer.encode(self.render_chat(r, plan), add_special_tokens=False)

    def render_chat(self, r: ChatCompletionRequest, plan: ToolPlan | None = None) -> str:
        """The prompt text: the messages through the model's template, with the request's template kwargs."""
        if not r.messages:
            raise bad_request("messages must not be empty", "messages")
        msgs: list[dict[str, Any]] = []
        for i, m in enumerate(r.messages):
            if isinstance(m.content, list):
                parts = []
                for j, p in enumerate(m.content):
                    if p.type != "text" or p.text is None:
                        raise bad_request(f"content part type {p.type!r} is not supported (only text)",
                                          f"messages[{i}].content[{j}]")
                    parts.append(p.text)
                content: str | None = "".join(parts)
            else:
                content = m.content
            msg: dict[str, Any] = {"role": m.role, "content": content}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_calls:
                msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            msgs.append(msg)
        functions = plan.functions if plan is not None and plan.active else None
        msgs, kwargs = chat_inputs(msgs, functions, self.tokenizer.chat_template)
        extra = template_kwargs(self.tokenizer.chat_template, r.chat_template_kwargs)
        if clash := sorted(_RESERVED_TEMPLATE_KWARGS & extra.keys()):
            raise bad_request(f"chat_template_kwargs may not set {', '.join(clash)}", "chat_template_kwargs")
        try:
            return self.tokenizer.apply_chat_template(msgs, add_generation_prompt=r.add_generation_prompt,
                                                      **{**extra, **kwargs})
        except KvlmError as e:
            raise bad_request(str(e), "messages") from None

    def _reasoning(self, r: ChatCompletionRequest, prompt: str, constrained: bool) -> ReasoningPlan:
        try:
            return self.opts.reasoning.plan(prompt, r.reasoning_budget, r.reasoning_effort, constrained)
        except ParameterError as e:
            raise bad_request(str(e), e.param) from None

    def _check_chat(self, r: ChatCompletionRequest) -> ToolPlan | None:
        if r.chat_template is not None:
            raise bad_request("a request-supplied chat_template is refused; the model's own template is used",
                              "chat_template")
        if r.continue_final_message:
            raise bad_request("continue_final_message is not supported", "continue_final_message")
        if r.top_logprobs is not None:
            if not r.logprobs:
                raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
            if not 0 <= r.top_logprobs <= self.opts.max_logprobs:
                raise bad_request(f"top_logprobs must be in [0, {self.opts.max_logprobs}], got {r.top_logprobs}",
                                  "top_logprobs")
        plan = tool_plan(r, self.tokenizer.chat_template)
        if plan is not None and plan.active and constraint_fields(r):
            raise bad_request("tools with a tool_choice other than none cannot be combined with an output "
                              "constraint (response_format, structured_outputs)", "tool_choice")
        return plan

    async def start_chat(self, r: ChatCompletionRequest,
                         request_id: str) -> tuple[_Call, ToolPlan | None, ReasoningPlan]:
        """Check the request, render its prompt and start its engine requests: what every protocol that
        speaks in chat turns (chat completions, Anthropic's messages, OpenAI's Responses) does before shaping
        the answer."""
        lora = self.check_model(r.model)
        plan = self._check_chat(r)
        self._check_common(r, 1)
        if plan is not None and plan.active:
            constraint = plan.constraint()
            if constraint is not None:
                await self.compile_grammar(constraint, "tools")
        else:
            constraint = await self._constraint(r)
        self.reserve(r.n)
        try:
            text = self.render_chat(r, plan)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            # a lazy tool grammar (tool_choice auto) leaves free text before a call: no grammar from token one
            thinks = self._reasoning(r, text, constraint is not None and (plan is None or plan.mode != "auto"))
            limit = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
            mt = self._check_prompt(ids, limit, "messages", bounded=self._bounded(r))
            k = (r.top_logprobs or 0) if r.logprobs else None
            specs = [(ids, self._params(r, mt, i, k, None, constraint, thinks),
                      request_id if r.n == 1 else f"{request_id}-{i}") for i in range(r.n)]
        except BaseException:
            self.aengine.release(r.n)
            raise
        sub = await self._submit(specs, r.n, "messages", bool(r.stream), lora=lora)
        return _Call(request_id, "chatcmpl", r.n, [ids], sub, lora or self.model_name), plan, thinks

    async def chat(self, r: ChatCompletionRequest, request_id: str) -> dict[str, Any] | SSEStream:
        ctx, plan, thinks = await self.start_chat(r, request_id)
        if r.stream:
            chunks = self._stream_chat(r, ctx, plan, thinks)
            return SSEStream(self._sse(ctx, "chat.completion.chunk", r, chunks), ctx.sub)
        choices = await ctx.collect()  # closes the submission however it ends
        out = []
        for i, c in enumerate(choices):
            parts = thinks.parts(c.text)
            message, finish = {"role": "assistant", "content": parts.content}, c.finish_reason
            if plan is not None:
                message, calls = plan.message(parts.content)
                finish = plan.finish_reason(calls, finish)
            if self.opts.reasoning.parser is not None:
                message["reasoning"] = message["reasoning_content"] = parts.reasoning
                if parts.reasoning is not None and not message["content"]:
                    message["content"] = None  # all reasoning, no answer yet (vLLM's null)
            out.append({"index": i, "message": message,
                        "logprobs": self._chat_logprobs(c.token_ids, c.logprobs) if r.logprobs else None,
                        "finish_reason": finish, "stop_reason": c.stop_reason})
        return {"id": ctx.id, "object": "chat.completion", "created": ctx.created, "model": ctx.model,
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

    async def _stream_chat(self, r: ChatCompletionRequest, ctx: _Call, plan: ToolPlan | None,
                           thinks: ReasoningPlan) -> AsyncIterator[str]:
        state = [_Choice() for _ in range(r.n)]
        calls = [ToolCallStream() for _ in range(r.n)] if plan is not None and plan.active else None
        splits = [thinks.stream() for _ in range(r.n)]

        def chunk(choice: dict[str, Any]) -> str:
            return sse({"id": ctx.id, "object": "chat.completion.chunk", "created": ctx.created,
                        "model": ctx.model, "choices": [choice]})

        for i in range(r.n):
            yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})
        async for idx, d in ctx.deltas():
            c = state[idx]
            if r.logprobs and d.logprobs:
                c.token_ids += d.token_ids
                c.logprobs += d.logprobs
            text, reasoning, tool_deltas, finish = d.text, "", [], d.finish_reason
            split = splits[idx]
            if split is not None:  # the reasoning part first; tool calls are parsed from the content part
                reasoning, text = split.feed(d.text, final=d.finished)
            if calls is not None and plan is not None:
                text, tool_deltas = calls[idx].feed(text, final=d.finished)
                if not plan.parallel:
                    tool_deltas = [t for t in tool_deltas if t["index"] == 0]
                if d.finished:
                    finish = plan.finish_reason(calls[idx].calls, finish)
            if not text and not reasoning and not tool_deltas and not d.finished:
                continue
            lp = None
            if r.logprobs and c.token_ids:
                lp = self._chat_logprobs(c.token_ids, c.logprobs)
                c.token_ids, c.logprobs = [], []
            if reasoning:
                yield chunk({"index": idx, "delta": {"reasoning": reasoning, "reasoning_content": reasoning},
                             "logprobs": lp, "finish_reason": None})
                lp = None
            if tool_deltas:
                if text:
                    yield chunk({"index": idx, "delta": {"content": text}, "logprobs": lp, "finish_reason": None})
                    text, lp = "", None
                for t in tool_deltas:
                    yield chunk({"index": idx, "delta": {"tool_calls": [t]}, "logprobs": None, "finish_reason": None})
                lp = None
            if text or d.finished:
                yield chunk({"index": idx, "delta": {"content": text} if text else {}, "logprobs": lp,
                             "finish_reason": finish if d.finished else None,
                             "stop_reason": ctx.stop_reason(d)})
