"""`/v1/responses`: OpenAI's Responses API as a translation onto chat completions' machinery.

A request becomes one `ChatCompletionRequest` (`input` items -> messages, `instructions` -> a system
message, flat `tools` -> chat tools, `text.format` -> `response_format`, `max_output_tokens` -> `max_tokens`),
so the chat template, tool prompt and grammar, output constraints, checks and engine submission are the
ones `ChatServing.start_chat` runs for chat; an error they raise is renamed to the Responses field it came
from. What comes back (whole or streamed) is shaped into output items: a `message` with `output_text`,
then one `function_call` item per call. Streams carry the documented typed events, each numbered by
`sequence_number`, and end with `response.completed` (`response.incomplete` when `max_output_tokens`
cut the answer, `response.failed` when a shutdown aborted it).

A thinking model's `<think>` span (`ReasoningPlan`, as chat splits it) comes first as a `reasoning` item
(its text in `content` as `reasoning_text`, `summary` always empty: kvlm writes no summaries), streamed as
`response.reasoning_text.delta`s; the message and the calls are parsed from what follows.
`reasoning.effort` is chat's `reasoning_effort` (a budget). Reasoning items sent back in `input` are
dropped, as chat templates do not render an earlier turn's reasoning.

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
from kvlm.structured.reasoning import ReasoningPlan
from kvlm.structured.tool_parser import ToolCall, ToolCallStream

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")
# What chat's checks call a field -> its Responses name, in params and messages (longest first).
_RENAMES = (("'max_tokens' or 'max_completion_tokens'", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
            ("response_format.json_schema.schema", "text.format.schema"),
            ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
            (".function.name", ".name"), ("reasoning_effort", "reasoning.effort"),
            ("the input messages", "the input"), ("messages", "input"))


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
        elif it.type != "reasoning":  # an earlier turn's reasoning: dropped (chat templates do not render it)
            raise bad_request(f"input item type {it.type!r} is not supported (message, function_call, "
                              "function_call_output, reasoning)", f"{where}.type")
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
    extra = sorted(set(text) - {"format", "verbosity"})
    if extra:
        raise bad_request(f"text: unsupported key(s) {extra} (supported: format)", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request("text.verbosity other than medium (the default) is not supported", "text.verbosity")
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
    extra = sorted(set(r.reasoning or {}) - {"effort", "summary", "generate_summary"})
    if extra:
        raise bad_request(f"reasoning: unsupported key(s) {extra} (supported: effort, summary)", "reasoning")
    unsupported = [x for x in r.include or () if x != "reasoning.encrypted_content"]  # none is ever encrypted
    if unsupported:
        raise bad_request(f"include is not supported, got {unsupported}", "include")
    if r.truncation not in (None, "disabled"):
        raise bad_request("truncation must be disabled (a prompt longer than the context is a 400)", "truncation")
    if r.top_logprobs:
        raise bad_request("top_logprobs is not supported", "top_logprobs")


def response_status(finish_reason: str | None) -> str:
    """The response's status for how its request ended; a stream's last event is `response.<status>`."""
    return {"length": "incomplete", "abort": "failed"}.get(finish_reason or "", "completed")


def item_status(status: str) -> str:
    return "completed" if status == "completed" else "incomplete"


def _ids(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else ""}


def usage(ctx: _Call) -> dict[str, Any]:
    """Reasoning tokens are the engine's count inside `<think>` (a forced `</think>` not
    included), kept where it tracks the span (a template that opens it, or a budget); else 0. With speculative
    decoding `output_tokens_details` also counts drafts (`accepted_prediction_tokens`,
    `rejected_prediction_tokens`), as chat completions' usage does."""
    u = ctx.usage()
    tracked = ctx.requests[0].reasoning
    # speculative decoding: drafts kept and refused, as chat completions' completion_tokens_details has them
    drafts = u.get("completion_tokens_details", {})
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": u["prompt_tokens_details"],
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": tracked.spent if tracked is not None else 0, **drafts},
            "total_tokens": u["total_tokens"]}


