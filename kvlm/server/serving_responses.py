"""`/v1/responses`: OpenAI's Responses API as a translation onto chat completions' machinery.

A request becomes one `ChatCompletionRequest` (`input` items -> messages, `instructions` -> a system
message, flat `tools` -> chat tools, `text.format` -> `response_format`, `max_output_tokens` -> `max_tokens`),
so the chat template, tool prompt and grammar, output constraints, checks and engine submission are the
ones `ChatServing.start_chat` runs for chat; an error they raise is renamed to the Responses field it came
from. What comes back (whole or streamed) is shaped into output items: a `message` with `output_text`,
then one `function_call` item per call. Streams carry the documented typed events, each numbered by
`sequence_number`, and end with `response.completed` (or `response.incomplete` when `max_output_tokens`
cut the answer).

`store` (default true, as OpenAI) keeps a response and its conversation in `ResponseStore`, a
count-bounded LRU (`--max-stored-responses`). A request naming `previous_response_id` renders that
conversation, then its own input, so its prompt starts with the previous turn's tokens and the prefix cache
serves their KV blocks (`usage.input_tokens_details.cached_tokens`). There is no background mode: every
response finishes within its request, so `cancel` answers a stored one with OpenAI's 400.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import count
from typing import Any

from pydantic import ValidationError

from kvlm.server.chat_tools import ToolPlan
from kvlm.server.protocol import APIError, ChatCompletionRequest, bad_request, validation_error
from kvlm.server.protocol_responses import InputContent, InputItem, ResponsesRequest
from kvlm.server.serving import SSEStream, _Call, guarded
from kvlm.server.serving_chat import ChatServing
from kvlm.structured.tool_parser import ToolCall, ToolCallStream

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")
# What chat's checks call a field -> its Responses name, in params and messages (longest first).
_RENAMES = (("'max_tokens' or 'max_completion_tokens'", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
            ("response_format.json_schema.schema", "text.format.schema"),
            ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
            (".function.name", ".name"), ("messages", "input"))


def not_found(rid: str, param: str) -> APIError:
    return APIError(404, f"Response with id '{rid}' not found.", "invalid_request_error", param,
                    "response_not_found")


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]
    messages: list[dict[str, Any]]  # the conversation through this response's output, without instructions


class ResponseStore:
    """Stored responses by id; past `capacity` the least recently used goes (0: nothing is kept)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, rid: str, item: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._items[rid] = item
        self._items.move_to_end(rid)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, rid: str, param: str = "response_id") -> StoredResponse:
        item = self._items.get(rid)
        if item is None:
            raise not_found(rid, param)
        self._items.move_to_end(rid)
        return item

    def pop(self, rid: str) -> StoredResponse:
        item = self._items.pop(rid, None)
        if item is None:
            raise not_found(rid, "response_id")
        return item


@contextmanager
def responses_names() -> Iterator[None]:
    """Errors raised inside name the Responses field, not the chat field it was translated to."""
    try:
        yield
    except APIError as e:
        for old, new in _RENAMES:
            e.message = e.message.replace(old, new)
            if e.param:
                e.param = e.param.replace(old, new)
        raise


def _text(content: str | list[InputContent] | None, where: str) -> str | None:
    if not isinstance(content, list):
        return content
    for j, p in enumerate(content):
        if p.type not in _TEXT_PARTS or p.text is None:
            raise bad_request(f"content part type {p.type!r} is not supported (only input_text, output_text)",
                              f"{where}[{j}]")
    return "".join(p.text or "" for p in content)


