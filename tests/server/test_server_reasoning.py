"""Reasoning models through a real `kvlm serve`, driven by the real `openai` client: a tiny random model
whose Qwen3-like template opens `<think>` in the prompt (`tiny_models.write_tiny_thinking_gguf`).

Its weights are random, so a logit bias keeps its output to lowercase letters and bans EOS and `</think>`:
only the reasoning budget can close the span, and where it does is exact (N letters, then the forced
"\\n</think>\\n\\n"). Checked: the split in `message.reasoning` / `reasoning_content` vs `content`, streamed
deltas that add up to the non-streamed fields, the server's default budget (`--reasoning-budget`) and a
request's own (`reasoning_budget`, `reasoning_effort`), `enable_thinking=false`, a required tool call
(a grammar from the first token: no thinking, the call parsed), and bad values as 400s. The same server answers
the `anthropic` SDK's `/v1/messages` with a thinking block first, as chat completions splits it."""

from __future__ import annotations

import re
import subprocess
import sys

import openai
import pytest
from deps import need
from server_utils import ROOT, ServerProcess
from tiny_models import write_tiny_thinking_gguf

BIAS = {**{str(t): 100 for t in range(ord("a"), ord("z") + 1)}, "262": -100, "264": -100}  # EOS, </think> banned
ASK = [{"role": "user", "content": "What is two and two?"}]
DEFAULT_BUDGET = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    path = write_tiny_thinking_gguf(tmp_path_factory.mktemp("think") / "think.gguf", max_position_embeddings=2048)
    with ServerProcess(path, "--served-model-name", "think", "--reasoning-budget", str(DEFAULT_BUDGET)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def ask(client: openai.OpenAI, stream: bool = False, **kw) -> tuple[str | None, str | None, str | None]:
    """(reasoning, reasoning_content, content) of a greedy 12-token answer, streamed deltas concatenated."""
    args = dict(model="think", messages=ASK, max_tokens=12, temperature=0, logit_bias=BIAS, **kw)
    if not stream:
        m = client.chat.completions.create(**args).choices[0].message
        return m.reasoning, m.reasoning_content, m.content
    parts: dict[str, str | None] = {"reasoning": None, "reasoning_content": None, "content": None}
    for chunk in client.chat.completions.create(stream=True, **args):
        for name in parts:
            piece = getattr(chunk.choices[0].delta, name, None) if chunk.choices else None
            if piece:
                parts[name] = (parts[name] or "") + piece
    return parts["reasoning"], parts["reasoning_content"], parts["content"]


def test_ready_line_names_the_choice(server: ServerProcess) -> None:
    assert "reasoning parser think (auto: the chat template thinks), budget 6 tokens" in server.output()
    bad = subprocess.run([sys.executable, "-m", "kvlm", "serve", "x.gguf", "--reasoning-budget", "-1"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)  # refused before any loading
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == ["kvlm: error: --reasoning-budget must be >= 0"]


@pytest.mark.parametrize("stream", [False, True])
def test_budget_cuts_the_reasoning_and_the_split_holds(client: openai.OpenAI, stream: bool) -> None:
    for kw, budget in (({}, DEFAULT_BUDGET), ({"extra_body": {"reasoning_budget": 3}}, 3),
                       ({"reasoning_effort": "none", "extra_body": {"reasoning_budget": 2}}, 2)):
        reasoning, old_name, content = ask(client, stream, **kw)
        assert reasoning == old_name and re.fullmatch(rf"[a-z]{{{budget}}}\n", reasoning), (kw, reasoning)
        # 12 tokens: the budget's letters, 4 forced ("\n", "</think>", "\n", "\n"), then the answer's letters
        assert re.fullmatch(rf"\n\n[a-z]{{{12 - budget - 4}}}", content), (kw, content)
    none = ask(client, stream, reasoning_effort="none")  # budget 0: the span closes at once
    assert none[0] == "\n" and re.fullmatch(r"\n\n[a-z]{8}", none[2])


def test_stream_equals_whole(client: openai.OpenAI) -> None:
    for kw in ({}, {"reasoning_effort": "low"}, {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}):
        assert ask(client, True, **kw) == ask(client, False, **kw), kw


def test_effort_and_enable_thinking(client: openai.OpenAI) -> None:
    reasoning, _, content = ask(client, reasoning_effort="low")  # 256 tokens: 12 never reach it
    assert re.fullmatch(r"[a-z]{12}", reasoning) and content is None
    reasoning, old_name, content = ask(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reasoning is None and old_name is None and re.fullmatch(r"[a-z]{12}", content)


def test_tool_calls_come_after_the_reasoning(client: openai.OpenAI, server: ServerProcess) -> None:
    """A required call's grammar waits for `</think>`; `auto` leaves free text, so the span is split as
    usual; where enable_thinking=false closed it, the grammar holds from the first token."""
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "enum": ["two"]}}, "required": ["x"],
        "additionalProperties": False}}}
    kw = dict(model="think", messages=ASK, max_tokens=80, temperature=0, tools=[tool], logit_bias=BIAS)
    for extra, thought in (({"reasoning_budget": 2}, r"[a-z]{2}\n"),
                           ({"chat_template_kwargs": {"enable_thinking": False}}, None)):
        m = client.chat.completions.create(tool_choice="required", extra_body=extra, **kw).choices[0].message
        assert m.reasoning is None if thought is None else re.fullmatch(thought, m.reasoning), m
        assert m.content is None and m.tool_calls, m
        assert m.tool_calls[0].function.name == "add" and m.tool_calls[0].function.arguments == '{"x": "two"}'
    auto = client.chat.completions.create(tool_choice="auto", extra_body={"reasoning_budget": 3}, **kw)
    m = auto.choices[0].message
    assert re.fullmatch(r"[a-z]{3}\n", m.reasoning) and re.fullmatch(r"\n\n[a-z]+", m.content) and not m.tool_calls
    assert "grammar refused" not in server.output()  # the forced `</think>` never went past the grammar


