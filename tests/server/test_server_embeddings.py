"""`/v1/embeddings` on the shared tiny `kvlm serve` (tests/conftest.py `tiny_server`), driven by the real
`openai` client and LangChain's `OpenAIEmbeddings`: the vectors are `LLM.embed`'s, bit for bit, in float and
base64 encodings; bad input is OpenAI's 400 and the server keeps serving."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest
from deps import need, need_native

from kvlm import LLM

TEXTS = ["hello world", "the quick brown fox", "hello hello hello hello"]


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_server) -> LLM:
    """The served model offline, with the server's settings (the GGUF's weights as stored, on 2 threads)."""
    return LLM(str(tiny_server.model_path), num_threads=2)


def _ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(text)


def test_string_list_and_token_ids_equal_llm_embed(client, offline):
    need_native()  # the server batches them: equal bits need the row-invariant kernels
    want = [o.outputs.embedding for o in offline.embed(TEXTS)]
    one = client.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float")
    assert one.data[0].embedding == want[0] and one.data[0].index == 0 and one.object == "list"
    assert one.model == "tiny" and one.usage.prompt_tokens == one.usage.total_tokens == len(_ids(offline, TEXTS[0]))
    many = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert [d.embedding for d in many.data] == want and [d.index for d in many.data] == [0, 1, 2]
    assert many.usage.prompt_tokens == sum(len(_ids(offline, t)) for t in TEXTS)
    ids = client.embeddings.create(model="tiny", input=_ids(offline, TEXTS[1]), encoding_format="float")
    assert ids.data[0].embedding == want[1]
    lists = client.embeddings.create(model="tiny", input=[_ids(offline, t) for t in TEXTS], encoding_format="float")
    assert [d.embedding for d in lists.data] == want


def test_base64_is_little_endian_float32_and_the_sdk_default(client, tiny_server):
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    raw = client.embeddings.with_raw_response.create(model="tiny", input=TEXTS)  # the SDK's default
    assert json.loads(raw.http_request.content)["encoding_format"] == "base64"
    assert [d.embedding for d in raw.parse().data] == [d.embedding for d in floats.data]  # decoded by the SDK
    body = httpx.post(tiny_server.url + "/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert vec.tolist() == floats.data[0].embedding and len(vec) == 64
    assert abs(float(np.linalg.norm(vec)) - 1) < 1e-6


def test_langchain_openai_embeddings(tiny_server, client):
    lc = need("langchain_openai")
    emb = lc.OpenAIEmbeddings(model="tiny", base_url=tiny_server.url + "/v1", api_key="none",
                              check_embedding_ctx_length=False, max_retries=0)
    want = [d.embedding for d in client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float").data]
    assert emb.embed_documents(TEXTS) == want
    assert emb.embed_query(TEXTS[2]) == want[2]


@pytest.mark.parametrize("body, param, needle", [
    ({"input": ""}, "input", "must not be empty"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": ["a", ""]}, "input", "must not be empty"),
    ({"input": 5}, "input", "valid string"),
    ({"input": [1.5]}, "input[0]", "valid"),
    ({"input": [[1, 2], [100000]]}, "input", "out of vocabulary"),
    ({"input": [5] * 257}, "input", "maximum context length is 256 tokens"),
    ({"input": "hi", "dimensions": 8}, "dimensions", "Matryoshka"),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format", "'float' or 'base64'"),
])
def test_bad_input_is_openai_400_and_the_server_keeps_serving(client, body, param, needle):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny", **body)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param and needle in err["message"], err
    if "context" in needle:
        assert err["code"] == "context_length_exceeded"
    assert len(client.embeddings.create(model="tiny", input="still serving").data[0].embedding) == 64


def test_unknown_model_is_404_and_full_size_dimensions_is_accepted(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="x")
    full = client.embeddings.create(model="tiny-alias", input="x", dimensions=64, encoding_format="float")
    assert full.data[0].embedding == client.embeddings.create(model="tiny", input="x", encoding_format="float").data[
        0].embedding


def test_pooling_flag_reaches_the_engine_config():
    from kvlm.cli.main import build_parser
    from kvlm.cli.serve import _engine_config

    parser = build_parser(["serve"])
    assert _engine_config(parser.parse_args(["serve", "m.gguf", "--pooling", "mean"])).pooling == "mean"
    assert _engine_config(parser.parse_args(["serve", "m.gguf"])).pooling is None  # the model's own default
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "m.gguf", "--pooling", "max"])
