"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) as a translation of chat completions.

A request becomes a `ChatCompletionRequest` (`chat_request`): `system` a system turn, `tool_use` blocks an
assistant turn's tool_calls, `tool_result` blocks tool turns, `tools`' input_schema the function parameters,
`tool_choice` auto/any/tool/none OpenAI's auto/required/named/none, `stop_sequences` stop strings, `thinking`
enabled a `reasoning_budget` of its budget_tokens, disabled `enable_thinking=False` for the template. From there
`ChatServing.start_chat` does what it does for chat completions: the checks, the chat template, the tool
grammar, the engine requests. This module only shapes the answer: content blocks (a thinking block with the
reasoning where the request's `ReasoningPlan` split one off, then text and tool_use with the parsed input, from
the content part), `stop_reason`, Anthropic's usage (input tokens the prefix cache served are
`cache_read_input_tokens`), and the SSE event sequence (message_start, content_block_start, ping,
content_block_delta as text_delta / thinking_delta + signature_delta / input_json_delta, content_block_stop,
message_delta, message_stop). kvlm signs nothing: a thinking block's signature is "". Errors from the shared
checks keep their wording with Anthropic's field names; their shape is `protocol_messages.anthropic_error`'s.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvlm.server.chat_tools import ToolPlan, tool_plan
from kvlm.server.protocol import APIError, ChatCompletionRequest, bad_request
from kvlm.server.protocol_messages import (
    MESSAGES_PATH,
    CountTokensRequest,
    Message,
    MessagesRequest,
    TextBlock,
    anthropic_error,
)
from kvlm.server.serving import SSEStream, _Call, guarded
from kvlm.server.serving_chat import ChatServing
from kvlm.structured.reasoning import ReasoningPlan, ReasoningSplit
from kvlm.structured.tool_parser import ToolCallStream

# Shared checks' field names -> Anthropic's (the error message is what Anthropic's error body carries).
_RENAMES = [(re.compile(r"\bstop\b( strings)?"), "stop_sequences"),
            (re.compile(r"(tools\[\d+\])\.function\.name"), r"\1.name"),
            (re.compile(r"'max_tokens' or 'max_completion_tokens'"), "max_tokens")]


def _renamed(e: APIError) -> APIError:
    msg = e.message
    for pattern, repl in _RENAMES:
        msg = pattern.sub(repl, msg)
    return APIError(e.status, msg, e.type, e.param, e.code, e.headers)


def _text(blocks: str | list[TextBlock]) -> str:
    return blocks if isinstance(blocks, str) else "".join(b.text for b in blocks)


def _turns(m: Message, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: an assistant turn (text + tool_calls), or user turns with each
    tool_result as a tool message, in the order the blocks come."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out: list[dict[str, Any]] = []
    texts: list[dict[str, str]] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        if b.type == "text":
            texts.append({"type": "text", "text": b.text})
        elif b.type == "tool_use":
            if m.role != "assistant":
                raise bad_request(f"{where}: tool_use blocks belong to assistant messages", where)
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
        elif b.type == "tool_result":
            if m.role != "user":
                raise bad_request(f"{where}: tool_result blocks belong to user messages", where)
            if texts:
                out.append({"role": "user", "content": texts})
                texts = []
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)})
        # thinking / redacted_thinking: an earlier turn's reasoning, which chat templates do not render
    if m.role == "assistant":
        return [{"role": "assistant", "content": texts or None, **({"tool_calls": calls} if calls else {})}]
    if texts or not out:
        out.append({"role": "user", "content": texts})
    return out


def chat_request(r: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completions request an Anthropic request is (fields checked here are Anthropic's own rules)."""
    if not r.messages:
        raise bad_request("messages: at least one message is required", "messages")
    if r.messages[-1].role == "assistant":
        raise bad_request("messages: a final assistant message (prefill) is not supported; end with a user message",
                          "messages")
    msgs = [{"role": "system", "content": _text(r.system)}] if r.system else []
    for i, m in enumerate(r.messages):
        msgs += _turns(m, i)
    body: dict[str, Any] = {"model": r.model, "messages": msgs}
    if r.tools is not None:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in r.tools]
    tc = r.tool_choice
    if tc is not None:
        if (tc.type == "tool") != (tc.name is not None):
            raise bad_request("tool_choice: name is required for type tool, and only for it", "tool_choice")
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none",
                               "tool": {"type": "function", "function": {"name": tc.name}}}[tc.type]
        body["parallel_tool_calls"] = not tc.disable_parallel_tool_use
    th = r.thinking  # adaptive: the server's default budget
    if th is not None and th.type == "enabled":
        if th.budget_tokens is None or th.budget_tokens < 0:
            raise bad_request("thinking.budget_tokens: an integer >= 0 is required when thinking is enabled, got "
                              f"{th.budget_tokens}", "thinking")
        body["reasoning_budget"] = th.budget_tokens
    elif th is not None and th.type == "disabled":
        body["chat_template_kwargs"] = {"enable_thinking": False}  # templates that take it close the span
    if isinstance(r, MessagesRequest):
        if r.temperature is not None and not 0 <= r.temperature <= 1:
            raise bad_request(f"temperature: must be in [0, 1], got {r.temperature}", "temperature")
        body.update(max_tokens=r.max_tokens, stop=r.stop_sequences, stream=r.stream, temperature=r.temperature,
                    top_p=r.top_p, top_k=r.top_k)
    return ChatCompletionRequest.model_validate(body)


