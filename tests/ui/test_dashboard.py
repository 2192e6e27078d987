"""The dashboard at /ui, driven in a real headless Chromium (Debian's, through Playwright) against
real daemons: its state, an eviction from the page that ends the worker process, a streamed
playground reply, a 507 shown as the action's result, and a daemon with an API key that shows a
page without the key nothing.

One daemon and one browser serve the module; the API-key daemon is the only other one.
`MLXSUP_SCREENSHOT=docs/dashboard.png` also writes the README's screenshot (two models loaded,
one evicted).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Daemon, assert_gone

playwright_api = pytest.importorskip("playwright.sync_api")

# The flags that let headless Chromium run as root on an offline machine without reaching out.
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 30_000
playwright_api.expect.set_options(timeout=TIMEOUT_MS)


def chromium() -> str:
    found = os.environ.get("MLXSUP_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if sys.platform.startswith("linux"):  # CI installs it (.ci/run): missing here is a set-up error, not a skip
        pytest.fail("no Chromium for the dashboard's browser tests: apt-get install chromium")
    pytest.skip("no Chromium on PATH (set MLXSUP_CHROMIUM to a Chromium or Chrome binary)")


@pytest.fixture(scope="module")
def browser() -> Iterator:
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium(), args=CHROMIUM_FLAGS)
        yield b
        b.close()


@pytest.fixture
def page(browser) -> Iterator:
    context = browser.new_context(viewport={"width": 1500, "height": 1000})
    context.set_default_timeout(TIMEOUT_MS)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" and not expected_noise(msg.text)
          else None)
    yield pg
    context.close()
    assert not errors, f"the page logged errors: {errors}"  # a CSP refusal of its own script shows here


def expected_noise(text: str) -> bool:
    """Chromium's own console lines for an HTTP error status or a refused cross-origin fetch: the tests cause
    those on purpose; anything else (an uncaught error, a CSP refusal of the page's own script) fails the test."""
    return text.startswith("Failed to load resource") or "CORS policy" in text


def row(page, model: str):
    return page.locator(f'#models tr[data-model="{model}"]')


def load(daemon: Daemon, model: str) -> int:
    r = httpx.post(f"{daemon.url}/api/models/{model}/load", timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["pid"]


def test_the_page_lists_both_models_with_their_states(daemon: Daemon, page) -> None:
    pids = {m: load(daemon, m) for m in ("tiny", "tiny2")}
    page.goto(daemon.url + "/")  # redirects to /ui
    assert page.url.endswith("/ui")
    for model, pid in pids.items():
        playwright_api.expect(row(page, model).locator(".state")).to_have_text("ready")
        playwright_api.expect(row(page, model).locator(".pid")).to_have_text(str(pid))
    playwright_api.expect(page.locator("#models-label")).to_contain_text("admission ceiling")
    playwright_api.expect(page.locator("#system-label")).to_contain_text("evicts idle models at 90%")


def test_a_streamed_playground_message_appears(daemon: Daemon, page) -> None:
    load(daemon, "tiny")
    page.goto(daemon.url + "/ui")
    playwright_api.expect(page.locator('#play-model option[value="tiny"]')).to_have_count(1)
    page.select_option("#play-model", "tiny")
    page.fill("#play-input", "Tell me a story")
    page.click("#play-send")
    playwright_api.expect(page.locator("#play-status")).to_have_attribute("data-done", "true")
    assert page.locator("#play-output").inner_text().strip()
    # streamed: the page read server-sent events one by one (a first delta, the finish, the usage at least);
    # a whole JSON reply has none. Not DOM growths: several events in one network read update it once.
    assert int(page.locator("#play-status").get_attribute("data-events") or 0) >= 3
    # random weights: the reply ends at max_tokens or at an EOS the model happens to draw
    playwright_api.expect(page.locator("#play-status")).to_contain_text(re.compile(r"^done: (length|stop) · first token"))


def test_evict_from_the_page_ends_the_worker_and_the_page_shows_it_gone(daemon: Daemon, page) -> None:
    load(daemon, "tiny")
    pid = load(daemon, "tiny2")
    page.goto(daemon.url + "/ui")
    tiny2 = row(page, "tiny2")
    playwright_api.expect(tiny2.locator(".pid")).to_have_text(str(pid))

    tiny2.locator("button.evict-now").click()  # asked first: Cancel leaves the model alone
    playwright_api.expect(page.locator("#confirm-text")).to_contain_text("Evict tiny2 now?")
    page.click("#confirm-cancel")
    assert daemon.model("tiny2")["pid"] == pid and page.locator("#results li").count() == 0

    tiny2.locator("button.evict-now").click()
    page.click("#confirm-ok")
    result = page.locator('#results li[data-model="tiny2"]')
    playwright_api.expect(result).to_have_class("ok")
    playwright_api.expect(result).to_contain_text(f"pid {pid} gone")
    assert_gone([pid])
    playwright_api.expect(tiny2.locator(".state")).to_have_text("stopped")
    playwright_api.expect(tiny2.locator(".pid")).to_have_text("-")
    evicted = page.locator(f'#evictions tr[data-pid="{pid}"]')
    playwright_api.expect(evicted.locator(".gone")).to_have_text("gone")
    playwright_api.expect(evicted).to_contain_text("now")
    playwright_api.expect(row(page, "tiny").locator(".state")).to_have_text("ready")
    row(page, "tiny").locator("button.clear-hot").click()
    page.click("#confirm-ok")
    playwright_api.expect(page.locator('#results li[data-action="hot"]')).to_contain_text("cleared hot cache: ")
    playwright_api.expect(page.locator('#results li[data-action="hot"]')).to_have_class("ok")
    if shot := os.environ.get("MLXSUP_SCREENSHOT"):  # the README's picture: a reply streamed, a few chart samples
        page.wait_for_timeout(2500)  # a picture, not a check: a chart sample before the reply
        page.fill("#play-input", "Hello")
        page.click("#play-send")
        playwright_api.expect(page.locator("#play-status")).to_have_attribute("data-done", "true")
        page.wait_for_timeout(4500)  # a picture, not a check: the chart shows the samples around the reply
        page.screenshot(path=shot, full_page=True)


@pytest.fixture
def keyed(daemon_factory, model_dir: Path) -> Daemon:
    """A daemon with an API key and a 1 MiB memory ceiling: every load is refused with a 507."""
    return daemon_factory("--model-dir", str(model_dir), "--memory-ceiling", "1MiB", name="keyed",
                          env={"MLXSUP_API_KEY": "s3cret-key"})


def test_with_an_api_key_the_page_shows_nothing_until_given_it(keyed: Daemon, page) -> None:
    for path in ("/api/status", "/api/config", "/metrics", "/v1/models"):  # all the page reads
        assert httpx.get(keyed.url + path).status_code == 401, path
    assert httpx.get(keyed.url + "/ui").status_code == 200  # the bare page: no state in it
    page.goto(keyed.url + "/ui")
    playwright_api.expect(page.locator("#key-section")).to_be_visible()
    assert page.locator("#main").is_hidden()
    text = page.locator("body").inner_text()
    assert "tiny" not in text and not re.search(r"\d+(\.\d+)? (MiB|GiB)", text), text

    page.fill("#key-input", "wrong")
    page.click("#key-submit")
    playwright_api.expect(page.locator("#key-error")).to_contain_text("refused")
    assert "tiny" not in page.locator("body").inner_text()

    page.fill("#key-input", "s3cret-key")
    page.click("#key-submit")
    playwright_api.expect(row(page, "tiny").locator(".state")).to_have_text("stopped")
    row(page, "tiny").locator("button.load").click()
    page.click("#confirm-ok")
    result = page.locator('#results li[data-model="tiny"]')
    playwright_api.expect(result).to_have_class("error")
    playwright_api.expect(result).to_contain_text("HTTP 507 insufficient_memory")

    # a page of another origin, even one that knows the key, gets nothing: the guard refuses its Origin
    evil = "http://evil.example.test"
    page.route(evil + "/", lambda route: route.fulfill(body="<html><body>evil</body></html>", content_type="text/html"))
    page.goto(evil + "/")
    foreign = page.evaluate("""url => fetch(url, {headers: {Authorization: 'Bearer s3cret-key'}})
                                        .then(r => 'status ' + r.status, e => 'refused')""", keyed.url + "/api/status")
    assert foreign == "refused"
    refused = httpx.get(keyed.url + "/api/status", headers={"Origin": evil, "Authorization": "Bearer s3cret-key"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "origin_not_allowed"
