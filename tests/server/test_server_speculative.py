"""Speculative decoding through a real `kvlm serve --speculative draft:PATH` (the tiny model as its own draft),
driven by the real `openai` and `anthropic` SDKs: every API answers with the text generation without
speculation gives (greedy), and every usage counts the drafts: chat completions' `completion_tokens_details`,
the Responses API's `output_tokens_details` and the Messages API's `output_tokens_details`
(`accepted_prediction_tokens`, `rejected_prediction_tokens`)."""

from __future__ import annotations

import openai
import pytest
from deps import need
from server_utils import ServerProcess
from tiny_models import tiny_config, write_tiny_gguf

anthropic = need("anthropic")

ASK = [{"role": "user", "content": "ab ab ab ab ab"}]
N = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_gguf(tmp_path_factory.mktemp("specserve") / "tiny.gguf", tiny_config(max_position_embeddings=512))


@pytest.fixture(scope="module")
def server(model):
    with ServerProcess(model, "--served-model-name", "tiny", "--speculative", f"draft:{model}",
                       "--num-speculative-tokens", "3") as s:
        yield s


def reference(model) -> str:
    """The same chat, greedy, offline and without speculation."""
    from kvlm import LLM, SamplingParams

    llm = LLM(str(model), quiet=True)
    (out,) = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False)
    return out.outputs[0].text


def drafts(details) -> tuple[int, int]:
    d = details if isinstance(details, dict) else details.model_dump()
    return d["accepted_prediction_tokens"], d["rejected_prediction_tokens"]


def test_every_api_gives_the_same_text_and_counts_drafts(server, model) -> None:
    want = reference(model)
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    greedy = {"temperature": 0, "ignore_eos": True}
    chat = oa.chat.completions.create(model="tiny", messages=ASK, max_tokens=N, extra_body=greedy)
    assert chat.choices[0].message.content == want and chat.usage.completion_tokens == N
    acc, rej = drafts(chat.usage.completion_tokens_details)
    assert acc > 0 and acc + rej > 0

    resp = oa.responses.create(model="tiny", input=ASK, max_output_tokens=N, extra_body=greedy)
    assert resp.output_text == want and resp.usage.output_tokens == N
    assert drafts(resp.usage.output_tokens_details) == (acc, rej)  # the same request: the same drafts
    assert resp.usage.output_tokens_details.reasoning_tokens == 0

    an = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    msg = an.messages.create(model="tiny", messages=ASK, max_tokens=N, extra_body=greedy)
    assert "".join(b.text for b in msg.content if b.type == "text") == want and msg.usage.output_tokens == N
    assert drafts(msg.usage.model_dump()["output_tokens_details"]) == (acc, rej)  # (SDK 0.7x: a typed field)
    with an.messages.stream(model="tiny", messages=ASK, max_tokens=N, extra_body=greedy) as stream:
        assert "".join(stream.text_stream) == want
        final = stream.get_final_message()
    assert final.usage.output_tokens == N  # (message_delta's usage; message_start's counts nothing yet)
    assert drafts(final.usage.model_dump()["output_tokens_details"]) == (acc, rej)