@pytest.mark.parametrize(("kw", "param"), [
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"extra_body": {"reasoning_budget": -1}}, "reasoning_budget"),
    ({"extra_body": {"reasoning_budget": "many"}}, "reasoning_budget"),
    ({"extra_body": {"chat_template_kwargs": {"add_generation_prompt": False}}}, "chat_template_kwargs"),
    ({"extra_body": {"chat_template_kwargs": ["enable_thinking"]}}, "chat_template_kwargs"),
])
def test_bad_values_are_400_and_the_server_serves_on(client: openai.OpenAI, kw: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="think", messages=ASK, max_tokens=2, **kw)
    assert e.value.body["param"] == param, e.value.body
    assert client.chat.completions.create(model="think", messages=ASK, max_tokens=1).choices[0].finish_reason


# OpenAI's Responses API on the same server: the span as a `reasoning` item before the message.
GREEDY = dict(model="think", input="What is two and two?", max_output_tokens=12, temperature=0)


def respond(client: openai.OpenAI, reasoning: dict | None = None, **extra) -> openai.types.responses.Response:
    kw = dict(GREEDY, reasoning=reasoning) if reasoning else GREEDY
    return client.responses.create(**kw, extra_body={"logit_bias": BIAS, **extra})


def test_responses_reasoning_item_before_the_message(client: openai.OpenAI) -> None:
    for reasoning, extra, budget in ((None, {}, DEFAULT_BUDGET), ({"effort": "none"}, {"reasoning_budget": 2}, 2),
                                     ({"effort": "none", "summary": "auto"}, {}, 0)):
        r = respond(client, reasoning, **extra)
        thought, msg = r.output
        assert thought.type == "reasoning" and thought.id.startswith("rs_") and thought.summary == []
        assert thought.status == "completed" and [c.type for c in thought.content] == ["reasoning_text"]
        assert re.fullmatch(rf"[a-z]{{{budget}}}\n", thought.content[0].text), (reasoning, extra, thought)
        assert msg.type == "message" and r.output_text == msg.content[0].text  # the answer only
        assert r.usage.output_tokens_details.reasoning_tokens == budget and r.status == "incomplete"
        chat = ask(client, reasoning_effort=(reasoning or {}).get("effort"), extra_body=extra)  # the same tokens
        assert (thought.content[0].text, r.output_text) == (chat[0], chat[2])
        assert (r.reasoning.effort if reasoning else r.reasoning) == (reasoning or {}).get("effort")
    low = respond(client, {"effort": "low"})  # 256 tokens: 12 never reach it, so no message
    assert [o.type for o in low.output] == ["reasoning"] and low.output[0].status == "incomplete"
    assert re.fullmatch(r"[a-z]{12}", low.output[0].content[0].text) and low.output_text == ""
    assert low.usage.output_tokens_details.reasoning_tokens == 12
    # The output sent back as input: its reasoning item is dropped, as previous_response_id's history drops it.
    one = dict(GREEDY, max_output_tokens=1)
    resent = client.responses.create(**{**one, "input": [{"role": "user", "content": GREEDY["input"]}, *r.output,
                                                         {"role": "user", "content": "And three?"}]})
    continued = client.responses.create(**{**one, "input": "And three?"}, previous_response_id=r.id)
    assert resent.usage.input_tokens == continued.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**GREEDY, reasoning={"effort": "extreme"})
    assert e.value.body["param"] == "reasoning.effort", e.value.body


