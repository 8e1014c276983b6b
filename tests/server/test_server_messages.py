"""Anthropic's Messages API through a real `kvlm serve`, driven by the real `anthropic` SDK (and LangChain's
ChatAnthropic where it installs).

One module server: the tiny random model (untied head, so greedy text is not one repeated byte) with a
4096-token context (a tool prompt is a few hundred byte tokens) and an API key (the SDK sends it as
`x-api-key`; OpenAI's clients as `Authorization: Bearer`). Greedy answers (temperature 0, sent through
`extra_body` as SDK 2.x requires) make streamed and non-streamed answers, and the same conversation over chat
completions, comparable exactly; forced tool calls are valid whatever the weights because the grammar decides them."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from deps import need
from server_utils import ServerProcess
from tiny_models import tiny_config, write_tiny_gguf

anthropic = need("anthropic")

KEY = "sk-kvlm-messages"
GREEDY = {"temperature": 0}
ASK = [{"role": "user", "content": "What time is it?"}]
CLOCK = {"name": "get_time", "description": "The time in a zone",
         "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
                          "required": ["zone"]}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    cfg = tiny_config(max_position_embeddings=4096, tie_word_embeddings=False)  # untied: greedy text varies
    path = write_tiny_gguf(tmp_path_factory.mktemp("messages") / "tiny.gguf", cfg)
    with ServerProcess(path, "--served-model-name", "tiny", "--api-key", KEY, "--max-num-seqs", "8") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def create(client, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 12)
    return client.messages.create(model="tiny", extra_body={**GREEDY, **kw.pop("extra_body", {})}, **kw)


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def raw_events(server, body: dict) -> list[tuple[str, dict]]:
    """(event line, data) of an SSE stream read by hand: the `event:` line must name the data's type."""
    out = []
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True},
                      headers={"x-api-key": KEY}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == kind
                out.append((kind, data))
    return out