def assistant_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The output items as the chat message they render as in the next turn's prompt."""
    msg: dict[str, Any] = {"role": "assistant", "content": None}
    for it in items:
        if it["type"] == "message":
            msg["content"] = it["content"][0]["text"]
        elif it["type"] == "function_call":
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            msg.setdefault("tool_calls", []).append(call)
    return msg


class ResponseEvents:
    """A streamed response's output as typed events, each with the next `sequence_number`: reasoning opens
    a reasoning item and goes out as `reasoning_text` deltas, until content or a call closes it; text opens
    a message item and goes out as `output_text` deltas, a call closes the message and goes out as its own
    `function_call` item. `items` ends equal to the output the same text makes whole (`create`)."""

    def __init__(self) -> None:
        self._seq = count()
        self.items: list[dict[str, Any]] = []  # finished output items
        self._msg: str | None = None  # the open message item's id
        self._text = ""  # its text so far
        self._held = ""  # blank text not yet sent: before a call it is no content (`parse_tool_calls`)
        self._rs: str | None = None  # the open reasoning item's id (never open with a message)
        self._thought = ""  # its text so far

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, **fields, "sequence_number": next(self._seq)}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._msg or self._rs, "output_index": len(self.items), "content_index": 0}

    def reasoning(self, new: str) -> list[str]:
        """Reasoning text: it comes before any content or call (`ReasoningStream`)."""
        out = []
        if self._rs is None:
            self._rs = _ids("rs")
            item = {**reasoning_item(self._rs, "", "in_progress"), "content": []}
            out = [self.event("response.output_item.added", output_index=len(self.items), item=item),
                   self.event("response.content_part.added", **self._where(),
                              part={"type": "reasoning_text", "text": ""})]
        self._thought += new
        return out + [self.event("response.reasoning_text.delta", **self._where(), delta=new)]

    def text(self, new: str, hold_blank: bool = False) -> list[str]:
        """Content text; `hold_blank` (tools offered): blank text before the message opens waits."""
        if self._msg is None and hold_blank and not (self._held + new).strip():
            self._held += new
            return []
        new, self._held = self._held + new, ""
        out = self._end_reasoning("completed")
        out += self._open() if self._msg is None else []
        if new:
            self._text += new
            out.append(self.event("response.output_text.delta", **self._where(), delta=new, logprobs=[]))
        return out

    def call(self, call: ToolCall) -> list[str]:
        out = self._end_reasoning("completed") + (self._close("completed") if self._msg is not None else [])
        self._held = ""
        item = call_item(_ids("fc"), call, "in_progress")
        where = {"item_id": item["id"], "output_index": len(self.items)}
        out += [self.event("response.output_item.added", output_index=len(self.items), item=item),
                self.event("response.function_call_arguments.delta", **where, delta=call.arguments),
                self.event("response.function_call_arguments.done", **where, name=call.name,
                           arguments=call.arguments)]
        item = call_item(item["id"], call)
        out.append(self.event("response.output_item.done", output_index=len(self.items), item=item))
        self.items.append(item)
        return out

    def end(self, status: str) -> list[str]:
        """Close the open item; with no reasoning and no call, the answer is a message even when blank."""
        out = self.text("") if self._msg is None and (self._held or (not self.items and self._rs is None)) else []
        out += self._end_reasoning(status)  # nothing followed it
        if self._msg is not None:
            out += self._close(status)
        return out

    def _open(self) -> list[str]:
        self._msg = _ids("msg")
        item = {**message_item(self._msg, "", "in_progress"), "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self.event("response.output_item.added", output_index=len(self.items), item=item),
                self.event("response.content_part.added", **self._where(), part=part)]

    def _end_reasoning(self, status: str) -> list[str]:
        if self._rs is None:
            return []
        part = {"type": "reasoning_text", "text": self._thought}
        done = reasoning_item(self._rs, self._thought, status)
        out = [self.event("response.reasoning_text.done", **self._where(), text=self._thought),
               self.event("response.content_part.done", **self._where(), part=part),
               self.event("response.output_item.done", output_index=len(self.items), item=done)]
        self.items.append(done)
        self._rs, self._thought = None, ""
        return out

    def _close(self, status: str) -> list[str]:
        part = {"type": "output_text", "text": self._text, "annotations": [], "logprobs": []}
        done = message_item(self._msg or "", self._text, status)
        out = [self.event("response.output_text.done", **self._where(), text=self._text, logprobs=[]),
               self.event("response.content_part.done", **self._where(), part=part),
               self.event("response.output_item.done", output_index=len(self.items), item=done)]
        self.items.append(done)
        self._msg, self._text = None, ""
        return out


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
                  "response_format": response_format(r.text), "stream": r.stream, "seed": r.seed, "top_k": r.top_k,
                  "reasoning_effort": (r.reasoning or {}).get("effort"), "reasoning_budget": r.reasoning_budget,
                  "logit_bias": r.logit_bias}
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None}), messages
        except ValidationError as e:
            raise validation_error(e) from None

    async def create(self, r: ResponsesRequest, request_id: str) -> dict[str, Any] | SSEStream:
        with responses_names():
            chat, messages = self.chat_request(r)
            ctx, plan, thinks = await self.start_chat(chat, request_id)
        turn = _Turn(_ids("resp"), r, int(time.time()), messages)
        if r.stream:
            return SSEStream(self._stream(turn, ctx, plan, thinks), ctx.sub)
        c = (await ctx.collect())[0]  # closes the submission however it ends
        status = response_status(c.finish_reason)
        parts = thinks.parts(c.text)
        if plan is not None:
            msg, calls = plan.message(parts.content)
            content = msg["content"]
        else:
            content, calls = parts.content, []
        items = []
        if parts.reasoning:  # complete once an answer followed it (as a stream closes it); none if empty
            items.append(reasoning_item(_ids("rs"), parts.reasoning,
                                        "completed" if content or calls else item_status(status)))
        if content is not None and (content or not items):
            items.append(message_item(_ids("msg"), content, item_status(status)))
        items += [call_item(_ids("fc"), call) for call in calls]
        return self._finish(turn, status, items, usage(ctx))

    def _response(self, turn: _Turn, status: str, output: list[dict[str, Any]],
                  use: dict[str, Any] | None) -> dict[str, Any]:
        r = turn.r
        return {"id": turn.id, "object": "response", "created_at": turn.created_at, "status": status,
                "background": False,
                "error": {"code": "server_error", "message": "aborted: the server is shutting down"}
                if status == "failed" else None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
                # a name other than the base's got past check_model at the start: a LoRA adapter (vLLM echoes it)
                "model": r.model if r.model and r.model not in self.opts.served_model_names else self.model_name,
                "output": output, "parallel_tool_calls": r.parallel_tool_calls,
                "previous_response_id": r.previous_response_id, "reasoning": r.reasoning or None, "store": r.store,
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

    def _stream(self, turn: _Turn, ctx: _Call, plan: ToolPlan | None, thinks: ReasoningPlan) -> AsyncIterator[str]:
        ev = ResponseEvents()
        split = thinks.stream()

        async def events() -> AsyncIterator[str]:
            started = self._response(turn, "in_progress", [], None)
            yield ev.event("response.created", response=started)
            yield ev.event("response.in_progress", response=started)
            calls = ToolCallStream() if plan is not None and plan.active else None
            finish = None
            async for _, d in ctx.deltas():
                reasoning, text = split.feed(d.text, final=d.finished) if split is not None else ("", d.text)
                out = ev.reasoning(reasoning) if reasoning else []
                if calls is None:
                    out += ev.text(text) if text or split is None else []
                else:  # tool calls are parsed from the content part
                    new, deltas = calls.feed(text, final=d.finished)
                    out += ev.text(new, hold_blank=True)
                    for t in deltas:  # a call goes out whole: its tag has closed
                        if "id" in t and (t["index"] == 0 or plan is None or plan.parallel):
                            out += ev.call(calls.calls[t["index"]])
                for e in out:
                    yield e
                if d.finished:
                    finish = d.finish_reason
            status = response_status(finish)
            for e in ev.end(item_status(status)):
                yield e
            yield ev.event(f"response.{status}", response=self._finish(turn, status, ev.items, usage(ctx)))

        return guarded(ctx, events(), lambda e: ev.event("error", code=e.code, message=e.message, param=e.param))
