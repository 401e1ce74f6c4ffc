"""serve's chat page (microgpt/use/chat.html at /) in a real headless Chromium against the real server: Stop ends a
reply (the server frees its row, even while the request waits in the engine's queue), turns round-trip (each reply
is the API's own for the whole conversation so far, so the page keeps it and sends all of it), the page shows
tokens/s, leaves the oldest turns out where the context is full, and keeps the conversation across a reload. The
screenshot goes to test-artifacts/serve-chat.png.

Needs Debian's `chromium` (CI: `apt-get install -y chromium`). Set MICROGPT_SKIP_BROWSER=1 to skip on a machine
without it; otherwise a missing browser is a failure, as for the dashboard's browser tests.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.proxy._cdp import Chromium
from tests.test_serve import served, wait_for

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


def turn(browser: Chromium, text: str, turns: int) -> str:
    """Type a message and send it (Enter), wait for the reply to end; its text."""
    enter = "new KeyboardEvent('keydown', {key: 'Enter'})"
    browser.eval(
        f"document.getElementById('input').value = {json.dumps(text)};"
        f"document.getElementById('input').dispatchEvent({enter})"
    )
    browser.wait_dataset(lambda ds: ds.get("turns") == str(turns) and ds.get("state") == "idle", f"reply {turns}", 120)
    return browser.eval("[...document.querySelectorAll('.msg.assistant .text')].pop().textContent")


def test_the_chat_page_keeps_the_conversation_streams_and_stops(run_256: Path, browser: Chromium) -> None:
    with served(run_256, "--max-batch", "2", decoding=False) as (api, client, url):
        page = url.removesuffix("v1")
        browser.open(page)
        browser.wait_dataset(lambda ds: ds.get("model") == "tiny-test", "the model's name")
        browser.eval(
            "localStorage.clear(); document.getElementById('temperature').value = '1';"
            "document.getElementById('seed').value = '7'; document.getElementById('max-tokens').value = '16'"
        )
        # Stop, while the engine holds the request in its queue: the page ends the reply, the server frees its row.
        browser.eval("document.getElementById('input').value = 'go'; document.getElementById('form').requestSubmit()")
        browser.wait_dataset(lambda ds: ds.get("state") == "streaming", "the reply under way")
        wait_for("the request in the engine", lambda: api.engine.held == 1)
        browser.eval("document.getElementById('stop').click()")
        browser.wait_dataset(lambda ds: ds.get("turns") == "1" and ds.get("state") == "idle", "the stopped reply")
        assert "stopped" in browser.eval("[...document.querySelectorAll('.msg.assistant')].pop().textContent")
        wait_for("the stopped reply's row to be freed", lambda: api.engine.held == 0)
        api.engine.start()
        # Two turns, sampled with a seed: each reply is the API's own for the whole conversation so far.
        history = [{"role": "user", "content": "go"}, {"role": "assistant", "content": ""}]
        for i, text in enumerate(["hi", "more"], 2):
            got = turn(browser, text, i)
            history.append({"role": "user", "content": text})
            want = client.chat.completions.create(
                model="tiny-test", messages=history, max_tokens=16, temperature=1, seed=7
            )
            assert got == want.choices[0].message.content and len(got.strip()) > 3, f"turn {i}: {got!r}"
            history.append({"role": "assistant", "content": got})
        ds = browser.dataset()
        assert float(ds["tokensPerS"]) > 0 and int(ds["tokens"]) > 0 and ds["error"] == ""
        assert "tokens/s" in browser.eval("document.getElementById('stats').textContent")
        browser.screenshot(ARTIFACTS / "serve-chat.png")
        # A conversation past the context: the page leaves the oldest turns out of the request, and says so.
        turn(browser, "x" * 120, 4)
        assert int(browser.dataset()["dropped"]) >= 2 and "left out" in browser.eval(
            "[...document.querySelectorAll('.msg.assistant')].pop().textContent"
        )
        browser.open(page)  # a reload keeps the conversation (localStorage)
        browser.wait_dataset(lambda ds: ds.get("turns") == "4", "the conversation after a reload")


def test_the_page_is_package_data_and_needs_no_network() -> None:
    """A non-editable install serves it (pyproject's package data, as the dashboard page), and it loads nothing
    from elsewhere: no http(s) URL, no external script, style or font."""
    import tomllib

    from microgpt.use import serve

    data = tomllib.loads((ARTIFACTS.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert serve.PAGE.name in data["microgpt.use"] and serve.PAGE.is_file()
    page = serve.PAGE.read_text()
    assert "http://" not in page and "https://" not in page and "<script src" not in page and "<link" not in page