@pytest.mark.parametrize("extra", [{}, {"reasoning_budget": 3}])
def test_responses_stream_reasoning_events(client: openai.OpenAI, extra: dict) -> None:
    whole = respond(client, **extra)
    events = list(client.responses.create(**GREEDY, stream=True, extra_body={"logit_bias": BIAS, **extra}))
    kinds = [e.type for e in events]
    n, m = kinds.count("response.reasoning_text.delta"), kinds.count("response.output_text.delta")
    assert n >= 2 and m >= 1 and [e.sequence_number for e in events] == list(range(len(events)))
    item = ["response.output_item.added", "response.content_part.added"]
    done = ["response.content_part.done", "response.output_item.done"]
    assert kinds == ["response.created", "response.in_progress", *item, *["response.reasoning_text.delta"] * n,
                     "response.reasoning_text.done", *done, *item, *["response.output_text.delta"] * m,
                     "response.output_text.done", *done, "response.incomplete"]
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == events[4 + n].text == whole.output[0].content[0].text
    final = events[-1].response
    assert [o.model_dump(exclude={"id"}) for o in final.output] == [o.model_dump(exclude={"id"}) for o in whole.output]
    assert final.usage == whole.usage
    with client.responses.stream(**GREEDY, extra_body={"logit_bias": BIAS, **extra}) as stream:
        assert [e.type for e in stream] == kinds  # the SDK's accumulator takes every event


def test_responses_tool_call_after_the_reasoning(client: openai.OpenAI) -> None:
    tool = {"type": "function", "name": "add", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "enum": ["two"]}}, "required": ["x"],
        "additionalProperties": False}}
    letters = {k: v for k, v in BIAS.items() if k != "262"}  # EOS allowed: the call ends the response
    kw = dict(GREEDY, max_output_tokens=80, tools=[tool], tool_choice="required",
              extra_body={"logit_bias": letters, "reasoning_budget": 2})
    r = client.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "function_call"] and r.status == "completed"
    assert re.fullmatch(r"[a-z]{2}\n", r.output[0].content[0].text) and r.output[1].arguments == '{"x": "two"}'
    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    assert [o.model_dump(exclude={"id", "call_id", "parsed_arguments"}) for o in final.output] == \
        [o.model_dump(exclude={"id", "call_id"}) for o in r.output]
