"""An embedder and a reranker under the lifecycle a chat model lives by, in one daemon beside a chat model: each
model's kind in `mlxsup status` and on the dashboard, the embedder evicted by admission for the chat model when
the memory ceiling fits one model (and loaded again by the next embedding request), a worker SIGKILLed in the
middle of a batch (a clean 502 in OpenAI's error shape, then a new worker), and the reranker's bad inputs.

The models and the daemon are test_embeddings.py's fixtures (tiny, minilm, qwen3-reranker); the embeddings' own
bad inputs, an evict mid-batch and the rerank order are tested there.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.conftest import Daemon, assert_gone, wait_for
from tests.integration.test_cli import mlxsup
from tests.integration.test_embeddings import TEXTS, _expected, daemon, models, ref  # noqa: F401

KINDS = {"tiny": "chat", "minilm": "embedding", "qwen3-reranker": "rerank"}


def _requests_to_each(d: Daemon) -> dict[str, httpx.Response]:
    """One request to each model, all three sent at once."""
    bodies = {"tiny": ("/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 4}),
              "minilm": ("/embeddings", {"model": "minilm", "input": TEXTS}),
              "qwen3-reranker": ("/rerank", {"model": "qwen3-reranker", "query": "q", "documents": ["a", "b"]})}
    got: dict[str, httpx.Response] = {}

    def send(model: str, path: str, body: dict) -> None:
        got[model] = httpx.post(d.v1 + path, json=body, timeout=300)

    threads = [threading.Thread(target=send, args=(m, p, b)) for m, (p, b) in bodies.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def test_chat_embedding_and_rerank_served_at_once_and_status_shows_each_kind(daemon: Daemon) -> None:  # noqa: F811
    for model, resp in _requests_to_each(daemon).items():
        assert resp.status_code == 200, (model, resp.text)
    status = {m["id"]: m for m in daemon.status()["models"]}
    models_now = {m: status[m] for m in KINDS}  # the folder holds other kinds too (test_embeddings.py's), unloaded
    assert {m: (s["kind"], s["state"]) for m, s in models_now.items()} == {m: (k, "ready") for m, k in KINDS.items()}
    assert len({s["pid"] for s in models_now.values()}) == 3  # a worker each
    assert {s["kind"] for m, s in status.items() if m not in KINDS} <= {"embedding"}
    out = mlxsup("status", "--url", daemon.url)
    assert out.returncode == 0, out.stderr
    header = next(line for line in out.stdout.splitlines() if line.startswith("MODEL"))
    assert header.split()[:3] == ["MODEL", "KIND", "STATE"]
    rows = {cells[0]: cells[1:3] for cells in map(str.split, out.stdout.splitlines()) if cells and cells[0] in KINDS}
    assert rows == {m: [k, "ready"] for m, k in KINDS.items()}


def test_the_dashboard_shows_each_models_kind(daemon: Daemon) -> None:  # noqa: F811
    from tests.ui.test_dashboard import CHROMIUM_FLAGS, TIMEOUT_MS, chromium, playwright_api, row

    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page()
            page.goto(daemon.url + "/ui")
            for model, kind in KINDS.items():
                playwright_api.expect(row(page, model).locator(".kind")).to_have_text(kind, timeout=TIMEOUT_MS)
        finally:
            browser.close()


def test_a_sigkill_mid_batch_is_a_clean_502_and_the_next_request_gets_a_new_worker(daemon: Daemon,  # noqa: F811
                                                                                   ref: Any) -> None:  # noqa: F811
    _requests_to_each(daemon)  # every model loaded: the others must not be touched
    others = {m: daemon.model(m)["pid"] for m in KINDS if m != "minilm"}
    victim = daemon.model("minilm")["pid"]
    crashes = daemon.model("minilm")["crashes"]
    # 2048 inputs of 250 token ids: minutes of batches on MLX's CPU backend, so the kill lands while they run
    large = {"model": "minilm", "input": [[101] + [2000 + i % 500] * 248 + [102] for i in range(2048)]}
    done: list[httpx.Response] = []
    client = threading.Thread(target=lambda: done.append(httpx.post(daemon.v1 + "/embeddings", json=large,
                                                                    timeout=120)))
    client.start()
    # the gateway holds a lease while it asks the worker, and sends the request in the turn it takes it
    wait_for(lambda: daemon.model("minilm")["leases"] >= 1 or done, 60, what="the request to reach the worker")
    assert not done, done[0].text
    os.kill(victim, signal.SIGKILL)
    client.join(timeout=120)
    assert not client.is_alive(), "the request hung after its worker was killed"
    [resp] = done
    assert resp.status_code == 502, resp.text
    error = resp.json()["error"]  # a whole JSON body in OpenAI's shape, not a cut one
    assert error["code"] == "worker_crashed" and error["type"] and "minilm" in error["message"]
    assert_gone([victim])
    status = wait_for(lambda: (m := daemon.model("minilm"))["crashes"] == crashes + 1 and m, 10,
                      what="the crash to be recorded")
    assert "-9" in status["last_error"]
    again = httpx.post(daemon.v1 + "/embeddings", json={"model": "minilm", "input": TEXTS, "encoding_format": "float"},
                       timeout=300)
    assert again.status_code == 200, again.text
    np.testing.assert_allclose([d["embedding"] for d in again.json()["data"]], _expected(ref, TEXTS), atol=1e-5)
    assert daemon.model("minilm")["pid"] not in (None, victim)
    assert {m: daemon.model(m)["pid"] for m in others} == others


def test_the_reranker_refuses_what_it_cannot_score_and_goes_on(daemon: Daemon) -> None:  # noqa: F811
    """The bad bodies test_embeddings.py does not send; a document over the window is cut, as peers do."""
    ok = httpx.post(daemon.v1 + "/rerank", json={"model": "qwen3-reranker", "query": "q", "documents": ["a"]},
                    timeout=300)
    assert ok.status_code == 200, ok.text
    pid = daemon.model("qwen3-reranker")["pid"]
    too_many = httpx.post(daemon.v1 + "/rerank", timeout=60,
                          json={"model": "qwen3-reranker", "query": "q", "documents": ["a"] * 10_000})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "documents", too_many.text
    long_query = httpx.post(daemon.v1 + "/rerank", timeout=300,
                            json={"model": "qwen3-reranker", "query": "word " * 2000, "documents": ["a"]})
    assert long_query.status_code == 400, long_query.text
    assert long_query.json()["error"]["code"] == "context_length_exceeded"
    window = daemon.model("qwen3-reranker")["context_length"]
    long_doc = httpx.post(daemon.v1 + "/rerank", timeout=300,
                          json={"model": "qwen3-reranker", "query": "q", "documents": ["word " * 2000, "b"]})
    assert long_doc.status_code == 200, long_doc.text
    assert long_doc.json()["usage"]["prompt_tokens"] <= 2 * window  # the long document's pair cut to the window
    assert daemon.model("qwen3-reranker")["pid"] == pid and daemon.model("qwen3-reranker")["crashes"] == 0


def test_a_ceiling_for_one_model_evicts_the_idle_embedder_for_the_chat_model(daemon: Daemon, daemon_factory,  # noqa: F811
                                                                             models: Path, ref: Any,  # noqa: F811
                                                                             tmp_path: Path) -> None:
    _requests_to_each(daemon)
    footprint = max(daemon.model(m)["memory_bytes"] for m in ("tiny", "minilm"))
    weights = daemon.model("minilm")["weights_bytes"]
    # any model fits alone (weights + the overhead each worker is estimated at), no two do: the smallest worker
    # measures far more than the 16 MiB to spare
    config = tmp_path / "one.toml"
    config.write_text(f'[server]\nmodel_dirs = ["{models}"]\n\n[memory]\nceiling = {weights + footprint + 16 * 2**20}\n'
                      f"worker_overhead = {footprint}\n")
    d = daemon_factory("--config", str(config))
    embed = {"model": "minilm", "input": TEXTS, "encoding_format": "float"}
    first = httpx.post(d.v1 + "/embeddings", json=embed, timeout=300)
    assert first.status_code == 200, first.text
    embedder = d.model("minilm")["pid"]

    chat = httpx.post(d.v1 + "/chat/completions", timeout=300,
                      json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200, chat.text
    assert_gone([embedder])
    states = {m["id"]: m["state"] for m in d.status()["models"]}
    assert states["tiny"] == "ready" and states["minilm"] == "stopped", states
    [report] = [e for e in d.status()["recent_evictions"] if e["pid"] == embedder]
    # the orderly sequence: drained and exited 0 by itself, no signal from the kill ladder
    assert (report["reason"], report["mode"], report["exit"], report["signals"]) == ("admission", "drain", 0, [])
    assert "settle" in report["phases_s"]

    chat_pid = d.model("tiny")["pid"]
    again = httpx.post(d.v1 + "/embeddings", json=embed, timeout=300)
    assert again.status_code == 200, again.text
    assert d.model("minilm")["pid"] not in (None, embedder) and d.model("tiny")["state"] == "stopped"
    assert_gone([chat_pid])
    np.testing.assert_array_equal([x["embedding"] for x in again.json()["data"]],
                                  [x["embedding"] for x in first.json()["data"]])
    np.testing.assert_allclose([x["embedding"] for x in again.json()["data"]], _expected(ref, TEXTS), atol=1e-5)


@pytest.fixture(autouse=True)
def _no_restarts_unless_killed(daemon: Daemon, request: pytest.FixtureRequest) -> Any:  # noqa: F811
    """No test but the SIGKILL one crashes a worker of the shared daemon."""
    before = {m["id"]: m["crashes"] for m in daemon.status()["models"]}
    yield
    after = {m["id"]: m["crashes"] for m in daemon.status()["models"]}
    if "sigkill" not in request.node.name:
        assert after == before, (before, after)
