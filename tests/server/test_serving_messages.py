"""`serving_messages.BlockStream`: an answer's text fed in pieces of any size becomes Anthropic's content-block
events, and a client that rebuilds the content from them (text deltas joined, input_json_delta parsed) gets
exactly the blocks of the whole answer (`content_blocks`), with the real tool plan and call parser and, for a
thinking model, the real reasoning split (a thinking block first). The tiny random model behind the server
tests never writes text before a call; these answers do."""

from __future__ import annotations

import json

import pytest

from kvlm.server.chat_tools import ToolPlan
from kvlm.server.serving_messages import BlockStream, content_blocks
from kvlm.structured.reasoning import ReasoningPlan
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
OPENED, SPLIT = ReasoningPlan(True, True, None), ReasoningPlan(True, False, None)  # the prompt opened <think>, or not
THINKING = [  # (text, tool plan, reasoning plan)
    ("two and two</think>\n\nFour.", None, OPENED),
    ("cut before the end </thi", None, OPENED),  # never closed: all reasoning, no text block
    ("", None, OPENED),  # an empty thinking block
    ("</think>", None, OPENED),
    (f"hm</think>\n\n<tool_call>{F}</tool_call>", plan(), OPENED),  # whitespace before the call dropped
    (f"hm</think>Calling.<tool_call>{F}</tool_call>", plan(), OPENED),
    ("  <think>why</think>because", None, SPLIT),  # the output opens the span itself
    ("no <think> at the start", None, SPLIT),
    ("<thin", None, SPLIT),
    ("", None, SPLIT),
    ("all content", None, ReasoningPlan(False, False, None)),  # enable_thinking false / no parser
]


def rebuild(lines: list[str]) -> tuple[list[dict], list[str]]:
    """(content, event types) as a client rebuilds them; checks each block opens, fills and stops in order."""
    content: list[dict] = []
    kinds, partial, open_index, signed = [], {}, None, None
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
            elif d["type"] == "thinking_delta":
                content[-1]["thinking"] += d["thinking"]
            elif d["type"] == "signature_delta":  # just before the thinking block stops
                assert content[-1]["type"] == "thinking" and d["signature"] == ""
                signed = open_index
            else:
                partial[open_index] = partial.get(open_index, "") + d["partial_json"]
        elif ev["type"] == "content_block_stop":
            assert ev["index"] == open_index and (signed == open_index) == (content[-1]["type"] == "thinking")
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


@pytest.mark.parametrize("text,tool_plan,thinks", [(t, p, None) for t, p in CASES] + THINKING,
                         ids=[f"case{i}" for i in range(len(CASES))] + [f"think{i}" for i in range(len(THINKING))])
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_streamed_blocks_rebuild_the_whole_answer(text, tool_plan, thinks, size) -> None:
    stream = BlockStream(tool_plan, thinks)
    pieces = [text[i: i + size] for i in range(0, len(text), size)] or [""]
    lines = [ln for i, p in enumerate(pieces) for ln in stream.feed(p, final=i == len(pieces) - 1)]
    content, kinds = rebuild(lines)
    whole = content_blocks(text, tool_plan, thinks)
    assert without_ids(content) == without_ids(whole)
    assert kinds.count("ping") == 1 and kinds.index("ping") == (1 if whole else 0)
    assert stream.called == any(b["type"] == "tool_use" for b in whole)


def test_thinking_block_comes_first() -> None:
    assert without_ids(content_blocks(f"a</think>\n\nOK<tool_call>{F}</tool_call>", plan(), OPENED)) == [
        {"type": "thinking", "thinking": "a", "signature": ""}, {"type": "text", "text": "\n\nOK"},
        {"type": "tool_use", "name": "f", "input": {"a": 1}}]
    assert content_blocks("a</think>b", None, SPLIT) == [{"type": "text", "text": "a</think>b"}]