# ------------------------------------------------------ Anthropic's Messages API: thinking blocks (anthropic SDK)
# Messages take no logit_bias, so these answers are the weights' own greedy text; each is checked against the same
# request over chat completions, whose split the tests above pin down exactly.


@pytest.fixture(scope="module")
def claude(server: ServerProcess):
    return need("anthropic").Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)


MESSAGE_ARGS = dict(model="think", messages=ASK, max_tokens=16, extra_body={"temperature": 0})
THINKING = {  # id: (the request's thinking, the same over chat completions, the content blocks' types)
    "default": ({}, {}, ["thinking", "text"]),  # the server's budget, 6
    "budget3": ({"type": "enabled", "budget_tokens": 3}, {"reasoning_budget": 3}, ["thinking", "text"]),
    "budget100": ({"type": "enabled", "budget_tokens": 100}, {"reasoning_budget": 100}, ["thinking"]),  # not closed
    "disabled": ({"type": "disabled"}, {"chat_template_kwargs": {"enable_thinking": False}}, ["text"]),
}


def message(claude, thinking: dict, stream: bool = False):
    """The SDK's message for a greedy 16-token answer (streamed: the one `messages.stream` accumulates, and the
    events it saw)."""
    kw = {**MESSAGE_ARGS, **({"thinking": thinking} if thinking else {})}
    if not stream:
        return claude.messages.create(**kw)
    with claude.messages.stream(**kw) as s:
        events = list(s)
        return s.get_final_message(), events


def plain(blocks) -> list[dict]:
    """Blocks as their wire fields (the stream's text blocks are the SDK's ParsedTextBlock)."""
    return [b.model_dump(include={"type", "thinking", "signature", "text"}) for b in blocks]


@pytest.mark.parametrize("case", THINKING)
def test_messages_thinking_block_first_and_stream_equals_create(claude, client: openai.OpenAI, case: str) -> None:
    thinking, extra, types = THINKING[case]
    m = message(claude, thinking)
    chat = client.chat.completions.create(model="think", messages=ASK, max_tokens=16, temperature=0,
                                          extra_body=extra).choices[0].message
    assert [b.type for b in m.content] == types and m.stop_reason == "max_tokens"
    if "thinking" in types:
        assert m.content[0].thinking == chat.reasoning and m.content[0].signature == ""
    assert (m.content[-1].text if "text" in types else None) == chat.content
    final, events = message(claude, thinking, stream=True)
    assert plain(final.content) == plain(m.content) and final.usage.output_tokens == m.usage.output_tokens == 16
    assert [e.content_block.type for e in events if e.type == "content_block_start"] == types
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas.count("signature_delta") == types.count("thinking")
    assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                   and e.delta.type == "thinking_delta") == (m.content[0].thinking if "thinking" in types else "")


def test_messages_budget_cuts_the_thinking_and_it_can_be_sent_back(claude) -> None:
    budget3, default, unbounded = (message(claude, THINKING[c][0]) for c in ("budget3", "default", "budget100"))
    assert len(budget3.content[0].thinking) < len(default.content[0].thinking) < len(unbounded.content[0].thinking)
    turns = ASK + [{"role": "assistant", "content": default.content}, {"role": "user", "content": "And three?"}]
    assert claude.messages.create(**{**MESSAGE_ARGS, "messages": turns, "max_tokens": 1}).content[0].type == "thinking"


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": -1}, {"type": "enabled"},
                                      {"type": "enabled", "budget_tokens": "many"}, {"type": "sometimes"}])
def test_messages_bad_thinking_is_anthropic_400(claude, thinking: dict) -> None:
    anthropic = need("anthropic")
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(**MESSAGE_ARGS, thinking=thinking)
    assert e.value.status_code == 400 and e.value.body["error"]["type"] == "invalid_request_error", e.value.body
    assert "thinking" in e.value.body["error"]["message"]
    assert claude.messages.create(**{**MESSAGE_ARGS, "max_tokens": 1}).content
