"""OpenAI's Responses API (`/v1/responses`) through a real `kvlm serve`, driven by the real `openai` client.

The session's tiny random model with a 4096-token context (`tiny_server_4k`: a tool prompt is a few hundred
byte tokens). Its greedy answer is a run of newlines, so the text checks also sample with a seed (a kvlm
extension, sent in `extra_body`): the same tokens over chat completions and responses, streamed or not,
mean the same prompt and the same sampling. Tool calls and JSON are decided by the grammar whatever the
weights.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import pytest
from deps import need
from pydantic import BaseModel

from kvlm.config import EngineConfig

openai = need("openai")

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                          "required": ["city"], "additionalProperties": False}}
FORCE = {"type": "function", "name": "get_weather"}
SEEDED = dict(temperature=1.0, extra_body={"seed": 7})


class Verdict(BaseModel):
    answer: Literal["yes", "no"]


@pytest.fixture(scope="module")
def client(tiny_server_4k) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server_4k.url + "/v1", api_key="none", max_retries=0, timeout=60)


def prompt_len(server, messages: list[dict]) -> int:
    return httpx.post(server.url + "/tokenize", json={"model": "tiny", "messages": messages}).json()["count"]


def test_create_text_and_retrieve(client, tiny_server_4k) -> None:
    r = client.responses.create(model="tiny", instructions="Be brief.", input="Name a colour.",
                                max_output_tokens=12, **SEEDED)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert r.status in ("completed", "incomplete") and r.output[0].type == "message" and r.output_text
    assert (r.status == "incomplete") == (r.usage.output_tokens == 12)
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    assert r.usage.input_tokens == prompt_len(tiny_server_4k, msgs)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model="tiny", input="x", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), SEEDED], ids=["greedy", "seeded"])
def test_same_tokens_as_chat_completions(client, sampling) -> None:
    msgs = [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=14, **sampling)
    resp = client.responses.create(model="tiny", instructions=msgs[0]["content"],
                                   input=[{"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}],
                                   max_output_tokens=14, **sampling)
    assert resp.output_text == chat.choices[0].message.content
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                   chat.usage.completion_tokens)


def test_stream_events_in_order_and_equal_to_non_streamed(client) -> None:
    kw = dict(model="tiny", input="Tell me a story.", max_output_tokens=16, **SEEDED)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == whole.output_text
    final = events[-1].response
    assert final.id == events[0].response.id and final.output_text == text and final.status == whole.status
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens,
                                                                     whole.usage.output_tokens)
    # `responses.stream` rebuilds the response from the events; a schema-bound answer ends with "completed".
    with client.responses.stream(model="tiny", input="Is it raining?", text_format=Verdict,
                                 max_output_tokens=24, **SEEDED) as stream:
        seen = [e.type for e in stream]
        parsed = stream.get_final_response()
    assert seen[-1] == "response.completed" and parsed.output_parsed in (Verdict(answer="yes"), Verdict(answer="no"))
    same = client.responses.parse(model="tiny", input="Is it raining?", text_format=Verdict, max_output_tokens=24,
                                  **SEEDED)
    assert same.output_parsed == parsed.output_parsed and same.output_text == parsed.output_text


def test_tool_call_and_function_call_output_round_trip(client) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.responses.create(model="tiny", input=ask, tools=[WEATHER], tool_choice=FORCE, max_output_tokens=80,
                                temperature=0.0)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    assert set(json.loads(call.arguments)) == {"city"}
    # Streamed: the same call, item by item.
    events = list(client.responses.create(model="tiny", input=ask, tools=[WEATHER], tool_choice=FORCE,
                                          max_output_tokens=80, temperature=0.0, stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert events[3].delta == events[4].arguments == call.arguments and events[5].item.name == call.name
    # The result goes back as the next input: the whole history sent again, or continued from the stored one.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 18}'}
    resent = client.responses.create(model="tiny", input=[*ask, call, result], tools=[WEATHER],
                                     max_output_tokens=8, **SEEDED)
    continued = client.responses.create(model="tiny", previous_response_id=r.id, input=[result], tools=[WEATHER],
                                        max_output_tokens=8, **SEEDED)
    assert continued.output_text == resent.output_text and continued.previous_response_id == r.id
    assert continued.usage.input_tokens == resent.usage.input_tokens > r.usage.input_tokens
    assert continued.usage.input_tokens_details.cached_tokens > 0


def test_previous_response_id_reuses_the_cached_prefix(client, tiny_server_4k) -> None:
    bs = EngineConfig().block_size
    first = client.responses.create(model="tiny", instructions="Lighthouse mode.", max_output_tokens=6,
                                    input="A unique opening line about lighthouses and their keepers.", **SEEDED)
    assert first.usage.input_tokens_details.cached_tokens == 0
    second = client.responses.create(model="tiny", instructions="Lighthouse mode.", previous_response_id=first.id,
                                     input="And then?", max_output_tokens=6, **SEEDED)
    msgs = [{"role": "system", "content": "Lighthouse mode."},
            {"role": "user", "content": "A unique opening line about lighthouses and their keepers."},
            {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And then?"}]
    assert second.usage.input_tokens == prompt_len(tiny_server_4k, msgs)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // bs * bs > 0
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, **SEEDED)
    assert second.output_text == chat.choices[0].message.content


@pytest.mark.parametrize("body, status, param", [
    ({"temperature": 3.0}, 400, "temperature"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"top_p": 1.5}, 400, "top_p"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"max_output_tokens": 5000}, 400, "max_output_tokens"),
    ({"input": []}, 400, "input"),
    ({"input": [{"type": "image_generation_call"}]}, 400, "input[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input[0]"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, 400, "text.format"),
    ({"text": {"format": {"type": "xml"}}}, 400, "text.format"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, 400, "tools[0].name"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, 400, "tool_choice"),
    ({"background": True}, 400, "background"),
    ({"reasoning": {"effort": "extreme"}}, 400, "reasoning.effort"),
    ({"reasoning": {"context": "all_turns"}}, 400, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, 400, "include"),
    ({"text": {"verbosity": "low"}}, 400, "text.verbosity"),
    ({"previous_response_id": "resp_missing"}, 404, "previous_response_id"),
    ({"model": "gpt-4o"}, 404, "model"),
])
def test_bad_fields_get_openai_errors(client, body, status, param) -> None:
    kind = openai.NotFoundError if status == 404 else openai.BadRequestError
    with pytest.raises(kind) as e:
        client.responses.create(**{"model": "tiny", "input": "hi", "max_output_tokens": 4, **body})
    assert e.value.status_code == status and e.value.param == param, e.value.body
    assert set(e.value.body) == {"message", "type", "param", "code"}


def test_retrieve_cancel_and_missing_ids(client) -> None:
    # What agent frameworks send by default is accepted: nothing in it asks for what kvlm cannot do.
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=2, reasoning={"effort": None},
                                include=["reasoning.encrypted_content"], text={"verbosity": "medium"})
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(r.id)  # no background mode: every response has finished
    for call in (client.responses.retrieve, client.responses.cancel, client.responses.delete):
        with pytest.raises(openai.NotFoundError):
            call("resp_missing")
    assert client.responses.retrieve(r.id).output_text == r.output_text  # still serving
