"""serve's chat page (microgpt/use/chat.html at /) in a real headless Chromium against the real server: two turns
round-trip (each reply is the API's own for the whole conversation so far, so the page keeps it and sends all of
it), the page shows tokens/s, and Stop ends a reply mid-way, keeps what came and frees the server's row. The
screenshot goes to test-artifacts/serve-chat.png.

Needs Debian's `chromium` (CI: `apt-get install -y chromium`). Set MICROGPT_SKIP_BROWSER=1 to skip on a machine
without it; otherwise a missing browser is a failure, as for the dashboard's browser tests.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.proxy._cdp import Chromium, chromium_binary
from tests.test_serve import start

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


@pytest.fixture
def browser(tmp_path: Path):
    binary = chromium_binary()
    if binary is None:
        if os.environ.get("MICROGPT_SKIP_BROWSER") == "1":
            pytest.skip("no chromium and MICROGPT_SKIP_BROWSER=1")
        pytest.fail("chromium is not installed: apt-get install -y chromium (or set MICROGPT_SKIP_BROWSER=1)")
    chrome = Chromium(tmp_path / "profile", binary)
    yield chrome
    chrome.close()


def turn(browser: Chromium, text: str, turns: int) -> str:
    """Type a message and send it (Enter), wait for the reply to end; its text."""
    enter = "new KeyboardEvent('keydown', {key: 'Enter'})"
    browser.eval(f"document.getElementById('input').value = {json.dumps(text)};"
                 f"document.getElementById('input').dispatchEvent({enter})")  # fmt: skip
    browser.wait_dataset(lambda ds: ds.get("turns") == str(turns) and ds.get("state") == "idle", f"reply {turns}", 120)
    return browser.eval("[...document.querySelectorAll('.msg.assistant .text')].pop().textContent")


def held(url: str) -> int:
    with urllib.request.urlopen(url.removesuffix("v1") + "stats", timeout=60) as res:
        return json.load(res)["held"]


def test_the_chat_page_keeps_the_conversation_streams_and_stops(run_256: Path, browser: Chromium) -> None:
    proc, url = start(run_256, "--max-batch", "2")
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        browser.open(url.removesuffix("v1"))
        browser.wait_dataset(lambda ds: ds.get("model") == "tiny-test", "the model's name")
        browser.eval(
            "localStorage.clear(); document.getElementById('temperature').value = '1';"
            "document.getElementById('seed').value = '7'; document.getElementById('max-tokens').value = '16'"
        )
        history = []
        for i, text in enumerate(["hi", "more"], 1):  # sampled with a seed: the text depends on every prompt token
            got = turn(browser, text, i)
            history.append({"role": "user", "content": text})
            want = client.chat.completions.create(model="tiny-test", messages=history, max_tokens=16, temperature=1,
                                                  seed=7)  # fmt: skip
            assert got == want.choices[0].message.content and len(got.strip()) > 3, f"turn {i}: {got!r}"
            history.append({"role": "assistant", "content": got})
        ds = browser.dataset()
        assert float(ds["tokensPerS"]) > 0 and int(ds["tokens"]) > 0 and ds["error"] == ""
        assert "tokens/s" in browser.eval("document.getElementById('stats').textContent")
        browser.screenshot(ARTIFACTS / "serve-chat.png")

        # Stop: the reply is cut where it was when its first text came, the row is freed, the page goes on.
        browser.eval("document.getElementById('max-tokens').value = '4000'; document.getElementById('temperature')"
                     ".value = '0'; document.getElementById('seed').value = ''")  # fmt: skip
        browser.eval("document.getElementById('input').value = 'go';"
                     "document.getElementById('form').requestSubmit();"
                     "new MutationObserver((_, obs) => { obs.disconnect(); document.getElementById('stop').click(); })"
                     ".observe([...document.querySelectorAll('.msg.assistant .text')].pop(),"
                     " {childList: true, characterData: true, subtree: true})")  # fmt: skip
        browser.wait_dataset(lambda ds: ds.get("turns") == "3" and ds.get("state") == "idle", "the stopped reply", 60)
        cut = browser.eval("[...document.querySelectorAll('.msg.assistant')].pop().textContent")
        ask = [*history, {"role": "user", "content": "go"}]
        whole = client.chat.completions.create(model="tiny-test", messages=ask, max_tokens=4000, temperature=0)
        assert "stopped" in cut and len(whole.choices[0].message.content) > 30
        deadline = time.monotonic() + 30
        while held(url):
            assert time.monotonic() < deadline, "the stopped reply's row was never freed"
            time.sleep(0.05)
        browser.screenshot(ARTIFACTS / "serve-chat-stopped.png")
        # A conversation past the context: the page leaves the oldest turns out of the request, and says so.
        browser.eval("document.getElementById('max-tokens').value = '16'")
        turn(browser, "x" * 120, 4)
        assert int(browser.dataset()["dropped"]) >= 2 and "left out" in browser.eval(
            "[...document.querySelectorAll('.msg.assistant')].pop().textContent"
        )
        browser.open(url.removesuffix("v1"))  # a reload keeps the conversation (localStorage)
        browser.wait_dataset(lambda ds: ds.get("turns") == "4", "the conversation after a reload")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_the_page_is_package_data_and_needs_no_network() -> None:
    """A non-editable install serves it (pyproject's package data, as the dashboard page), and it loads nothing
    from elsewhere: no http(s) URL, no external script, style or font."""
    import tomllib

    from microgpt.use import serve

    data = tomllib.loads((ARTIFACTS.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert serve.PAGE.name in data["microgpt.use"] and serve.PAGE.is_file()
    page = serve.PAGE.read_text()
    assert "http://" not in page and "https://" not in page and "<script src" not in page and "<link" not in page
