"""Every client mistake gets an OpenAI-shaped error with the right status and `param`, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
from server_utils import servers_together

HELLO = [104, 101, 108, 108, 111]
CHAT = [{"role": "user", "content": "hi"}]

# (route, body, status, param); body None = sent as raw bytes below
CASES = [
    ("completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {"prompt": 5}, 400, "prompt"),
    ("completions", {}, 400, "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": [[]]}, 400, "prompt"),
    ("completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("completions", {"prompt": [1, -3]}, 400, "prompt[1]"),
    ("completions", {"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("completions", {"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ("completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("completions", {"prompt": "hi", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ("completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
    ("completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ("completions", {"prompt": "hi", "stop": "x" * 300}, 400, "stop"),
    ("completions", {"prompt": "hi", "stop_token_ids": [5000]}, 400, "stop_token_ids"),
    ("completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "n": 17}, 400, "n"),
    ("completions", {"prompt": "hi", "n": 2, "temperature": 0}, 400, "n"),
    ("completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": HELLO, "max_tokens": 252}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": "hi"}, 400, "messages"),
    ("chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": 123, "content": "hi"}]}, 400, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0]"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools[0]"),
    ("chat/completions", {"messages": CHAT, "chat_template": "{{ 1 }}"}, 400, "chat_template"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 300}, 400, "max_tokens"),
    ("chat/completions", {"messages": CHAT, "model": "nope"}, 404, "model"),
]


def check_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and "detail" not in body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def still_serving(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2, "temperature": 0}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("route,body,status,param", CASES, ids=[f"{c[0]}:{c[3]}:{i}" for i, c in enumerate(CASES)])
def test_bad_request_is_openai_shaped(tiny_server, route, body, status, param):
    err = check_error(httpx.post(f"{tiny_server.url}/v1/{route}", json=body, timeout=30), status, param)
    assert err["type"] == ("invalid_request_error" if status == 400 else "NotFoundError")


def test_malformed_json_and_content_type(tiny_server):
    url = tiny_server.url + "/v1/chat/completions"
    check_error(httpx.post(url, content=b'{"model":', headers={"content-type": "application/json"}), 400)
    check_error(httpx.post(url, content=b'\xff\xfe', headers={"content-type": "application/json"}), 400)
    check_error(httpx.post(url, content=b'[1, 2]', headers={"content-type": "application/json"}), 400)
    check_error(httpx.post(url, data={"messages": "hi"}), 400)  # form-encoded
    still_serving(tiny_server.url)


def test_context_length_wording_and_code(tiny_server):
    prompt = [104] * 256  # the context holds 256 tokens: a prompt must leave room for one output
    err = check_error(httpx.post(tiny_server.url + "/v1/completions", json={"prompt": prompt}), 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    assert err["message"].startswith("This model's maximum context length is 256 tokens. However, your request "
                                     "has 256 input tokens")
    err = check_error(httpx.post(tiny_server.url + "/v1/completions", json={"prompt": HELLO, "max_tokens": 252}),
                      400, "max_tokens")
    assert "maximum context length is 256 tokens" in err["message"]
    ok = httpx.post(tiny_server.url + "/v1/completions", json={"prompt": [104] * 250, "temperature": 0}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6  # default: the rest of the context
    still_serving(tiny_server.url)


def test_body_too_large_is_413(tiny_server):
    big = {"prompt": "hi", "user": "x" * 2_100_000}
    check_error(httpx.post(tiny_server.url + "/v1/completions", json=big, timeout=30), 413)
    still_serving(tiny_server.url)


def test_unknown_route_and_method_are_openai_shaped(tiny_server):
    check_error(httpx.get(tiny_server.url + "/v1/nothing"), 404)
    check_error(httpx.get(tiny_server.url + "/v1/completions"), 405)


def test_unknown_fields_accepted_and_logged_once(tiny_server):
    for _ in range(2):
        r = httpx.post(tiny_server.url + "/v1/completions",
                       json={"prompt": "hi", "max_tokens": 1, "frobnicate_xyz": 1}, timeout=30)
        assert r.status_code == 200
    assert tiny_server.output().count("frobnicate_xyz") == 1


def test_prompts_and_outputs_are_not_logged(tiny_server):
    secret = "zebra-secret-prompt"
    httpx.post(tiny_server.url + "/v1/completions", json={"prompt": secret, "max_tokens": 2}, timeout=30)
    assert secret not in tiny_server.output()


def test_api_key_required_compared_and_never_logged(tiny_gguf):
    key = "sk-test-key-123"
    with servers_together(((tiny_gguf, "--api-key", key, "--log-level", "debug"), {}),
                          ((tiny_gguf,), {"env": {"KVLM_API_KEY": key}})) as (s, from_env):
        url = s.url + "/v1/completions"
        body = {"prompt": "hi", "max_tokens": 1}
        assert check_error(httpx.post(url, json=body), 401)["type"] == "authentication_error"
        check_error(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401)
        check_error(httpx.get(s.url + "/v1/models"), 401)
        assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200
        assert key not in s.output()
        check_error(httpx.get(from_env.url + "/v1/models"), 401)
        assert httpx.get(from_env.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200


def test_serve_command_line_errors_are_one_line(tiny_gguf, tiny_server):
    import subprocess
    import sys

    from server_utils import ROOT

    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvlm", "serve", str(tiny_gguf), *args], capture_output=True,
                              text=True, timeout=120, cwd=ROOT)

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:  # seconds of imports each: at once
        bad, busy = pool.map(lambda args: serve(*args), [("--max-n", "0"), ("--port", str(tiny_server.port))])
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == "kvlm: error: --max-n must be >= 1"
    assert busy.returncode == 1 and "Traceback" not in busy.stderr
    assert busy.stderr.strip().splitlines()[-1].startswith("kvlm: error: could not start the server")
    assert "kvlm: serving tiny at http://127.0.0.1:" in tiny_server.output()  # the ready line


def test_serve_says_one_line_with_the_chat_page(tiny_gguf):
    """At the default log level, `kvlm serve` prints one line: where the chat page and the API are. The KV
    pool's line (and uvicorn's own start lines) come with -v."""
    with servers_together(((tiny_gguf, "--log-level", "info"), {}), ((tiny_gguf, "-v"), {})) as (server, verbose):
        lines, out = server.output().splitlines(), verbose.output()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"kvlm: serving tiny.gguf at {server.url} (chat page: {server.url}/, OpenAI API: "
                               f"{server.url}/v1; max_model_len 256; backend cpu/"), lines
    assert "attention paged-" in lines[0] or "reference" in lines[0], lines  # which kernels serve it
    assert lines[0].endswith("; reasoning parser none (auto: the chat template does not think))"), lines
    assert out.count("KV cache (paged):") == 1 and "chat page" in out  # -v after the subcommand; pool line once
    assert out.count("kvlm: backend cpu/") == 1  # -v: the backend with its reasons
