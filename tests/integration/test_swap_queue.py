"""One model loaded at a time (`max_loaded_models = 1`), real workers: requests for the other model wait for the swap
and are served in their order; the wait queue's bound refuses at once with Retry-After; a client that leaves its
place in the queue is dropped from it at once (supervisor/slot.py, Router.acquire)."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import Daemon, text_line, wait_for

BUSY = {"prompt": "busy", "max_tokens": 8000, "ignore_eos": True, "stream": True}


def one_at_a_time(daemon_factory, model_dir: Path, tmp_path: Path, extra: str = "") -> Daemon:
    config = tmp_path / "one.toml"
    config.write_text(f"""
[server]
model_dirs = ["{model_dir}"]
{extra}

[memory]
max_loaded_models = 1
""")
    return daemon_factory("--config", str(config))


@pytest.mark.parametrize("extra", ["", "max_running_requests = 1\nqueue_timeout_s = 240"],
                         ids=["default", "one-running"])
def test_requests_alternating_between_two_models_all_complete_in_order(daemon_factory, model_dir: Path,
                                                                       tmp_path: Path, extra: str) -> None:
    """Each waits for the swap (none refused with 507), and each model's requests are served in their order; with one
    request running at a time too, where a model's waiters each take their turn after its load (a waiter that came
    later for the other model must not evict it before they ran: the swaps would go round for ever, each wait ending
    in queue_timeout_s's 503)."""
    d = one_at_a_time(daemon_factory, model_dir, tmp_path, extra)
    client = openai.OpenAI(base_url=d.v1, api_key="unused", max_retries=0, timeout=300)
    models = ["tiny2", "tiny", "tiny2", "tiny", "tiny2", "tiny"]  # the first waits for the busy tiny: all do
    finished: list[tuple[str, int]] = []
    with httpx.stream("POST", d.v1 + "/completions", timeout=60, json={"model": "tiny", **BUSY}) as busy:
        lines = busy.iter_lines()  # kept referenced: a collected iterator closes the connection
        assert "error" not in next(line for line in lines if text_line(line))

        def ask(i: int, model: str) -> str:
            out = client.completions.create(model=model, prompt=f"request {i}", max_tokens=3)
            finished.append((model, i))
            return out.model

        with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
            asked = []
            for i, model in enumerate(models):  # one at a time, each seen waiting before the next: arrival order
                asked.append(pool.submit(ask, i, model))
                wait_for(lambda n=i + 1: sum(m["waiting"] for m in d.status()["models"]) == n, 60,
                         what=f"request {i} to wait")
            assert not any(f.done() for f in asked)
            busy.close()  # tiny's long request ends: the queue moves
            served = [f.result(timeout=600) for f in asked]
    assert served == models  # every one completed, by the model it asked for
    for model in ("tiny", "tiny2"):
        assert [i for m, i in finished if m == model] == [i for i, m in enumerate(models) if m == model]
    assert all(m["waiting"] == 0 and m["queue_refused"] == 0 for m in d.status()["models"])


def test_a_full_queue_refuses_at_once_with_retry_after_and_the_queued_ones_complete(daemon_factory, model_dir: Path,
                                                                                   tmp_path: Path) -> None:
    d = one_at_a_time(daemon_factory, model_dir, tmp_path, "max_queued_requests = 2")
    client = openai.OpenAI(base_url=d.v1, api_key="unused", max_retries=0, timeout=300)
    with httpx.stream("POST", d.v1 + "/completions", timeout=60, json={"model": "tiny", **BUSY}) as busy:
        lines = busy.iter_lines()
        assert "error" not in next(line for line in lines if text_line(line))
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            queued = [pool.submit(client.completions.create, model="tiny2", prompt="q", max_tokens=2)
                      for _ in range(2)]
            wait_for(lambda: d.model("tiny2")["waiting"] == 2, 60, what="two requests to wait")
            full = httpx.post(d.v1 + "/completions", timeout=30, json={"model": "tiny2", "prompt": "x", "max_tokens": 2})
            assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full", full.text
            assert int(full.headers["retry-after"]) >= 1
            anthropic = httpx.post(d.v1 + "/messages", timeout=30, json={
                "model": "tiny2", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
            assert anthropic.status_code == 429 and anthropic.json()["error"]["type"] == "rate_limit_error"
            assert "retry-after" in anthropic.headers
            ollama = httpx.post(d.url + "/api/chat", timeout=30, json={
                "model": "tiny2", "stream": False, "messages": [{"role": "user", "content": "x"}]})
            assert ollama.status_code == 429 and "queue" in ollama.json()["error"], ollama.text
            assert "retry-after" in ollama.headers
            busy.close()
            assert all(f.result(timeout=300).usage.completion_tokens for f in queued)
    assert d.model("tiny2")["queue_refused"] == 3 and d.model("tiny2")["waiting"] == 0
    assert 'mlxsup_queue_refused_total{model="tiny2",why="full"} 3.0' in httpx.get(d.url + "/metrics").text


def test_a_waiting_client_that_leaves_is_dropped_from_the_queue_at_once(daemon_factory, model_dir: Path,
                                                                        tmp_path: Path) -> None:
    d = one_at_a_time(daemon_factory, model_dir, tmp_path)
    with httpx.stream("POST", d.v1 + "/completions", timeout=60, json={"model": "tiny", **BUSY}) as busy:
        lines = busy.iter_lines()
        assert "error" not in next(line for line in lines if text_line(line))
        with httpx.Client(timeout=120) as http, http.stream("POST", d.v1 + "/completions", json={
                "model": "tiny2", "prompt": "leaving", "max_tokens": 2, "stream": True}) as leaving:
            wait_for(lambda: d.model("tiny2")["waiting"] == 1, 60, what="the request to wait")
            leaving.close()
        wait_for(lambda: d.model("tiny2")["waiting"] == 0, 60, what="the request to leave the queue")
        assert d.model("tiny")["state"] == "ready" and d.model("tiny2")["state"] == "stopped"
        assert next(line for line in lines if text_line(line))  # tiny's stream goes on, unswapped
