"""`kvlm serve` on a mixture-of-experts model (a tiny random Qwen3-MoE GGUF, Q8_0), driven by the real `openai`
client: greedy completions have the offline engine's tokens, alone and in concurrent requests (the batch never
changes a token's bits), streaming equals non-streaming, a JSON-schema response validates, the ngram
speculator changes nothing, and a bad request is one error while the server keeps serving."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest
from deps import need_native
from server_utils import ServerProcess
from tiny_moe import moe_config, moe_state_dict, write_moe_gguf

from kvlm import LLM, SamplingParams

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["a", "bb"]}},
          "required": ["n", "tag"], "additionalProperties": False}
PROMPTS = ["The experts", "ab ab ab ab", "Mixture", "zz", "one two one two", "q"]


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    need_native()
    cfg = moe_config("qwen3_moe", head_dim=32, tie_word_embeddings=True)
    return write_moe_gguf(tmp_path_factory.mktemp("moe-served") / "moe-Q8_0.gguf", cfg, moe_state_dict(cfg),
                          tensor_type="Q8_0")


@pytest.fixture(scope="module")
def offline(moe_path: Path) -> list[str]:
    """Each prompt's greedy 12 tokens from the offline engine."""
    outs = LLM(str(moe_path)).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module", params=[[], ["--speculative", "ngram"]], ids=["plain", "ngram"])
def client(request: pytest.FixtureRequest, moe_path: Path):
    with ServerProcess(moe_path, "--served-model-name", "moe", "--max-num-seqs", "8", *request.param) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def complete(client: openai.OpenAI, prompt: str, **kw) -> str:
    r = client.completions.create(model="moe", prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True}, **kw)
    return r.choices[0].text


def test_completions_equal_the_offline_engine_alone_and_concurrent(client, offline: list[str]) -> None:
    assert [complete(client, p) for p in PROMPTS] == offline
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(lambda p: complete(client, p), PROMPTS)) == offline


def test_stream_equals_non_stream(client, offline: list[str]) -> None:
    chunks = client.completions.create(model="moe", prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == offline[1]


def test_json_schema_chat_validates(client) -> None:
    for seed in range(3):
        r = client.chat.completions.create(
            model="moe", messages=[{"role": "user", "content": "a number"}], max_tokens=60, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_bad_request_is_one_error_and_serving_continues(client, offline: list[str]) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="moe", prompt="x", max_tokens=-3)
    assert complete(client, PROMPTS[0]) == offline[0]
