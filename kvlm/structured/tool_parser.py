"""Tool calls out of generated text, whole (`parse_tool_calls`) or as it streams (`ToolCallStream`).

A call is the JSON inside `<tool_call>...</tool_call>` (a list of calls in SmolLM2's format, one object in
Hermes'). Text before the first tag is the message's content; the calls become OpenAI's `tool_calls` with
ids `call_<24 alphanumerics>` and `arguments` as a JSON string. Streaming never sends a call's text as
content: text is released only while it cannot be the start of a tag, and each call goes out as tool-call
deltas by `index` once its tag closes, so a client that concatenates the deltas' `arguments` gets exactly
the string the non-streamed answer carries.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from kvlm.structured.tools import CLOSE, OPEN

_ALPHABET = string.ascii_letters + string.digits


def tool_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ALPHABET) for _ in range(24))


@dataclass(slots=True)
class ToolCall:
    """One parsed call: `arguments` is the JSON text of the arguments object (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=tool_call_id)

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _calls_in(body: str) -> list[ToolCall] | None:
    """The calls in one tag's body, or None when it is not a call (or a list of calls) in JSON."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        calls.append(ToolCall(item["name"], json.dumps(args, ensure_ascii=False)))
    return calls


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content before the first call or the whole text, calls). No well-formed call: (text, [])."""
    start = text.find(OPEN)
    if start == -1:
        return text, []
    calls: list[ToolCall] = []
    pos = start
    while True:
        end = text.find(CLOSE, pos)
        if end == -1:
            break
        found = _calls_in(text[pos + len(OPEN): end])
        if found is None:
            break
        calls += found
        pos = text.find(OPEN, end)
        if pos == -1:
            break
    if not calls:
        return text, []
    content = text[:start]  # what a stream sent as content before the tag, exactly
    return content if content.strip() else None, calls


class ToolCallStream:
    """Feed the text deltas of one choice; get back content text and tool-call deltas to send."""

    def __init__(self) -> None:
        self.pending = ""  # text not yet released: a possible tag start, or an open call
        self.in_call = False
        self.num_calls = 0
        self.calls: list[ToolCall] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """Returns (content to stream now, tool-call deltas, each {"index", "id"?, "type"?, "function"})."""
        self.pending += text
        content, deltas = "", []
        while True:
            if not self.in_call:
                i = self.pending.find(OPEN)
                if i == -1:
                    keep = 0 if final else _partial_tag(self.pending)
                    if not self.calls:  # after a call, text outside tags is dropped (as `parse_tool_calls` does)
                        content += self.pending[: len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                content += self.pending[:i] if not self.calls else ""  # text between calls is dropped
                self.pending, self.in_call = self.pending[i:], True
            j = self.pending.find(CLOSE)
            if j == -1:
                if final:  # an unclosed call at the end: it was never a call, send it as text
                    content += self.pending if not self.calls else ""
                    self.pending = ""
                break
            calls = _calls_in(self.pending[len(OPEN): j])
            if calls is None:  # a tag that holds no call: plain text after all
                content += self.pending[: j + len(CLOSE)] if not self.calls else ""
            else:
                for c in calls:
                    deltas.append({"index": self.num_calls, "id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": ""}})
                    deltas.append({"index": self.num_calls, "function": {"arguments": c.arguments}})
                    self.num_calls += 1
                self.calls += calls
            self.pending, self.in_call = self.pending[j + len(CLOSE):], False
        return content, deltas


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of the call tag."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0