def input_messages(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """`input` as chat messages: a string is one user turn; consecutive `function_call` items join the
    assistant turn before them (as a chat answer holds its content and its calls in one message), each
    `function_call_output` is a `tool` turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, it in enumerate(items):
        where = f"input[{i}]"
        if it.type == "message":
            if it.role not in _ROLES:
                raise bad_request(f"{where}.role must be user, assistant, system or developer, got {it.role!r}",
                                  f"{where}.role")
            out.append({"role": _ROLES[it.role], "content": _text(it.content, f"{where}.content") or ""})
        elif it.type == "function_call":
            for name in ("call_id", "name", "arguments"):
                if getattr(it, name) is None:
                    raise bad_request(f"{where}: a function_call item needs {name}", f"{where}.{name}")
            call = {"id": it.call_id, "type": "function", "function": {"name": it.name, "arguments": it.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif it.type == "function_call_output":
            if it.call_id is None or it.output is None:
                raise bad_request(f"{where}: a function_call_output item needs call_id and output", where)
            out.append({"role": "tool", "tool_call_id": it.call_id, "content": _text(it.output, f"{where}.output")})
        else:
            raise bad_request(f"input item type {it.type!r} is not supported (message, function_call, "
                              "function_call_output)", f"{where}.type")
    return out


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools ({type, name, description, parameters, strict}) in chat's shape."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise bad_request(f"tools[{i}]: tool type {kind!r} is not supported (only function)", f"tools[{i}].type")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                      "tool_choice")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (whose checks then compile it)."""
    if not text:
        return None
    extra = sorted(set(text) - {"format"})
    if extra:
        raise bad_request(f"text: unsupported key(s) {extra} (supported: format)", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format")
    if fmt.get("type") != "json_schema":
        return fmt  # text, json_object; any other type is chat's 400
    js = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": js}


def _refuse_unsupported(r: ResponsesRequest) -> None:
    if r.background:
        raise bad_request("background responses are not supported (every response finishes within its request)",
                          "background")
    if r.reasoning is not None:
        raise bad_request("reasoning is not supported", "reasoning")
    if r.include:
        raise bad_request(f"include is not supported, got {r.include}", "include")
    if r.truncation not in (None, "disabled"):
        raise bad_request("truncation must be disabled (a prompt longer than the context is a 400)", "truncation")
    if r.top_logprobs:
        raise bad_request("top_logprobs is not supported", "top_logprobs")


def _ids(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else ""}


def usage(ctx: _Call) -> dict[str, Any]:
    u = ctx.usage()
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": u["prompt_tokens_details"],
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


def assistant_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The output items as the chat message they render as in the next turn's prompt."""
    msg: dict[str, Any] = {"role": "assistant", "content": None}
    for it in items:
        if it["type"] == "message":
            msg["content"] = it["content"][0]["text"]
        else:
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            msg.setdefault("tool_calls", []).append(call)
    return msg


@dataclass(slots=True)
class _Turn:
    """One response being made: its id, its request, the conversation it continues and adds."""

    id: str
    r: ResponsesRequest
    created_at: int
    messages: list[dict[str, Any]]  # previous conversation + this input, without instructions


class ResponsesServing(ChatServing):
    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.store = ResponseStore(self.opts.max_stored_responses)

    def chat_request(self, r: ResponsesRequest) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
        """The chat request this response runs as, and its conversation without instructions."""
        _refuse_unsupported(r)
        prev = r.previous_response_id
        history = self.store.get(prev, "previous_response_id").messages if prev is not None else []
        messages = history + input_messages(r.input)
        system = [{"role": "system", "content": r.instructions}] if r.instructions is not None else []
        fields = {"model": r.model, "messages": system + messages, "max_tokens": r.max_output_tokens,
                  "temperature": r.temperature, "top_p": r.top_p, "tools": chat_tools(r.tools),
                  "tool_choice": chat_tool_choice(r.tool_choice), "parallel_tool_calls": r.parallel_tool_calls,
                  "response_format": response_format(r.text), "stream": r.stream, "seed": r.seed, "top_k": r.top_k}
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None}), messages
        except ValidationError as e:
            raise validation_error(e) from None

    async def create(self, r: ResponsesRequest, request_id: str) -> dict[str, Any] | SSEStream:
        with responses_names():
            chat, messages = self.chat_request(r)
            ctx, plan = await self.start_chat(chat, request_id)
        turn = _Turn(_ids("resp"), r, int(time.time()), messages)
        if r.stream:
            return SSEStream(self._stream(turn, ctx, plan), ctx.sub)
        c = (await ctx.collect())[0]  # closes the submission however it ends
        status = "incomplete" if c.finish_reason == "length" else "completed"
        if plan is not None:
            msg, calls = plan.message(c.text)
            content = msg["content"]
        else:
            content, calls = c.text, []
        items = [message_item(_ids("msg"), content, status)] if content is not None else []
        items += [call_item(_ids("fc"), call) for call in calls]
        return self._finish(turn, status, items, usage(ctx))

    def _response(self, turn: _Turn, status: str, output: list[dict[str, Any]],
                  use: dict[str, Any] | None) -> dict[str, Any]:
        r = turn.r
        return {"id": turn.id, "object": "response", "created_at": turn.created_at, "status": status,
                "background": False, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model_name,
                "output": output, "parallel_tool_calls": r.parallel_tool_calls,
                "previous_response_id": r.previous_response_id, "reasoning": None, "store": r.store,
                "temperature": 1.0 if r.temperature is None else r.temperature,
                "text": r.text if r.text and r.text.get("format") else {"format": {"type": "text"}},
                "tool_choice": r.tool_choice if r.tool_choice is not None else "auto", "tools": r.tools or [],
                "top_p": 1.0 if r.top_p is None else r.top_p, "truncation": "disabled", "usage": use,
                "user": r.user, "metadata": r.metadata or {}}

    def _finish(self, turn: _Turn, status: str, items: list[dict[str, Any]], use: dict[str, Any]) -> dict[str, Any]:
        """The final response object; stored (with its conversation) when the request asked to be."""
        resp = self._response(turn, status, items, use)
        if turn.r.store:
            self.store.put(turn.id, StoredResponse(resp, turn.messages + [assistant_message(items)]))
        return resp

    def _stream(self, turn: _Turn, ctx: _Call, plan: ToolPlan | None) -> AsyncIterator[str]:
        seq = count()

        def event(kind: str, **fields: Any) -> str:
            body = {"type": kind, **fields, "sequence_number": next(seq)}
            return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

        def error(e: APIError) -> str:
            return event("error", code=e.code, message=e.message, param=e.param)

        async def events() -> AsyncIterator[str]:
            started = self._response(turn, "in_progress", [], None)
            yield event("response.created", response=started)
            yield event("response.in_progress", response=started)
            items: list[dict[str, Any]] = []
            calls = ToolCallStream() if plan is not None and plan.active else None
            msg: dict[str, Any] | None = None  # the open message item
            text, lead, finish = "", "", None  # lead: whitespace not yet sent (before a call it is no content)

            def opened() -> Iterator[str]:
                nonlocal msg
                msg = message_item(_ids("msg"), "", "in_progress")
                msg["content"] = []
                yield event("response.output_item.added", output_index=len(items), item=msg)
                yield event("response.content_part.added", item_id=msg["id"], output_index=len(items),
                            content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                   "logprobs": []})

            def closed(status: str) -> Iterator[str]:
                nonlocal msg
                assert msg is not None
                where = {"item_id": msg["id"], "output_index": len(items), "content_index": 0}
                part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                yield event("response.output_text.done", **where, text=text, logprobs=[])
                yield event("response.content_part.done", **where, part=part)
                done = message_item(msg["id"], text, status)
                yield event("response.output_item.done", output_index=len(items), item=done)
                items.append(done)
                msg = None

            async for _, d in ctx.deltas():
                new, tool_deltas = calls.feed(d.text, final=d.finished) if calls is not None else (d.text, [])
                if plan is not None and not plan.parallel:
                    tool_deltas = [t for t in tool_deltas if t["index"] == 0]
                if new and msg is None and calls is not None and not (lead + new).strip():
                    lead += new  # held: whitespace before a call is no content (`parse_tool_calls`)
                elif new:
                    if msg is None:
                        for e in opened():
                            yield e
                        new, lead = lead + new, ""
                    text += new
                    yield event("response.output_text.delta", item_id=msg["id"], output_index=len(items),
                                content_index=0, delta=new, logprobs=[])
                for t in tool_deltas:
                    if "id" not in t:
                        continue  # the arguments: sent with the call below, whole (its tag closed)
                    call = calls.calls[t["index"]] if calls is not None else None
                    assert call is not None
                    if msg is not None:
                        for e in closed("completed"):
                            yield e
                    item = call_item(_ids("fc"), call, "in_progress")
                    where = {"item_id": item["id"], "output_index": len(items)}
                    yield event("response.output_item.added", output_index=len(items), item=item)
                    yield event("response.function_call_arguments.delta", **where, delta=call.arguments)
                    yield event("response.function_call_arguments.done", **where, name=call.name,
                                arguments=call.arguments)
                    done = call_item(item["id"], call)
                    yield event("response.output_item.done", output_index=len(items), item=done)
                    items.append(done)
                    lead = ""
                if d.finished:
                    finish = d.finish_reason
            status = "incomplete" if finish == "length" else "completed"
            if msg is None and not any(it["type"] == "function_call" for it in items):
                for e in opened():
                    yield e
                text = lead
                if text:
                    yield event("response.output_text.delta", item_id=msg["id"], output_index=len(items),
                                content_index=0, delta=text, logprobs=[])
            if msg is not None:
                for e in closed(status):
                    yield e
            final = self._finish(turn, status, items, usage(ctx))
            yield event("response.incomplete" if status == "incomplete" else "response.completed", response=final)

        return guarded(ctx, events(), error)
