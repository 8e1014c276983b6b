"""Tool calling without a model: the call grammars accept exactly well-formed calls of the given tools, the
history renders in the tool format, and the streamed parser gives the same calls as the whole-text one."""

from __future__ import annotations

import json
import random

import pytest
from tiny_models import CHATML, byte_level_fields

from kvlm.errors import ParameterError
from kvlm.structured.compiler import GrammarCompiler
from kvlm.structured.tool_parser import ToolCallStream, parse_tool_calls
from kvlm.structured.tools import (
    HERMES,
    SMOLLM2,
    call_grammar,
    check_tools,
    closed_objects,
    render_messages,
    template_reads_tools,
    tool_format_for,
    tool_mode,
)
from kvlm.tokenizer.tokenizer import Tokenizer

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/$defs/N"}},
            "required": ["a", "b"], "$defs": {"N": {"type": "integer", "minimum": 0}}}}},
         {"type": "function", "function": {"name": "echo", "parameters": {
             "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]
TOK = Tokenizer.from_gguf_fields(byte_level_fields())
COMP = GrammarCompiler(TOK, TOK.vocab_size)


def call(fmt, *items) -> str:
    if fmt.as_list:
        return "<tool_call>" + json.dumps(list(items), separators=(",", ":")) + "</tool_call>"
    return "\n".join("<tool_call>" + json.dumps(i, separators=(",", ":")) + "</tool_call>" for i in items)


ADD = {"name": "add", "arguments": {"a": 1, "b": 2}}
ECHO = {"name": "echo", "arguments": {"text": "hi"}}


def accepted(spec, text: str) -> bool:
    m = COMP.compile(spec).deep_copy()
    ids = TOK.encode(text, add_special_tokens=False)
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


@pytest.mark.parametrize("fmt", [SMOLLM2, HERMES])
def test_required_and_named_grammars(fmt) -> None:
    fns = check_tools(TOOLS)
    req = call_grammar(fns, "required", fmt, parallel=True)
    single = call_grammar(fns, "required", fmt, parallel=False)
    named = call_grammar(fns, "named", fmt, parallel=True, name="echo")
    assert accepted(req, call(fmt, ADD)) and accepted(req, call(fmt, ADD, ECHO))
    assert accepted(single, call(fmt, ECHO)) and not accepted(single, call(fmt, ADD, ECHO))
    assert accepted(named, call(fmt, ECHO)) and not accepted(named, call(fmt, ADD))
    for bad in ({"name": "add", "arguments": {"a": 1}},  # a required argument missing
                {"name": "add", "arguments": {"a": 1, "b": -2}},  # $ref'd minimum
                {"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}},  # an invented argument
                {"name": "sub", "arguments": {"a": 1, "b": 2}},  # not a tool
                {"arguments": {"a": 1, "b": 2}, "name": "add"}):  # keys out of order
        assert not accepted(req, call(fmt, bad)), bad
    assert not accepted(req, "Sure! " + call(fmt, ADD))  # required: a call from the first token
    if fmt.as_list:
        assert not accepted(req, "<tool_call>[]</tool_call>")


def test_auto_is_free_until_the_tag_then_constrained() -> None:
    auto = call_grammar(check_tools(TOOLS), "auto", HERMES, parallel=False)
    assert accepted(auto, "Just text, no call at all.")
    assert accepted(auto, "Let me add. " + call(HERMES, ADD))
    assert not accepted(auto, "Let me add. <tool_call>{\"name\":\"nope\"}</tool_call>")
    assert not accepted(auto, "Text " + call(HERMES, ADD) + " and more text")  # the call ends the answer
    assert call_grammar(check_tools(TOOLS), "none", HERMES, parallel=True) is None


def test_parse_whole_and_streamed_agree() -> None:
    rng = random.Random(0)
    for text in ["Let me see. " + call(HERMES, ADD, ECHO), call(SMOLLM2, ADD, ECHO), "no call here <tool_",
                 "a <tool_call>not json</tool_call> b", 'x <tool_call>{"name":"echo","arguments":{"text":"</"}}']:
        content, calls = parse_tool_calls(text)
        for _ in range(5):
            s, got, deltas, i = ToolCallStream(), "", [], 0
            while i < len(text):
                j = min(len(text), i + rng.randint(1, 7))
                c, d = s.feed(text[i:j], final=j == len(text))
                got, deltas, i = got + c, deltas + d, j
            rebuilt: dict[int, dict] = {}
            for d in deltas:
                slot = rebuilt.setdefault(d["index"], {"name": "", "arguments": ""})
                slot["name"] += d["function"].get("name") or ""
                slot["arguments"] += d["function"].get("arguments") or ""
            assert [(c.name, c.arguments) for c in calls] == [(r["name"], r["arguments"]) for r in rebuilt.values()]
            assert got == (content or "") if calls else got == text
    content, calls = parse_tool_calls("Let me see. " + call(HERMES, ADD, ECHO))
    assert content == "Let me see. " and [c.name for c in calls] == ["add", "echo"]
    assert json.loads(calls[0].arguments) == {"a": 1, "b": 2} and calls[0].id.startswith("call_")


def test_history_rendered_in_the_tool_format() -> None:
    history = [{"role": "user", "content": "1+2?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":1,"b":2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "3"},
               {"role": "tool", "tool_call_id": "call_2", "content": "4"}]
    out = render_messages(history, check_tools(TOOLS), SMOLLM2, template_has_tools=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert "<tools>" in out[0]["content"] and '"name": "add"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>'
    assert out[3]["content"] == "<tool_response>\n3\n</tool_response>\n<tool_response>\n4\n</tool_response>"
    TOK.apply_chat_template(out)  # renders on a template that knows nothing about tools
    native = render_messages(history, None, HERMES, template_has_tools=True)
    assert native[1]["content"] == "" and native[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}


def test_formats_and_choices() -> None:
    assert tool_format_for("... You are a helpful AI assistant named SmolLM ...") is SMOLLM2
    assert tool_format_for(CHATML) is HERMES and not template_reads_tools(CHATML)
    assert template_reads_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    fns = check_tools(TOOLS)
    assert tool_mode(None, fns) == ("auto", None) and tool_mode("required", fns) == ("required", None)
    assert tool_mode({"type": "function", "function": {"name": "add"}}, fns) == ("named", "add")
    for bad, param in ([({"function": {"name": "x"}}, "tool_choice"), ("sometimes", "tool_choice")]):
        with pytest.raises(ParameterError) as e:
            tool_mode(bad, fns)
        assert e.value.param == param
    with pytest.raises(ParameterError, match="distinct"):
        check_tools(TOOLS + TOOLS[:1])
    closed = closed_objects({"type": "object", "properties": {"properties": {"type": "object", "properties": {}}}})
    assert closed["additionalProperties"] is False and "additionalProperties" not in closed["properties"]
    assert closed["properties"]["properties"]["additionalProperties"] is False


def test_template_that_reads_tools_gets_them() -> None:
    """A template that uses `tools` renders them itself (no injected prompt), with earlier calls' arguments
    as objects and tool results as their own role, as transformers passes them."""
    from kvlm.structured.tools import chat_inputs

    template = ("{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}{% for m in messages %}"
                "<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
                "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
                "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}")
    tok = Tokenizer.from_gguf_fields(byte_level_fields(**{"tokenizer.chat_template": template}))
    history = [{"role": "user", "content": "1+2?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":1,"b":2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    msgs, kwargs = chat_inputs(history, check_tools(TOOLS), template)
    text = tok.apply_chat_template(msgs, **kwargs)
    assert text.startswith('<tools>[{"type": "function", "function": {"name": "add"')
    assert 'CALL add {"a": 1, "b": 2}' in text and "<|im_start|>tool\n3<|im_end|>" in text
    assert "expert in composing functions" not in text  # no injected prompt
