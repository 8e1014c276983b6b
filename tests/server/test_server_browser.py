"""The chat page at `/` in a real headless Chromium: send a message, see the reply stream in and its stats."""

from __future__ import annotations

import shutil

import pytest
from deps import in_ci, need

BROWSER = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser")) if p), None)


# In CI (.ci/run installs Debian's chromium) a missing browser fails the test instead.
@pytest.mark.skipif(BROWSER is None and not in_ci(), reason="no chromium binary (Debian: apt-get install chromium)")
def test_chat_page_streams_a_reply_with_stats(tiny_server):
    assert BROWSER is not None, "no chromium binary: .ci/run installs Debian's"
    sync_api = need("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=BROWSER, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(tiny_server.url + "/")
            page.wait_for_function("document.getElementById('model').textContent.startsWith('tiny')", timeout=15000)
            page.fill("#max_tokens", "24")
            page.fill("#temperature", "0")
            page.fill("#prompt", "hello")
            page.click("#send")
            page.wait_for_selector(".stats", timeout=30000)
            reply = page.locator(".msg.assistant").first
            assert int(reply.get_attribute("data-chunks")) >= 2  # it arrived in pieces, not at once
            assert reply.text_content()
            stats = page.locator(".stats").first.text_content()
            assert "generated 24" in stats and "prompt tokens" in stats and "(cached 0)" in stats
            assert "TTFT" in stats and "tok/s" in stats and "KV held" in stats
            assert not page.locator(".msg.error").count()
        finally:
            browser.close()
