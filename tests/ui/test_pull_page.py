"""The dashboard's Pull, in a real headless Chromium against a real daemon and the stand-in hub
(tests/integration/standin_hub.py): progress shows while the weights download (the stand-in holds the
connection mid-file), and once the pull completes (the daemon resumes the cut file) the model is in the list.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from tests.conftest import Daemon, make_model
from tests.integration.standin_hub import Repo, StandInHub, folder_files
from tests.ui.test_dashboard import browser, page, playwright_api, row  # noqa: F401 (fixtures)

REPO, WEIGHTS, CUT = "mlx-test/Paged-4bit", "model.safetensors", 300_000


def test_pull_from_the_page_shows_progress_and_the_model_appears(tmp_path: Path, page,  # noqa: F811
                                                                  daemon_factory: Callable[..., Daemon]) -> None:
    tiny = make_model(tmp_path / "tiny")
    with StandInHub() as hub:
        hub.repos[REPO] = Repo()
        hub.repos[REPO].add(folder_files(tiny))
        hub.cut[(REPO, WEIGHTS)] = CUT
        daemon = daemon_factory("--model-dir", str(tiny), env={"HF_ENDPOINT": hub.url,
                                                                "HF_HUB_CACHE": str(tmp_path / "hub")})
        page.goto(daemon.url + "/ui")
        playwright_api.expect(row(page, "tiny")).to_have_count(1)
        playwright_api.expect(row(page, REPO)).to_have_count(0)
        page.fill("#pull-model", REPO)
        page.click("#pull-send")
        status = page.locator("#pull-status")
        playwright_api.expect(status).to_contain_text(f"file 6/6 {WEIGHTS}")  # held mid-file by the stand-in
        playwright_api.expect(status).to_contain_text(re.compile(r" of \d+(\.\d)? KiB"))
        progress = page.locator("#pull-progress").evaluate("e => e.value")
        assert 0 < progress < 1, progress
        hub.release.set()  # the stand-in drops the connection: the daemon resumes the file from where it stopped
        playwright_api.expect(status).to_have_attribute("data-done", "true")
        playwright_api.expect(status).to_contain_text(f"{REPO}: pulled")
        playwright_api.expect(row(page, REPO)).to_have_count(1)
        assert ("GET", f"/{REPO}/resolve/{hub.repos[REPO].refs['main']}/{WEIGHTS}", f"bytes={CUT}-") in hub.requests


def test_a_pull_with_no_hub_to_reach_says_what_to_do_on_the_page(tmp_path: Path, page,  # noqa: F811
                                                                  daemon_factory: Callable[..., Daemon]) -> None:
    """No network (the hub an endpoint on a closed local port): the page said 'HTTP 500: internal server error'."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once it is closed
    tiny = make_model(tmp_path / "tiny")
    daemon = daemon_factory("--model-dir", str(tiny), env={"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(tmp_path / "hub")})
    page.goto(daemon.url + "/ui")
    playwright_api.expect(row(page, "tiny")).to_have_count(1)
    page.fill("#pull-model", REPO)
    page.click("#pull-send")
    status = page.locator("#pull-status")
    playwright_api.expect(status).to_contain_text("pull failed: HTTP 503: cannot reach the Hugging Face hub at "
                                                  + endpoint)
    playwright_api.expect(status).to_contain_text("check the network connection, and HF_ENDPOINT")
    playwright_api.expect(page.locator("#pull-send")).to_be_enabled()  # another try can be made
    page.fill("#pull-model", "org--x/name")
    page.click("#pull-send")
    playwright_api.expect(status).to_contain_text("pull failed: HTTP 400: 'org--x/name' is not a model repository id: "
                                                  "expected ORG/NAME[@REVISION]")
