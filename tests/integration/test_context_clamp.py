"""Issue 26 against a real daemon: an output limit past the context is a ceiling on every API (OpenAI chat "length",
Anthropic "model_context_window_exceeded", Responses incomplete for max_output_tokens), streamed and whole; a prompt
that leaves no room is each API's own 400; fields an API does not know are ignored with one warning per name; and
`[server] strict_context` / `strict_fields` keep the old refusals.

The model is a tiny qwen3 whose context is cut to CONTEXT tokens, its worker started with `--script`
(worker/mlx_engine/scripted.py) so a request naming CLAMP is answered by a reply longer than any room: only the
context can end it, whatever the random weights would say.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import MLXSUP, Daemon, start_daemon

CONTEXT = 256
CLAMP = "CLAMP-ME"
ASK = [{"role": "user", "content": f"Say a lot. {CLAMP}"}]
TOO_LONG = [{"role": "user", "content": f"{'word ' * (CONTEXT + 50)}{CLAMP}"}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model and its script; returns the folder a daemon's config goes in."""
    root = tmp_path_factory.mktemp("clamp")
    model = root / "qwen3"
    subprocess.run([*MLXSUP, "make-model", str(model), "--arch", "qwen3", "--preset", "tiny"], check=True,
                   capture_output=True)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    (root / "script.json").write_text(json.dumps([{"match": CLAMP, "reply": "word " * (2 * CONTEXT)}]))
    return root


def start(root: Path, name: str, server: str = "") -> Daemon:
    config = root / f"{name}.toml"
    config.write_text(f"[server]\n{server}\n[models.qwen3]\npath = \"{root / 'qwen3'}\"\n"
                      f"worker_args = [\"--script\", \"{root / 'script.json'}\"]\n")
    return start_daemon(root / name, "--config", str(config))


@pytest.fixture(scope="module")
def daemon(setup: Path) -> Iterator[Daemon]:
    d = start(setup, "default")
    yield d
    assert d.stop() == 0


def events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def chat(d: Daemon, stream: bool, messages: list = ASK, **kw) -> tuple[int, dict]:
    """(status, {finish_reason, completion, prompt}) of a chat completion, or the error body."""
    body = {"model": "qwen3", "messages": messages, "max_tokens": 32000, "stream": stream, **kw}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(d.v1 + "/chat/completions", json=body, timeout=120)
    if r.status_code != 200:
        return r.status_code, r.json()
    if not stream:
        out = r.json()
        return 200, {"finish_reason": out["choices"][0]["finish_reason"], **out["usage"]}
    chunks = events(r)
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(reasons) == 1 and r.text.rstrip().endswith("data: [DONE]")
    return 200, {"finish_reason": reasons[0], **chunks[-1]["usage"]}


def messages(d: Daemon, stream: bool, ask: list = ASK, **kw) -> tuple[int, dict]:
    body = {"model": "qwen3", "max_tokens": 128000, "messages": ask, "stream": stream, **kw}
    r = httpx.post(d.v1 + "/messages", json=body, headers={"anthropic-version": "2023-06-01"}, timeout=120)
    if r.status_code != 200:
        return r.status_code, r.json()
    if not stream:
        out = r.json()
        return 200, {"stop_reason": out["stop_reason"], **out["usage"]}
    said = events(r)
    assert said[-1]["type"] == "message_stop"
    delta = next(e for e in said if e["type"] == "message_delta")
    return 200, {"stop_reason": delta["delta"]["stop_reason"], **delta["usage"]}


def responses(d: Daemon, stream: bool, ask: list = ASK, **kw) -> tuple[int, dict]:
    body = {"model": "qwen3", "input": ask, "stream": stream, "max_output_tokens": 32000, **kw}
    r = httpx.post(d.v1 + "/responses", json=body, timeout=120)
    if r.status_code != 200:
        return r.status_code, r.json()
    out = r.json() if not stream else events(r)[-1]["response"]
    return 200, {"status": out["status"], "incomplete_details": out["incomplete_details"], **out["usage"]}