def _tool_id(call_id: str) -> str:
    """Anthropic's tool_use id for a parsed call's id (`call_<24>` -> `toolu_<24>`)."""
    return "toolu_" + call_id.removeprefix("call_")


def _stop(finish: str | None, stop_reason: str | int | None, called: bool) -> dict[str, Any]:
    """Anthropic's stop_reason (+ the stop_sequence that matched) for how the engine ended the answer."""
    if finish == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if called:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if isinstance(stop_reason, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _usage(ctx: _Call, drafts: bool = True) -> dict[str, Any]:
    """Anthropic's usage; with speculative decoding also `output_tokens_details` (kvlm's: drafts kept and
    refused, `accepted_prediction_tokens` / `rejected_prediction_tokens`, as in chat completions' usage)."""
    u = ctx.usage()
    cached = u["prompt_tokens_details"]["cached_tokens"]
    out: dict[str, Any] = {"input_tokens": u["prompt_tokens"] - cached, "output_tokens": u["completion_tokens"],
                           "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}
    if drafts and "completion_tokens_details" in u:
        out["output_tokens_details"] = u["completion_tokens_details"]
    return out


def event(kind: str, obj: dict[str, Any]) -> str:
    """One SSE event as Anthropic sends it: an `event:` line naming the type, then the data."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **obj}, ensure_ascii=False)}\n\n"


def _error_event(e: APIError) -> str:
    return event("error", {"error": anthropic_error(e)[1]["error"]})


def content_blocks(text: str, plan: ToolPlan | None, thinks: ReasoningPlan | None = None) -> list[dict[str, Any]]:
    """A whole answer's content: a thinking block where a reasoning span was opened (even an empty one), then
    from the content part its text (none when empty, or only whitespace before a call) and a tool_use block per
    call the plan allows, with the parsed input."""
    parts = thinks.parts(text) if thinks is not None else ReasoningSplit(None, text)
    thought = [] if parts.reasoning is None else [{"type": "thinking", "thinking": parts.reasoning, "signature": ""}]
    message, calls = plan.message(parts.content) if plan is not None else ({"content": parts.content}, [])
    content = [{"type": "text", "text": message["content"]}] if message["content"] else []
    return thought + content + [{"type": "tool_use", "id": _tool_id(t.id), "name": t.name,
                                 "input": json.loads(t.arguments)} for t in calls]


class BlockStream:
    """One answer's text deltas as Anthropic's content-block events, which rebuild `content_blocks` of the whole
    text exactly: the reasoning as a thinking block (opened when `ReasoningStream` sees the span open, its text
    as thinking_delta, closed by an empty signature_delta when the span ends), then from the content part the
    text as one text block (opened at its first character), then each call as a tool_use block whose input
    JSON comes as one input_json_delta; one ping after the first block opens (or at the end
    when none did). With tools, leading whitespace is held until text follows it: before a call it is
    dropped, as the whole answer drops it. Calls are found by `ToolCallStream`, as chat completions finds them."""

    def __init__(self, plan: ToolPlan | None, thinks: ReasoningPlan | None = None) -> None:
        self.reasoning = thinks.stream() if thinks is not None else None
        self.thinking = False  # the thinking block is open
        self.calls = ToolCallStream() if plan is not None and plan.active else None
        self.parallel = plan is None or plan.parallel
        self.index, self.held = 0, ""  # the open block's index; whitespace not yet sent
        self.started = self.text_open = self.pinged = False

    @property
    def called(self) -> bool:
        return self.calls is not None and bool(self.calls.calls)

    def _start(self, block: dict[str, Any]) -> list[str]:
        out = [event("content_block_start", {"index": self.index, "content_block": block})]
        if not self.pinged:
            out.append(event("ping", {}))
            self.pinged = True
        return out

    def feed(self, text: str, final: bool) -> list[str]:
        self.started = True
        out: list[str] = []
        tools: list[dict[str, Any]] = []
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text, final=final)
            if self.reasoning.opened and not self.thinking and self.index == 0:  # a span opens only first
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
                self.thinking = True
            if thought:
                out.append(event("content_block_delta", {"index": self.index,
                                                         "delta": {"type": "thinking_delta", "thinking": thought}}))
            if self.thinking and (final or self.reasoning.mode == "content"):
                out += [event("content_block_delta", {"index": self.index,
                                                      "delta": {"type": "signature_delta", "signature": ""}}),
                        event("content_block_stop", {"index": self.index})]
                self.index, self.thinking = self.index + 1, False
        if self.calls is not None:
            text, tools = self.calls.feed(text, final=final)
            if not self.parallel:
                tools = [t for t in tools if t["index"] == 0]
            if not self.text_open:
                self.held, text = ("", self.held + text) if (self.held + text).strip() else (self.held + text, "")
                if final and not self.calls.calls:
                    text, self.held = self.held + text, ""
        if text:
            if not self.text_open:
                out += self._start({"type": "text", "text": ""})
                self.text_open = True
            out.append(event("content_block_delta", {"index": self.index,
                                                     "delta": {"type": "text_delta", "text": text}}))
        for t in tools:
            if "id" in t:  # a call's first delta: its id and name; the arguments come whole in the next one
                if self.text_open:
                    out.append(event("content_block_stop", {"index": self.index}))
                    self.index, self.text_open = self.index + 1, False
                out += self._start({"type": "tool_use", "id": _tool_id(t["id"]), "name": t["function"]["name"],
                                    "input": {}})
            else:
                out.append(event("content_block_delta", {"index": self.index, "delta": {
                    "type": "input_json_delta", "partial_json": t["function"]["arguments"]}}))
                out.append(event("content_block_stop", {"index": self.index}))
                self.index += 1
        if final:
            if self.text_open:
                out.append(event("content_block_stop", {"index": self.index}))
            if not self.pinged:
                out.append(event("ping", {}))
        return out


class MessagesServing:
    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    async def create(self, r: MessagesRequest, request_id: str) -> dict[str, Any] | SSEStream:
        try:
            ctx, plan, thinks = await self.chat.start_chat(chat_request(r), request_id)
        except APIError as e:
            raise _renamed(e) from None
        ctx.id = f"msg_{request_id}"  # Anthropic's id shape (chat's is chatcmpl-<request id>)
        if r.stream:
            return SSEStream(guarded(ctx, self._stream(ctx, plan, thinks), _error_event), ctx.sub)
        c = (await ctx.collect())[0]  # closes the submission however it ends
        content = content_blocks(c.text, plan, thinks)
        called = any(b["type"] == "tool_use" for b in content)
        return {"id": ctx.id, "type": "message", "role": "assistant", "model": ctx.model,
                "content": content, **_stop(c.finish_reason, c.stop_reason, called), "usage": _usage(ctx)}

    def count_tokens(self, r: CountTokensRequest) -> dict[str, int]:
        """The prompt's length as `create` renders it (tools included), before any prefix cache."""
        try:
            cr = chat_request(r)
            self.chat.check_model(cr.model)
            plan = tool_plan(cr, self.chat.tokenizer.chat_template)
            return {"input_tokens": len(self.chat.chat_prompt(cr, plan))}
        except APIError as e:
            raise _renamed(e) from None

    async def _stream(self, ctx: _Call, plan: ToolPlan | None, thinks: ReasoningPlan) -> AsyncIterator[str]:
        blocks = BlockStream(plan, thinks)
        async for _, d in ctx.deltas():
            if not blocks.started:  # at the first delta the prefix cache has been asked: usage is known
                yield event("message_start", {"message": {
                    "id": ctx.id, "type": "message", "role": "assistant", "model": ctx.model,
                    "content": [], "stop_reason": None, "stop_sequence": None,
                    "usage": {**_usage(ctx, drafts=False), "output_tokens": 0}}})  # tokens: in message_delta
            for line in blocks.feed(d.text, final=d.finished):
                yield line
            if d.finished:
                yield event("message_delta", {"delta": _stop(d.finish_reason, ctx.stop_reason(d), blocks.called),
                                              "usage": _usage(ctx)})
                yield event("message_stop", {})


def add_messages_routes(route: Callable[..., None], chat: ChatServing) -> None:
    """`POST /v1/messages` and `/v1/messages/count_tokens`, through the app's `route` (body limit, schema,
    refusal while the engine is down or draining, the answer unless the client left)."""
    messages = MessagesServing(chat)

    async def count_tokens(r: CountTokensRequest, request_id: str) -> dict[str, int]:
        return messages.count_tokens(r)

    route(MESSAGES_PATH, MessagesRequest, messages.create)
    route(MESSAGES_PATH + "/count_tokens", CountTokensRequest, count_tokens)
