"""The dashboard in a user's first hour (issue 49, item 5), in a real headless Chromium against a real daemon:
at 1280 and 1400 px wide the models table fits (every row's Load / Evict buttons in view, nothing to scroll
sideways), the playground offers a chat model first even when an embedding model sorts first, and the
throughput and TTFT panels count streams that began before the page opened.

The daemon serves what a first hour has: an embedding model that sorts first, a reranker, a chat model with a
long hub-style name, one whose weights are cut short (its load fails: a long last error), and `tiny`; all
loaded, with an idle TTL, so every column holds its widest everyday text.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import MLXSUP, Daemon, make_model, start_daemon, wait_for
from tests.ui.test_dashboard import browser, page, playwright_api, row  # noqa: F401 (fixtures)

EMBEDDING, RERANK, LONG, BROKEN = "all-minilm-l6-v2", "bge-reranker-v2-m3", "mistral-small-3.2-24b-instruct-2506-4bit", \
    "broken-model"
BUTTONS = ("load", "evict-drain", "evict-now", "clear-hot", "clear-ssd")


def make(path: Path, arch: str | None = None) -> None:
    if arch is None:
        make_model(path)
    else:
        subprocess.run([*MLXSUP, "make-model", str(path), "--arch", arch, "--preset", "tiny"], check=True,
                       capture_output=True)


@pytest.fixture(scope="module")
def first_hour(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("first-hour")
    models = root / "models"
    make(models / EMBEDDING, "bert")
    make(models / RERANK, "qwen3-reranker")
    make(models / LONG)
    make(models / "tiny")
    shutil.copytree(models / "tiny", models / BROKEN)
    weights = models / BROKEN / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)  # an incomplete download: the load fails with a long message
    d = start_daemon(root / "state", "--model-dir", str(models), env={"MLXSUP_DEFAULT_TTL_S": "600"})
    kinds = {m["id"]: m["kind"] for m in d.status()["models"]}
    assert kinds == {EMBEDDING: "embedding", RERANK: "rerank", LONG: "chat", BROKEN: "chat", "tiny": "chat"}, kinds
    assert sorted(kinds)[0] == EMBEDDING  # the models list sorts it first: the old page's default
    for model in kinds:
        r = httpx.post(f"{d.url}/api/models/{model}/load", timeout=120)
        assert r.status_code == (503 if model == BROKEN else 200), r.text
    for model in (LONG, "tiny"):  # a prompt cache with entries, bytes and hits in its cell
        for _ in range(2):
            r = httpx.post(d.v1 + "/chat/completions", timeout=120,
                           json={"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 200, r.text
    yield d
    assert d.stop() == 0


@pytest.mark.parametrize("width", [1280, 1400])
def test_every_models_actions_show_without_scrolling_sideways(first_hour: Daemon, page, width: int) -> None:  # noqa: F811
    page.set_viewport_size({"width": width, "height": 900})
    page.goto(first_hour.url + "/ui")
    ids = [m["id"] for m in first_hour.status()["models"]]
    playwright_api.expect(row(page, BROKEN).locator(".state")).to_contain_text("failed")
    playwright_api.expect(page.locator("#models")).to_contain_text("the model failed to load")  # its last error
    playwright_api.expect(row(page, "tiny").locator(".state")).to_have_text("ready")
    for model in ids:
        for button in BUTTONS:
            playwright_api.expect(row(page, model).locator(f"button.{button}")).to_be_visible()
    # measured in one go: the page redraws its rows every second. The window scrolled down to each button (only
    # down: nothing is scrolled sideways), it lies within the window and nothing lies over it (a sticky cell, a
    # neighbour): the point at its centre is the button itself.
    boxes = page.evaluate("""([ids, buttons]) => ids.flatMap((id) => buttons.map((cls) => {
        const b = document.querySelector(`#models tr[data-model="${id}"] button.${cls}`);
        if (!b) return { id, cls, missing: true };
        window.scrollTo(0, window.scrollY + b.getBoundingClientRect().top - window.innerHeight / 2);
        const r = b.getBoundingClientRect(), table = document.getElementById("models");
        return { id, cls, left: r.left, right: r.right, width: r.width,
                 scrolled: window.scrollX + table.parentElement.scrollLeft + table.closest("section").scrollLeft,
                 top: document.elementFromPoint(r.x + r.width / 2, r.y + r.height / 2) === b };
    }))""", [ids, list(BUTTONS)])
    for box in boxes:
        assert not box.get("missing") and box["width"] > 0, box
        assert 0 <= box["left"] and box["right"] <= width and box["scrolled"] == 0 and box["top"], box
    widths = page.evaluate("""() => { const t = document.getElementById('models'), s = t.closest('section');
        return { table: [t.scrollWidth, t.clientWidth], around: [t.parentElement.scrollWidth, t.parentElement.clientWidth],
                 section: [s.scrollWidth, s.clientWidth],
                 page: [document.documentElement.scrollWidth, document.documentElement.clientWidth],
                 right: [t.getBoundingClientRect().right, s.getBoundingClientRect().right] }; }""")
    for what in ("table", "around", "section", "page"):
        scroll, client = widths[what]
        assert scroll <= client, (what, widths)
    assert widths["right"][0] <= widths["right"][1], widths


def test_the_playground_defaults_to_a_chat_model(first_hour: Daemon, page) -> None:  # noqa: F811
    page.goto(first_hour.url + "/ui")
    playwright_api.expect(row(page, EMBEDDING).locator(".state")).to_have_text("ready")
    picker = page.locator("#play-model")
    playwright_api.expect(picker.locator("option")).not_to_have_count(0)
    # the first ready model that chats (BROKEN, also a chat model, failed to load)
    playwright_api.expect(picker).to_have_value(LONG)
    offered = picker.locator("option").evaluate_all("os => os.map(o => o.value)")
    assert EMBEDDING not in offered and RERANK not in offered, offered  # they cannot chat: not offered at all
    page.wait_for_timeout(2500)  # later polls keep it (nothing re-picks the first listed model)
    playwright_api.expect(picker).to_have_value(LONG)
    page.click("#play-send")  # the default answers
    playwright_api.expect(page.locator("#play-status")).to_have_attribute("data-done", "true")
    playwright_api.expect(page.locator("#play-status")).to_contain_text(re.compile(r"^done: (length|stop)"))
    page.select_option("#play-model", "tiny")  # and the user's pick stays through the polls
    page.wait_for_timeout(2500)
    playwright_api.expect(picker).to_have_value("tiny")


class Streams:
    """`n` long streamed chat replies from `tiny`, read in threads until stop()."""

    def __init__(self, d: Daemon, n: int) -> None:
        self.d, self.halt = d, threading.Event()
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._read, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _read(self) -> None:
        body = {"model": "tiny", "stream": True, "max_tokens": 50_000, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Tell me a very long story"}]}
        try:
            with httpx.stream("POST", self.d.v1 + "/chat/completions", json=body, timeout=120) as r:
                if r.status_code != 200:
                    self.errors.append(f"HTTP {r.status_code}: {r.read()!r}")
                    return
                for line in r.iter_lines():
                    if self.halt.is_set():
                        return  # closing the stream aborts the request
                    if line.startswith("data: [DONE]"):
                        self.errors.append("a stream ended before the test stopped it: make it longer")
                        return
        except httpx.HTTPError as e:
            self.errors.append(repr(e))

    def stop(self) -> None:
        self.halt.set()
        for t in self.threads:
            t.join(30)


def test_the_panels_count_streams_that_began_before_the_page_opened(first_hour: Daemon, page) -> None:  # noqa: F811
    streams = Streams(first_hour, 3)
    try:
        wait_for(lambda: first_hour.model("tiny")["in_flight"] == 3 and first_hour.model("tiny")["generated_tokens"],
                 what="three streams under way")
        page.goto(first_hour.url + "/ui")
        playwright_api.expect(page.locator("#tps-label")).to_have_text(
            re.compile(r"^generated tokens/s: [1-9]\d*\.\d now, peak [1-9]\d*\.\d · 3 requests in flight$"))
        # the replies of the fixture ended before the page opened: the daemon's figures, and the three running
        playwright_api.expect(page.locator("#ttft-label")).to_have_text(
            re.compile(r"^time to first token: \d+ ms mean over [1-9]\d* requests? since the daemon started"
                       r" · 3 in flight \(counted as they end\)$"))
        assert not streams.errors, streams.errors
        playwright_api.expect(page.locator("#chart-tps polyline")).to_have_attribute("points", re.compile(r"\d"))
    finally:
        streams.stop()
    assert not streams.errors, streams.errors
    wait_for(lambda: first_hour.model("tiny")["in_flight"] == 0, what="the streams to be aborted")
    playwright_api.expect(page.locator("#tps-label")).not_to_contain_text("in flight")