def test_create_and_stream_give_the_same_text_in_anthropic_order(client, server) -> None:
    m = create(client, system="Be brief.")
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == "tiny"
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert 1 <= m.usage.output_tokens <= 12 and m.usage.input_tokens + m.usage.cache_read_input_tokens > 0
    with client.messages.stream(model="tiny", system="Be brief.", messages=ASK, max_tokens=12,
                                extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(final) == text_of(m) and final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens
    events = raw_events(server, {"model": "tiny", "system": "Be brief.", "messages": ASK, "max_tokens": 12, **GREEDY})
    kinds = [k for k, _ in events]
    deltas = kinds.count("content_block_delta")
    assert kinds == ["message_start", "content_block_start", "ping", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"], kinds
    assert "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta") == text_of(m)
    assert events[-2][1]["delta"]["stop_reason"] == m.stop_reason


def test_count_tokens_is_the_prompt_the_engine_ran(client) -> None:
    tools = [CLOCK]
    for kw in ({"system": [{"type": "text", "text": "Be brief."}]}, {"tools": tools}):
        n = client.messages.count_tokens(model="tiny", messages=ASK, **kw).input_tokens
        m = create(client, max_tokens=1, **kw)
        assert n == m.usage.input_tokens + m.usage.cache_read_input_tokens > 0
    again = create(client, max_tokens=1, tools=tools)  # the same prompt again: its full blocks come from the cache
    assert again.usage.cache_read_input_tokens > 0


def test_stop_sequence(client) -> None:
    text = text_of(create(client))
    stop = next(ch for ch in text[1:] if ch.isalnum())  # the greedy text of these weights has one past its start
    m = create(client, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert text_of(m) == text[: text.index(stop)]


def test_forced_tool_use_streamed_input_equals_non_streamed(client, server) -> None:
    kw = dict(tools=[CLOCK], tool_choice={"type": "tool", "name": "get_time"}, max_tokens=80)
    m = create(client, **kw)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    call = m.content[0]
    assert call.name == "get_time" and call.id.startswith("toolu_") and call.input["zone"] in ("utc", "cet")
    with client.messages.stream(model="tiny", messages=ASK, extra_body=GREEDY, **kw) as stream:
        partial = "".join(e.delta.partial_json for e in stream
                          if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
        final = stream.get_final_message()
    assert json.loads(partial) == call.input == final.content[0].input
    assert final.stop_reason == "tool_use" and final.content[0].name == "get_time"
    events = raw_events(server, {"model": "tiny", "messages": ASK, **kw, **GREEDY})
    assert [k for k, _ in events] == ["message_start", "content_block_start", "ping", "content_block_delta",
                                      "content_block_stop", "message_delta", "message_stop"]
    assert events[1][1]["content_block"]["type"] == "tool_use"


def test_same_conversation_over_chat_completions_gives_the_same_answer(client, server) -> None:
    """Greedy equivalence, plain and with a tool_use / tool_result round trip (tools offered, choice auto): the
    Anthropic blocks render to the same prompt as OpenAI's tool_calls and tool messages."""
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    args = {"zone": "utc"}
    history = ASK + [{"role": "assistant", "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": args}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "12:00"}]}]
    oai_history = ASK + [
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_time", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "12:00"}]
    oai_tool = {"type": "function", "function": {"name": CLOCK["name"], "description": CLOCK["description"],
                                                 "parameters": CLOCK["input_schema"]}}
    system = [{"role": "system", "content": "Be brief."}]
    cases = [(dict(system="Be brief.", messages=ASK), dict(messages=system + ASK)),
             (dict(messages=history, tools=[CLOCK]), dict(messages=oai_history, tools=[oai_tool]))]
    for mkw, okw in cases:
        m = create(client, **mkw)
        c = oai.chat.completions.create(model="tiny", max_tokens=12, temperature=0, **okw)
        assert text_of(m) == c.choices[0].message.content
        assert m.usage.output_tokens == c.usage.completion_tokens
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == c.usage.prompt_tokens


BAD = [
    ({"messages": ASK}, "max_tokens"),  # Anthropic requires max_tokens
    ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 4}, "role"),
    ({"messages": ASK, "max_tokens": 4, "temperature": 1.5}, "temperature"),
    ({"messages": ASK, "max_tokens": 4, "temperature": "hot"}, "temperature"),
    ({"messages": ASK, "max_tokens": 0}, "max_tokens"),
    ({"messages": ASK, "max_tokens": 5000}, "max_tokens"),
    ({"messages": [], "max_tokens": 4}, "messages"),
    ({"messages": ASK + [{"role": "assistant", "content": "Sure"}], "max_tokens": 4}, "prefill"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4}, "image"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
      "max_tokens": 4}, "tool_use"),
    ({"messages": ASK, "max_tokens": 4, "stop_sequences": [""]}, "stop_sequences"),
    ({"messages": ASK, "max_tokens": 4, "top_p": 1.5}, "top_p"),
    ({"messages": ASK, "max_tokens": 4, "top_k": "3"}, "top_k"),
    ({"messages": ASK, "max_tokens": 4, "system": 5}, "system"),
    ({"messages": ASK, "max_tokens": 4, "metadata": {"user_id": 7}}, "metadata.user_id"),
    ({"messages": ASK, "max_tokens": 4, "tools": [CLOCK], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice"),
    ({"messages": ASK, "max_tokens": 4, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"messages": ASK, "max_tokens": 4, "tools": [{"name": "bad name!", "input_schema": {}}]}, "tools[0].name"),
    ({"messages": ASK, "max_tokens": 4, "tools": [{"name": "f"}]}, "input_schema"),
    ({"messages": ASK, "max_tokens": 4, "thinking": {"type": "enabled"}}, "budget_tokens"),
]


@pytest.mark.parametrize("body,word", BAD, ids=[w for _, w in BAD])
def test_bad_fields_are_the_sdks_bad_request(client, body, word) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", body={"model": "tiny", **body}, cast_to=object)
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error" and word in e.value.body["error"]["message"]


def test_other_errors_and_keys(client, server) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", messages=ASK, max_tokens=2)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": [{"type": "x"}]}])
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="tiny", messages=ASK, max_tokens=2)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0, timeout=60)  # Authorization
    assert text_of(create(bearer, max_tokens=2))
    r = httpx.get(server.url + "/v1/messages", headers={"x-api-key": KEY})
    assert r.status_code == 405 and r.json()["type"] == "error"
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 0},
                   headers={"x-api-key": KEY})  # other routes keep OpenAI's shape
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert text_of(create(client, max_tokens=2))  # still serving after all of the above


def test_langchain_chat_anthropic(client, server) -> None:
    lc = need("langchain_anthropic")
    chat = lc.ChatAnthropic(model="tiny", base_url=server.url, api_key=KEY, max_tokens=8, temperature=0,
                            max_retries=0)
    assert chat.invoke("What time is it?").content == text_of(create(client, max_tokens=8))
