"""`ResponseEvents` without a server: however the model's text arrives, the streamed items equal the output
`create` builds from the whole text (`parse_tool_calls`), and the events come in the documented order."""

from __future__ import annotations

import json

import pytest

from kvlm.server.serving_responses import ResponseEvents
from kvlm.structured.tool_parser import ToolCallStream, parse_tool_calls

CALL = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'


def stream(text: str, size: int) -> tuple[list[dict], list[dict]]:
    chunks = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    ev, calls, out = ResponseEvents(), ToolCallStream(), []
    for i, chunk in enumerate(chunks):
        new, deltas = calls.feed(chunk, final=i == len(chunks) - 1)
        out += ev.text(new, hold_blank=True)
        out += [e for t in deltas if "id" in t for e in ev.call(calls.calls[t["index"]])]
    out += ev.end("completed")
    return ev.items, [json.loads(e.split("data: ", 1)[1]) for e in out]


@pytest.mark.parametrize("size", [1, 5, 1000])
@pytest.mark.parametrize("text", ["Let me check. " + CALL, " \n" + CALL, CALL + "\n" + CALL, "plain answer", "  ", ""])
def test_streamed_items_equal_the_whole_answer(text: str, size: int) -> None:
    items, events = stream(text, size)
    content, calls = parse_tool_calls(text)
    whole = ([("message", content)] if content is not None else []) + [("function_call", c.name, c.arguments)
                                                                        for c in calls]
    assert [("message", it["content"][0]["text"]) if it["type"] == "message" else
            ("function_call", it["name"], it["arguments"]) for it in items] == whole
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    for i, it in enumerate(items):  # each item opens and closes at its index, before the next one opens
        added = [k for k, e in enumerate(events) if e["type"] == "response.output_item.added"]
        done = [k for k, e in enumerate(events) if e["type"] == "response.output_item.done"]
        assert events[added[i]]["output_index"] == events[done[i]]["output_index"] == i
        assert added[i] < done[i] and (i + 1 == len(items) or done[i] < added[i + 1])
        if it["type"] == "message":
            body = kinds[added[i] + 1: done[i]]
            assert body[0] == "response.content_part.added" and body[-2:] == ["response.output_text.done",
                                                                                 "response.content_part.done"]
            deltas = [e["delta"] for e in events[added[i]: done[i]] if e["type"] == "response.output_text.delta"]
            assert "".join(deltas) == it["content"][0]["text"]
        else:
            assert kinds[added[i] + 1: done[i]] == ["response.function_call_arguments.delta",
                                                     "response.function_call_arguments.done"]
