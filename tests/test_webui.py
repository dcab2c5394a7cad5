"""The chat playground at `/`, in a real headless Chromium (Debian's, which the Makefile installs) driven by
Playwright: load the page, send a message, watch the answer stream in, read the metrics panel, take a screenshot.
SIEVE_PLAYGROUND_SCREENSHOT=path also writes the screenshot there (docs/playground.png is made that way)."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest

from live_server import API_KEY, start_server
from reference import CAPITAL_QUESTION, chat_ids, clear_greedy_answer

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# As root, with no network: no sandbox, and none of Chromium's background connections.
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


SYSTEM = "You are a concise assistant."


@pytest.fixture(scope="module")
def served(smollm2_server):
    return smollm2_server


def test_playground_streams_a_chat_and_shows_metrics(served, tmp_path):
    """A streamed answer that grows in several updates, its TTFT and tokens/s, the metrics panel, and the conversation
    kept over a reload. The answer is the server's own greedy answer to the same messages, and it names Paris: the
    question is one the reference answers with every token well clear of its runner-up (tests/reference.py)."""
    from playwright.sync_api import expect, sync_playwright
    from sieve.models.default import default_model_path

    server, engine = served
    assert os.path.exists(CHROMIUM), "Debian's chromium is not installed (make install installs it)"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server + "/")
            expect(page.locator("#model")).to_have_text("smollm2-135m-instruct")
            page.fill("#apikey", API_KEY)
            page.dispatch_event("#apikey", "change")
            for field, value in (("#temperature", "0"), ("#max_tokens", "48"), ("#system", SYSTEM)):
                page.fill(field, value)
                page.dispatch_event(field, "change")
            # count the updates the answer's text goes through: a streamed answer grows in many
            page.evaluate("""() => { window.updates = 0; new MutationObserver(() => { window.updates++; })
                .observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true}); }""")
            page.fill("#input", CAPITAL_QUESTION)
            page.keyboard.press("Enter")
            answer = page.locator(".msg.assistant .content").last
            expect(page.locator(".msg.assistant .stats").last).to_contain_text("tokens/s", timeout=60_000)
            expect(page.locator("#send")).to_be_enabled(timeout=60_000)
            shown = answer.inner_text()
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": CAPITAL_QUESTION}]
            direct = httpx.post(server + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                                json={"messages": messages, "temperature": 0, "max_tokens": 48}).json()
            assert shown.strip() == direct["choices"][0]["message"]["content"].strip()
            clear_greedy_answer(default_model_path(), chat_ids(engine.tokenizer, CAPITAL_QUESTION, SYSTEM), engine.tokenizer, "Paris")
            assert "Paris" in shown
            assert page.evaluate("window.updates") > 5  # streamed, not delivered at once
            stats = page.locator(".msg.assistant .stats").last.inner_text()
            assert "TTFT" in stats and "tokens/s" in stats
            expect(page.locator("#mtable")).to_contain_text("Prefix-cache hit rate", timeout=10_000)
            expect(page.locator("#mtable")).to_contain_text("Generated tokens")
            # kept in the browser: a reload shows the conversation again
            page.reload()
            expect(page.locator(".msg.user").first).to_have_text("user" + CAPITAL_QUESTION)
            expect(page.locator("#temperature")).to_have_value("0")
            path = tmp_path / "playground.png"
            page.screenshot(path=str(path))
            assert path.stat().st_size > 10_000
            if os.environ.get("SIEVE_PLAYGROUND_SCREENSHOT"):
                shutil.copy(path, os.environ["SIEVE_PLAYGROUND_SCREENSHOT"])
            assert not errors, errors
        finally:
            browser.close()


def test_no_webui_serves_no_page(llama_engine_factory):
    url, stop = start_server(llama_engine_factory().llm_engine, webui=False)
    try:
        r = httpx.get(url + "/")
        assert r.status_code == 404 and "error" in r.json()
    finally:
        stop()
