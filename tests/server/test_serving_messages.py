"""`serving_messages.BlockStream`: an answer's text fed in pieces of any size becomes Anthropic's content-block
events, and a client that rebuilds the content from them (text deltas joined, input_json_delta parsed) gets
exactly the blocks of the whole answer (`content_blocks`), with the real tool plan and call parser. The tiny
random model behind the server tests never writes text before a call; these answers do."""

from __future__ import annotations

import json

import pytest

from kvlm.server.chat_tools import ToolPlan
from kvlm.server.serving_messages import BlockStream, content_blocks
from kvlm.structured.tools import HERMES, SMOLLM2, check_tools

FUNCS = check_tools([{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
                     for n in ("f", "g")])
F = '{"name": "f", "arguments": {"a": 1}}'
G = '{"name": "g", "arguments": {"b": "x y"}}'


def plan(mode: str = "auto", parallel: bool = True, fmt=HERMES) -> ToolPlan:
    return ToolPlan(FUNCS, mode, None, fmt, parallel)


CASES = [
    ("Hello, world.", None),
    ("", None),
    ("plain <tool_call>not parsed without tools</tool_call>", None),
    ("tools offered, none called", plan()),
    ("  \n", plan()),  # whitespace alone is the answer
    (f"  \n<tool_call>{F}</tool_call>", plan()),  # whitespace before a call is dropped
    (f"Let me check.\n<tool_call>{F}</tool_call>", plan()),
    (f"<tool_call>{F}</tool_call>\n<tool_call>{G}</tool_call>", plan()),
    (f"<tool_call>{F}</tool_call>\n<tool_call>{G}</tool_call>", plan(parallel=False)),
    (f"Two: <tool_call>[{F}, {G}]</tool_call>", plan(fmt=SMOLLM2)),
    ('Unclosed <tool_call>{"name": "f"', plan()),
    (f"<tool_call>{F}</tool_call>", plan("none")),
]


def rebuild(lines: list[str]) -> tuple[list[dict], list[str]]:
    """(content, event types) as a client rebuilds them; checks each block opens, fills and stops in order."""
    content: list[dict] = []
    kinds, partial, open_index = [], {}, None
    for line in lines:
        head, data = line.split("\n")[:2]
        ev = json.loads(data.removeprefix("data: "))
        assert head == f"event: {ev['type']}" and line.endswith("\n\n")
        kinds.append(ev["type"])
        if ev["type"] == "content_block_start":
            assert ev["index"] == len(content) and open_index is None
            content.append(dict(ev["content_block"]))
            open_index = ev["index"]
        elif ev["type"] == "content_block_delta":
            assert ev["index"] == open_index
            d = ev["delta"]
            if d["type"] == "text_delta":
                content[-1]["text"] += d["text"]
            else:
                partial[open_index] = partial.get(open_index, "") + d["partial_json"]
        elif ev["type"] == "content_block_stop":
            assert ev["index"] == open_index
            if open_index in partial:
                content[-1]["input"] = json.loads(partial[open_index])
            open_index = None
    assert open_index is None
    return content, kinds


def without_ids(blocks: list[dict]) -> list[dict]:
    for b in blocks:
        if b["type"] == "tool_use":
            assert b["id"].startswith("toolu_") and len(b["id"]) == 30
    return [{k: v for k, v in b.items() if k != "id"} for b in blocks]


@pytest.mark.parametrize("text,tool_plan", CASES, ids=[f"case{i}" for i in range(len(CASES))])
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_streamed_blocks_rebuild_the_whole_answer(text, tool_plan, size) -> None:
    stream = BlockStream(tool_plan)
    pieces = [text[i: i + size] for i in range(0, len(text), size)] or [""]
    lines = [ln for i, p in enumerate(pieces) for ln in stream.feed(p, final=i == len(pieces) - 1)]
    content, kinds = rebuild(lines)
    whole = content_blocks(text, tool_plan)
    assert without_ids(content) == without_ids(whole)
    assert kinds.count("ping") == 1 and kinds.index("ping") == (1 if whole else 0)
    assert stream.called == any(b["type"] == "tool_use" for b in whole)
