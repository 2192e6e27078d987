"""Web pages cannot drive the daemon, and clients on this machine still can, against a real daemon.

A foreign Host (DNS rebinding), a foreign Origin, or a body that is not JSON gets a 4xx and
changes nothing: the worker keeps its pid, no request reaches it. The openai and anthropic
clients, curl and the CLI still work; an origin on `[server] allowed_origins` gets its CORS
preflight answered and its POST executed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.conftest import MLXSUP, Daemon, start_daemon

ALLOWED_ORIGIN = "http://app.example.test:3000"
ALLOWED_HOST = "mlxsup.test"
# ignore_eos: at temperature 1 a random-weight model may end at once, and the tests count tokens made
COMPLETION = {"model": "tiny", "prompt": "Once", "max_tokens": 3, "ignore_eos": True}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True}


def sdk(body: dict) -> dict:
    """The body as the openai SDK's keyword arguments (a field it does not know goes in extra_body)."""
    return {**{k: v for k, v in body.items() if k != "ignore_eos"}, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def guarded(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon with one extra host name and one allowed web origin, `tiny` loaded."""
    state = tmp_path_factory.mktemp("guarded")
    config = state / "config.toml"
    config.write_text(f'[server]\nallowed_hosts = ["{ALLOWED_HOST}"]\nallowed_origins = ["{ALLOWED_ORIGIN}"]\n')
    d = start_daemon(state, "--model-dir", str(model_dir), "--config", str(config))
    assert httpx.post(d.url + "/api/models/tiny/load", timeout=60).status_code == 200
    yield d
    assert d.stop() == 0


def port(d: Daemon) -> int:
    return int(d.url.rsplit(":", 1)[1])


def requests_total(d: Daemon) -> float:
    """Generation requests the gateway has handled, every outcome (mlxsup_requests_total)."""
    text = httpx.get(d.url + "/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(r"^mlxsup_requests_total\{.*\} (\S+)$", text, re.M))


def snapshot(d: Daemon) -> tuple:
    tiny, tiny2 = d.model("tiny"), d.model("tiny2")
    return tiny["pid"], tiny["restarts"], tiny["state"], tiny2["state"], requests_total(d)


def assert_refused(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["code"] == code, error
    assert "access-control-allow-origin" not in r.headers


# (method, path, json body): a read, a generation, an eviction and a load
ACTIONS = [
    ("GET", "/v1/models", None),
    ("GET", "/health", None),
    ("GET", "/api/status", None),
    ("GET", "/metrics", None),
    ("POST", "/v1/completions", COMPLETION),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/api/models/tiny/evict", {"mode": "now"}),
    ("POST", "/api/models/tiny2/load", {}),
]


@pytest.mark.parametrize("host", ["evil.example.com", "evil.example.com:{port}", "localhost.evil.example.com:{port}",
                                  "127.0.0.1.nip.io:{port}", "0.0.0.0:{port}", ""])
def test_a_foreign_host_is_refused_and_changes_nothing(guarded: Daemon, host: str) -> None:
    before = snapshot(guarded)
    for method, path, body in ACTIONS:
        r = httpx.request(method, guarded.url + path, json=body, headers={"Host": host.format(port=port(guarded))},
                          timeout=30)
        assert_refused(r, 403, "host_not_allowed")
    assert snapshot(guarded) == before  # same pid, nothing evicted, tiny2 not loaded, no request handled


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST", "localhost.:{port}",
                                  "127.9.9.9:{port}", "[::1]:{port}", f"{ALLOWED_HOST}:{{port}}"])
def test_hosts_that_name_this_server_are_served(guarded: Daemon, host: str) -> None:
    r = httpx.get(guarded.url + "/v1/models", headers={"Host": host.format(port=port(guarded))}, timeout=30)
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["tiny", "tiny2"]


@pytest.mark.parametrize("origin", ["http://evil.example.com", "null", "http://127.0.0.1:1", "https://127.0.0.1:{port}",
                                    "http://localhost:{port}", "http://app.example.test:3001"])
def test_a_foreign_origin_is_refused_and_changes_nothing(guarded: Daemon, origin: str) -> None:
    before = snapshot(guarded)
    headers = {"Origin": origin.format(port=port(guarded))}  # the daemon is reached as 127.0.0.1: localhost is foreign
    for method, path, body in ACTIONS:
        r = httpx.request(method, guarded.url + path, json=body, headers=headers, timeout=30)
        assert_refused(r, 403, "origin_not_allowed")
    preflight = httpx.options(guarded.url + "/v1/completions", timeout=30, headers={
        **headers, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    assert_refused(preflight, 403, "origin_not_allowed")
    assert snapshot(guarded) == before


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/json; charset=latin-1", None])
def test_a_body_that_is_not_declared_json_never_reaches_the_worker(guarded: Daemon, content_type: str | None) -> None:
    before = snapshot(guarded)
    generated = guarded.model("tiny")["generated_tokens"]
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
                       ("/api/models/tiny/evict", {"mode": "now"})):
        headers = {"Content-Type": content_type} if content_type else {}
        for extra in ({}, {"Origin": ALLOWED_ORIGIN}):  # a simple cross-origin POST from an allowed page, too
            r = httpx.post(guarded.url + path, content=json.dumps(body).encode(), headers={**headers, **extra},
                           timeout=30)
            assert_refused(r, 415, "unsupported_media_type")
    assert snapshot(guarded) == before
    assert guarded.model("tiny")["generated_tokens"] == generated


def test_same_origin_and_origin_less_requests_work(guarded: Daemon) -> None:
    own = f"http://127.0.0.1:{port(guarded)}"
    for headers in ({"Origin": own}, {}, {"Content-Type": "application/json; charset=UTF-8"}):
        r = httpx.post(guarded.url + "/v1/completions", json=COMPLETION, headers=headers, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
        assert "access-control-allow-origin" not in r.headers  # same-origin needs no CORS grant
    bodyless = httpx.post(guarded.url + "/api/models/tiny2/evict", timeout=30)  # like `curl -X POST`
    assert bodyless.status_code == 200 and bodyless.json() == {"model": "tiny2", "evicted": False,
                                                               "reason": "not loaded"}


def test_an_allowed_origin_gets_its_preflight_answered_and_its_post_executed(guarded: Daemon) -> None:
    before = requests_total(guarded)
    preflight = httpx.options(guarded.url + "/v1/chat/completions", timeout=30, headers={
        "Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})
    assert preflight.status_code == 204, preflight.text
    assert preflight.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    allowed_headers = {h.strip() for h in preflight.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type", "x-stainless-os"} <= allowed_headers
    assert "Origin" in preflight.headers["vary"]

    r = httpx.post(guarded.url + "/v1/chat/completions", json=CHAT, headers={"Origin": ALLOWED_ORIGIN}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    assert r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN and "Origin" in r.headers["vary"]
    with httpx.stream("POST", guarded.url + "/v1/completions", json={**COMPLETION, "stream": True},
                      headers={"Origin": ALLOWED_ORIGIN}, timeout=60) as streamed:
        assert streamed.status_code == 200 and streamed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
        assert "data: [DONE]" in streamed.read().decode()
    assert requests_total(guarded) == before + 2  # both were executed


def test_openai_and_anthropic_clients_on_this_machine_still_work(guarded: Daemon) -> None:
    oa = openai.OpenAI(base_url=guarded.v1, api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in oa.models.list()] == ["tiny", "tiny2"]
    chat = oa.chat.completions.create(**sdk(CHAT))
    assert chat.usage.completion_tokens >= 1
    streamed = oa.completions.create(**sdk(COMPLETION), stream=True)
    assert any(c.choices and c.choices[0].finish_reason for c in streamed)

    # The anthropic SDK sends its own headers (x-api-key, anthropic-version, its JSON content type):
    # its models.list() and a POST through the same client pass the Host, Origin and body checks.
    ac = anthropic.Anthropic(base_url=guarded.url, api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in ac.models.list().data] == ["tiny", "tiny2"]
    done = ac.post("/v1/completions", body=COMPLETION, cast_to=object)  # a 4xx would raise APIStatusError
    assert done["usage"]["completion_tokens"] >= 1


def test_curl_and_the_cli_on_this_machine_still_work(guarded: Daemon) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")

    def curl(*args: str) -> tuple[int, str]:
        out = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", *args], capture_output=True, text=True,
                             timeout=60, check=True).stdout
        body, _, code = out.rpartition("\n")
        return int(code), body

    code, body = curl(guarded.url + "/v1/models")
    assert code == 200 and json.loads(body)["data"]
    code, body = curl(guarded.url + "/v1/chat/completions", "-H", "Content-Type: application/json",
                      "-d", json.dumps(CHAT))
    assert code == 200 and json.loads(body)["usage"]["completion_tokens"] >= 1
    code, body = curl("-X", "POST", guarded.url + "/api/models/tiny2/evict")
    assert code == 200 and json.loads(body)["reason"] == "not loaded"
    code, body = curl(guarded.url + "/v1/completions", "-d", json.dumps(COMPLETION))  # curl's form type by default
    assert code == 415 and "application/json" in json.loads(body)["error"]["message"]

    env = {**os.environ, "MLXSUP_URL": guarded.url}
    status = subprocess.run([*MLXSUP, "status", "--json"], capture_output=True, text=True, env=env, timeout=60)
    assert status.returncode == 0 and json.loads(status.stdout)["models"], status.stderr
    evict = subprocess.run([*MLXSUP, "evict", "tiny2"], capture_output=True, text=True, env=env, timeout=60)
    assert evict.returncode == 0 and "not loaded" in evict.stdout, evict.stderr
