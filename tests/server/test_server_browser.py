"""The chat page at `/` in a real headless Chromium: send a message, see the reply stream in and its stats;
the KV panel against /metrics; a second turn's cached tokens; the same conversation over each API the page
can switch to (chat completions, Responses, Anthropic's Messages); stop; new chat.

Screenshots are kept as test artifacts in $KVLM_TEST_ARTIFACTS (default: test-artifacts/ at the repo root).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
from deps import in_ci, need
from server_utils import ServerProcess
from tiny_models import tiny_config, write_tiny_gguf

BROWSER = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser")) if p), None)
ARTIFACTS = Path(os.environ.get("KVLM_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))

# In CI (.ci/run installs Debian's chromium) a missing browser fails the tests instead.
pytestmark = pytest.mark.skipif(BROWSER is None and not in_ci(),
                                reason="no chromium binary (Debian: apt-get install chromium; .ci/run does)")


@pytest.fixture
def page_on(request):
    """page_on(server) -> a Chromium page at the server's chat page, model loaded."""
    assert BROWSER is not None, "no chromium binary: .ci/run installs Debian's"
    sync_api = need("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=BROWSER, headless=True, args=["--no-sandbox"])
        try:
            def open_page(server, model: str):
                page = browser.new_page(viewport={"width": 1200, "height": 800})
                page.goto(server.url + "/")
                page.wait_for_function(f"document.getElementById('model').textContent.startsWith('{model}')",
                                       timeout=15000)
                return page
            yield open_page
        finally:
            browser.close()


def screenshot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def say(page, text: str, n_stats: int) -> str:
    """Type a message, send it, wait for its stats line (the n_stats-th); returns that line."""
    page.fill("#prompt", text)
    page.click("#send")
    page.wait_for_function(f"document.querySelectorAll('.stats').length >= {n_stats}", timeout=60000)
    return page.locator(".stats").nth(n_stats - 1).text_content()


def test_chat_page_streams_a_reply_with_stats(tiny_server, page_on):
    page = page_on(tiny_server, "tiny")
    page.fill("#max_tokens", "24")
    page.fill("#temperature", "0")
    stats = say(page, "hello", 1)
    reply = page.locator(".msg.assistant").first
    assert int(reply.get_attribute("data-chunks")) >= 2  # it arrived in pieces, not at once
    assert reply.text_content()
    assert "generated 24" in stats and "prompt tokens" in stats and "(cached 0)" in stats
    assert "TTFT" in stats and "tok/s" in stats and "KV held" in stats
    assert not page.locator(".msg.error").count()
    # The page's own markdown renderer: code blocks and inline code escaped, emphasis, lists; no raw HTML.
    html = page.evaluate("markdown('# T\\n**b** and `<i>`\\n\\n- one\\n- two\\n```py\\nx < 1\\n```\\n<script>')")
    assert html == ("<h1>T</h1><p><strong>b</strong> and <code>&lt;i&gt;</code></p><ul><li>one</li><li>two</li></ul>"
                    '<pre><code class="language-py">x &lt; 1</code></pre><p>&lt;script&gt;</p>'), html


def test_kv_panel_matches_metrics_and_the_second_turn_comes_from_the_cache(tiny_server, page_on):
    page = page_on(tiny_server, "tiny")
    page.fill("#max_tokens", "20")
    page.fill("#temperature", "0")
    updates = int(page.get_attribute("#kv-panel", "data-updates") or 0)
    first = say(page, "hello there, please tell me all about the KV cache of this engine", 1)
    assert first.startswith("0 of ")  # nothing of a new conversation was cached
    page.wait_for_function(f"Number(document.getElementById('kv-panel').dataset.updates) > {updates}")
    second = say(page, "and more", 2)
    cached = int(page.locator(".stats").nth(1).get_attribute("data-cached"))
    prompt = int(page.locator(".stats").nth(1).get_attribute("data-prompt"))
    assert cached >= 16 and f"{cached} of {prompt} prompt tokens from the cache" in second  # the first turn's blocks
    # After both turns, with nothing running: the panel's counts are the server's /metrics gauges.
    n = int(page.get_attribute("#kv-panel", "data-updates"))
    page.wait_for_function(f"Number(document.getElementById('kv-panel').dataset.updates) > {n}", timeout=10000)
    m = tiny_server.metrics()
    assert int(page.get_attribute("#kv-used", "data-value")) == m["kvlm:kv_cache_used_blocks"]
    assert int(page.get_attribute("#kv-total", "data-value")) == m["kvlm:kv_cache_total_blocks"]
    assert int(page.get_attribute("#kv-cached", "data-value")) >= cached // 16  # the conversation, kept for reuse
    assert int(page.get_attribute("#kv-running", "data-value")) == 0
    screenshot(page, "chat-two-turns")
    page.click("#reset")  # new chat: the log empties, the next turn starts a new conversation
    assert page.locator(".msg").count() == 0
    assert say(page, "a different opening line, long enough to fill a block or two", 1).startswith("0 of ")


def test_every_api_streams_the_same_greedy_reply_and_reuses_the_cache(tiny_server, page_on):
    """The API switch: one greedy conversation over chat completions, Responses and Messages gives the same
    replies (the server renders every protocol through the same template; this tiny model's greedy text is
    mostly whitespace, so the 8 generated tokens each API's usage reports are checked too), and each second
    turn's prompt comes from the prefix cache."""
    page = page_on(tiny_server, "tiny")
    page.fill("#max_tokens", "8")
    page.fill("#temperature", "0")
    replies = {}
    for api in ("chat", "responses", "messages"):
        page.click("#reset")
        page.select_option("#api", api)
        say(page, "hello there, please tell me all about the KV cache of this engine", 1)
        second = say(page, "and more", 2)
        cached = int(page.locator(".stats").nth(1).get_attribute("data-cached"))
        assert cached >= 16 and "generated 8," in second and "error" not in second, (api, second)
        replies[api] = page.locator(".msg.assistant").all_text_contents()
    assert replies["responses"] == replies["chat"] and replies["messages"] == replies["chat"], replies
    assert page.locator(".msg.error").count() == 0


@pytest.fixture(scope="module")
def long_server(tmp_path_factory: pytest.TempPathFactory):
    """The tiny model with a 60,000-token context, so a reply runs long enough to stop by hand: the engine
    decodes it at 3,000-7,000 tokens a second here, and a 3,500-token reply (a 4,096-token context, until
    2026-12-05) could end before the click."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("long") / "tiny4k.gguf", tiny_config(max_position_embeddings=60000))
    with ServerProcess(path, "--served-model-name", "tiny4k", "--max-model-len", "60000") as server:
        yield server


def test_stop_aborts_a_long_reply(long_server, page_on):
    page = page_on(long_server, "tiny4k")
    page.fill("#max_tokens", "59000")
    page.fill("#temperature", "0")
    page.fill("#prompt", "write forever")
    page.click("#send")
    page.wait_for_function("Number(document.querySelector('.msg.assistant').dataset.chunks) >= 10", timeout=60000)
    # The panel shows this chat's blocks while it streams.
    page.wait_for_function("Number(document.getElementById('kv-conv').dataset.value) > 0", timeout=10000)
    screenshot(page, "chat-streaming")
    assert long_server.metrics()["kvlm:num_requests_running"] == 1
    page.click("#stop")
    page.wait_for_selector(".stats", timeout=30000)
    assert "finish stopped" in page.locator(".stats").first.text_content()
    assert page.locator(".msg.assistant").first.text_content()  # what came stays on the page
    deadline = time.monotonic() + 10
    while long_server.metrics()["kvlm:num_requests_running"] != 0:
        assert time.monotonic() < deadline, "the stopped request still runs on the server"
        time.sleep(0.1)
    aborted = long_server.metrics().get('kvlm:request_success_total{finished_reason="abort"}', 0)
    assert aborted >= 1
    assert httpx.get(long_server.url + "/kv_cache", timeout=5).json()["running"] == 0