APIS: dict[str, Callable[..., tuple[int, dict]]] = {"chat": chat, "messages": messages, "responses": responses}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_max_tokens_past_the_context_runs_to_the_context_s_end_on_every_api(daemon: Daemon, stream: bool) -> None:
    status, out = chat(daemon, stream)
    assert status == 200 and out["finish_reason"] == "length", out
    assert out["prompt_tokens"] + out["completion_tokens"] == CONTEXT
    status, out = messages(daemon, stream)
    assert status == 200 and out["stop_reason"] == "model_context_window_exceeded", out
    assert out["input_tokens"] + out["cache_read_input_tokens"] + out["cache_creation_input_tokens"] \
        + out["output_tokens"] == CONTEXT
    status, out = responses(daemon, stream)
    assert status == 200 and out["status"] == "incomplete", out
    assert out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["input_tokens"] + out["output_tokens"] == CONTEXT
    # without an output limit (Codex sends none), the same end
    status, out = responses(daemon, stream, max_output_tokens=None)
    assert status == 200 and out["status"] == "incomplete" and out["input_tokens"] + out["output_tokens"] == CONTEXT


def test_n_choices_each_run_to_the_context_s_end(daemon: Daemon) -> None:
    r = httpx.post(daemon.v1 + "/chat/completions", timeout=120, json={
        "model": "qwen3", "messages": ASK, "max_tokens": 32000, "n": 2})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["finish_reason"] for c in out["choices"]] == ["length", "length"]
    assert out["usage"]["completion_tokens"] == 2 * (CONTEXT - out["usage"]["prompt_tokens"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_prompt_that_leaves_no_room_is_each_api_s_400(daemon: Daemon, stream: bool) -> None:
    status, body = chat(daemon, stream, TOO_LONG)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    status, body = messages(daemon, stream, TOO_LONG)
    assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    status, body = responses(daemon, stream, TOO_LONG)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert daemon.model("qwen3")["state"] == "ready"


def test_unknown_fields_are_ignored_with_one_warning_per_name(daemon: Daemon) -> None:
    for _ in range(2):
        status, out = chat(daemon, False, max_tokens=2, brand_new_chat_field={"x": 1})
        assert status == 200, out
        status, out = responses(daemon, False, max_output_tokens=2, client_metadata={"id": "x"},
                                brand_new_responses_field=1)
        assert status == 200, out
    log = (daemon.state_dir / "daemon.log").read_text()
    assert log.count("field='brand_new_chat_field'") == 1 and log.count("field='brand_new_responses_field'") == 1
    assert "client_metadata" not in log  # Codex's: known, so not even a warning


def test_strict_mode_keeps_the_old_refusals(setup: Path) -> None:
    d = start(setup, "strict", "strict_context = true\nstrict_fields = true")
    try:
        status, body = chat(d, False, max_tokens=CONTEXT)  # fits no prompt: refused, not clamped
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
        status, body = messages(d, True)
        assert status == 400 and body["error"]["type"] == "invalid_request_error", body
        status, body = chat(d, False, max_tokens=2, brand_new_chat_field=1)
        assert status == 400 and body["error"]["param"] == "brand_new_chat_field", body
        status, body = responses(d, False, max_output_tokens=2, brand_new_responses_field=1)
        assert status == 400 and body["error"]["param"] == "brand_new_responses_field", body
        status, out = chat(d, False, max_tokens=2)
        assert status == 200 and out["finish_reason"] == "length"
    finally:
        assert d.stop() == 0


def test_the_model_s_window_is_reported_for_clients_to_configure(daemon: Daemon) -> None:
    """GET /v1/models/{id}: what the README tells users to give each program as its context window."""
    r = httpx.get(daemon.v1 + "/models/qwen3", timeout=30)
    assert r.status_code == 200 and r.json()["context_length"] == CONTEXT
