"""Speculative decoding's acceptance where an operator looks (issue 30): /metrics, /api/status and the dashboard.

One real daemon serves `tiny` (a llama) with `speculative = "prompt-lookup"` and `tiny2` plain; requests whose
prompt repeats itself make prompt lookup draft. /metrics' draft counters must equal the sum of what the responses'
usage reported (accepted and rejected prediction tokens), /api/status must show the worker's mode, counts and their
rate, and the dashboard's row the mode and that rate, "–" for the model that drafts nothing (`auto`: off on a CPU).
The worker measures what drafting costs in its idle work after Ready (draft_pricing.py), so the requests wait for
status to say it is priced; a request with "speculative": false never drafts. Here, not in tests/integration:
the page's check shares the daemon (playwright is in the `test` extra, so the metrics test runs wherever it does).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Daemon, start_daemon, wait_for
from tests.ui.test_dashboard import browser, page, playwright_api, row  # noqa: F401 (fixtures)

BLOCK = " ".join(f"w{(i * 37) % 300}" for i in range(30))
PROMPT = f"{BLOCK} " * 3  # repetitive, as code an agent was shown and edits: prompt lookup finds drafts in it


@pytest.fixture(scope="module")
def drafting(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("drafting")
    config = root / "c.toml"
    config.write_text(f'[models.tiny]\npath = "{model_dir / "tiny"}"\nspeculative = "prompt-lookup"\n\n'
                      f'[models.tiny2]\npath = "{model_dir / "tiny2"}"\n')
    d = start_daemon(root / "state", "--config", str(config))
    yield d
    assert d.stop() == 0


def streamed_usage(d: Daemon, body: dict) -> dict:
    with httpx.stream("POST", d.v1 + "/chat/completions", timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return next(c["usage"] for c in chunks if c.get("usage"))


@pytest.fixture(scope="module")
def usages(drafting: Daemon) -> dict[str, list[dict]]:
    """Each model's responses' usage: a whole completion and a streamed chat reply each."""
    out: dict[str, list[dict]] = {}
    for model in ("tiny", "tiny2"):
        assert httpx.post(f"{drafting.url}/api/models/{model}/load", json={}, timeout=120).status_code == 200
    wait_for(lambda: drafting.model("tiny")["drafting_priced"], 120, what="tiny's drafting to be priced")
    for model in ("tiny", "tiny2"):
        whole = httpx.post(drafting.v1 + "/completions", timeout=120,
                           json={"model": model, "prompt": PROMPT, "max_tokens": 40, "temperature": 0})
        assert whole.status_code == 200, whole.text
        streamed = streamed_usage(drafting, {"model": model, "max_tokens": 40, "temperature": 0,
                                             "messages": [{"role": "user", "content": PROMPT}]})
        out[model] = [whole.json()["usage"], streamed]
    return out


def drafts(usage: dict) -> tuple[int, int]:
    """(drafted, accepted) as a response's usage reports them (no details: nothing drafted)."""
    details = usage.get("completion_tokens_details") or {}
    accepted = details.get("accepted_prediction_tokens", 0)
    return accepted + details.get("rejected_prediction_tokens", 0), accepted


def counters(d: Daemon) -> dict[tuple[str, str], float]:
    text = httpx.get(d.url + "/metrics", timeout=10).text
    return {(s.name, s.labels["model"]): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith("mlxsup_draft_") and s.name.endswith("_total")}


def test_metrics_and_status_count_what_the_responses_reported(drafting: Daemon, usages: dict) -> None:
    drafted, accepted = (sum(x) for x in zip(*map(drafts, usages["tiny"])))
    assert drafted > 0, f"prompt lookup drafted nothing: the worker priced drafting off here? {usages['tiny']}"
    assert 0 < accepted <= drafted
    assert all(drafts(u) == (0, 0) for u in usages["tiny2"])
    assert counters(drafting) == {("mlxsup_draft_tokens_total", "tiny"): drafted,
                                  ("mlxsup_draft_accepted_tokens_total", "tiny"): accepted,
                                  ("mlxsup_draft_tokens_total", "tiny2"): 0,
                                  ("mlxsup_draft_accepted_tokens_total", "tiny2"): 0}
    tiny, tiny2 = drafting.model("tiny"), drafting.model("tiny2")
    assert (tiny["drafted_tokens"], tiny["accepted_tokens"], tiny["acceptance_rate"]) == \
        (drafted, accepted, accepted / drafted)
    assert (tiny2["drafted_tokens"], tiny2["acceptance_rate"]) == (0, None)
    assert (tiny["drafting"], tiny2["drafting"], tiny2["drafting_priced"]) == ("prompt-lookup", "off", False)


def test_a_request_that_turns_speculative_decoding_off_drafts_nothing(drafting: Daemon, usages: dict) -> None:
    """The same request drafts when it lets the model's mode decide (the usages above), and never with
    "speculative": false; a value that is no boolean is the API's 400."""
    assert drafts(usages["tiny"][0])[0] > 0
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    off = httpx.post(drafting.v1 + "/completions", timeout=120, json={**body, "speculative": False})
    assert off.status_code == 200, off.text
    assert drafts(off.json()["usage"]) == (0, 0)
    assert off.json()["choices"][0]["text"] == httpx.post(drafting.v1 + "/completions", timeout=120,
                                                          json=body).json()["choices"][0]["text"]
    bad = httpx.post(drafting.v1 + "/completions", timeout=30, json={**body, "speculative": "no"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative"


def test_the_dashboard_row_shows_the_acceptance_rate(drafting: Daemon, usages: dict, page) -> None:  # noqa: F811
    tiny = drafting.model("tiny")
    assert tiny["acceptance_rate"] is not None
    page.goto(drafting.url + "/ui")
    cell = row(page, "tiny").locator(".drafts")
    playwright_api.expect(cell).to_have_attribute(
        "title", f"{tiny['accepted_tokens']} of {tiny['drafted_tokens']} drafted tokens kept by this worker")
    playwright_api.expect(cell).to_have_text(
        "prompt-lookup · " + page.evaluate("rate => pct(rate)", tiny["acceptance_rate"]))
    playwright_api.expect(row(page, "tiny2").locator(".drafts")).to_have_text("–")
