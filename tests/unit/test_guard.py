"""The web guard's pure parts and its place in the middleware stack, in process (no daemon).

Host and Origin parsing by table; the order against the API key (host and origin checks first, a
preflight never needs the key); the config keys. Behaviour against a real daemon is in
tests/integration/test_web_guard.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from supervisor.config import ConfigError, Settings, load_file
from supervisor.gateway.app import build_app
from supervisor.gateway.guard import WebGuard, host_name, is_loopback, parse_origin, split_host


@pytest.mark.parametrize("value, parsed", [
    ("localhost", ("localhost", None)), ("LocalHost:8800", ("localhost", 8800)), ("localhost.:1", ("localhost", 1)),
    ("127.0.0.1:8800", ("127.0.0.1", 8800)), ("[::1]:8800", ("::1", 8800)), ("[::1]", ("::1", None)),
    ("::1", None), ("localhost:", None), ("localhost:99999", None), ("localhost:８０", None), ("[::1]x", None),
    ("a b", None), ("user@localhost", None), ("", None), ("evil.example.com", ("evil.example.com", None)),
])
def test_split_host(value: str, parsed: tuple | None) -> None:
    assert split_host(value) == parsed


@pytest.mark.parametrize("host, loopback", [
    ("localhost", True), ("127.0.0.1", True), ("127.255.0.9", True), ("::1", True), ("::ffff:127.0.0.1", True),
    ("0.0.0.0", False), ("10.0.0.1", False), ("localhost.evil.example.com", False), ("127.0.0.1.nip.io", False),
])
def test_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("value, parsed", [
    ("http://localhost:8800", ("http", "localhost", 8800)), ("http://LOCALHOST", ("http", "localhost", 80)),
    ("https://app.example.test/", ("https", "app.example.test", 443)), ("http://[::1]:3000", ("http", "::1", 3000)),
    ("chrome-extension://abcdef", ("chrome-extension", "abcdef", None)),
    ("null", None), ("http://a.test/path", None), ("http://u@a.test", None), ("http://a.test:99999", None),
    ("file://", None), ("http://a.test?x", None),
])
def test_parse_origin(value: str, parsed: tuple | None) -> None:
    assert parse_origin(value) == parsed


def test_configured_names() -> None:
    assert [host_name(v) for v in ("box.lan", "10.0.0.2", "::1", "[::1]", "box.lan:80", "")] == \
        ["box.lan", "10.0.0.2", "::1", "::1", None, None]
    with pytest.raises(ValueError):
        WebGuard(lambda *_: None, origins=["not an origin"])  # type: ignore[arg-type]


@pytest.mark.parametrize("section, ok", [
    ('allowed_hosts = ["box.lan", "10.0.0.2", "::1"]', True),
    ('allowed_origins = ["http://localhost:3000", "https://app.example.test"]', True),
    ('allowed_hosts = ["box.lan:8800"]', False), ('allowed_hosts = [1]', False), ('allowed_hosts = "box.lan"', False),
    ('allowed_origins = ["localhost:3000"]', False), ('allowed_origins = ["*"]', False),
])
def test_config_keys(tmp_path: Path, section: str, ok: bool) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f"[server]\n{section}\n")
    if ok:
        settings = load_file(path, Settings())
        assert settings.allowed_hosts or settings.allowed_origins
    else:
        with pytest.raises(ConfigError, match="server.allowed_"):
            load_file(path, Settings())


def _stub_router() -> SimpleNamespace:
    return SimpleNamespace(registry=SimpleNamespace(on_disk=lambda: [SimpleNamespace(id="tiny")], refresh=lambda: None),
                           lifecycle=SimpleNamespace(workers={}), shutting_down=False)


async def _get(app, method: str, path: str, headers: dict) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8800") as client:
        return await client.request(method, path, headers=headers)


def test_host_and_origin_come_before_the_api_key_and_a_preflight_needs_none() -> None:
    settings = Settings(api_key="k", allowed_origins=["http://app.example.test:3000"])
    app = build_app(_stub_router(), settings)  # type: ignore[arg-type]
    key = {"Authorization": "Bearer k"}

    async def scenario() -> None:
        r = await _get(app, "GET", "/v1/models", {"Host": "evil.example.com"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"  # not 401: no key asked
        r = await _get(app, "GET", "/v1/models", {**key, "Origin": "http://evil.example.com"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"  # a key does not help
        r = await _get(app, "OPTIONS", "/v1/models", {"Origin": "http://app.example.test:3000",
                                                      "Access-Control-Request-Method": "GET"})
        assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "http://app.example.test:3000"
        r = await _get(app, "GET", "/v1/models", {"Origin": "http://app.example.test:3000"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"]  # the browser may read the 401
        r = await _get(app, "GET", "/v1/models", {**key, "Origin": "http://app.example.test:3000"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"

    asyncio.run(scenario())


def test_a_websocket_from_a_foreign_origin_is_closed_before_the_app_sees_it() -> None:
    seen: list[dict] = []

    async def app(scope, receive, send) -> None:
        seen.append(scope)

    guard = WebGuard(app)
    scope = {"type": "websocket", "scheme": "ws", "path": "/ui/live",
             "headers": [(b"host", b"127.0.0.1:8800"), (b"origin", b"http://evil.example.com")]}
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "websocket.connect"}

    asyncio.run(guard(scope, receive, send))
    assert not seen and sent == [{"type": "websocket.close", "code": 1008, "reason": "origin_not_allowed"}]


def test_the_bearer_scheme_is_case_insensitive() -> None:
    """RFC 7235: the auth scheme is a case-insensitive token; `bearer <key>` got a 401."""
    app = build_app(_stub_router(), Settings(api_key="k"))  # type: ignore[arg-type]

    async def scenario() -> None:
        for good in ("Bearer k", "bearer k", "BEARER k", "bEaReR  k"):
            r = await _get(app, "GET", "/v1/models", {"Authorization": good})
            assert r.status_code == 200, good
        for bad in ("Bearer kk", "Basic k", "Bearerk", "k", "Bearer", "bearer K", "x-bearer k"):
            r = await _get(app, "GET", "/v1/models", {"Authorization": bad})
            assert r.status_code == 401, bad

    asyncio.run(scenario())


@pytest.mark.parametrize("host, key, warned", [
    ("127.0.0.1", None, False), ("localhost", None, False), ("::1", None, False), ("0.0.0.0", "k", False),
    ("0.0.0.0", None, True), ("::", None, True), ("192.168.1.5", None, True), ("mybox.lan", None, True),
])
def test_listening_beyond_loopback_without_a_key_is_warned_of(host: str, key: str | None, warned: bool) -> None:
    warning = Settings(host=host, api_key=key).security_warning()
    assert (warning is not None) is warned
    assert warning is None or host in warning


@pytest.mark.parametrize("ollama, key, warned", [
    ("127.0.0.1:11434", None, False), ("off", None, False), ("11434", None, False), ("localhost:11434", None, False),
    ("0.0.0.0:11434", None, True), ("192.168.1.5:11434", None, True), ("[::]:11434", None, True),
    ("0.0.0.0:11434", "k", False),
])
def test_ollamas_listener_beyond_loopback_without_a_key_is_warned_of(ollama: str, key: str | None,
                                                                     warned: bool) -> None:
    """Catches: `ollama_listen` opening every route to the network with no key while the main port is loopback (serve
    refuses to start on the warning unless insecure_no_key)."""
    warning = Settings(ollama_listen=ollama, api_key=key).security_warning()
    assert (warning is not None) is warned
    assert warning is None or "ollama_listen" in warning


def test_insecure_no_key_is_a_config_key(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[server]\nhost = "0.0.0.0"\ninsecure_no_key = true\n')
    assert load_file(path, Settings()).insecure_no_key is True
    path.write_text('[server]\ninsecure_no_key = "yes"\n')
    with pytest.raises(ConfigError, match="insecure_no_key"):
        load_file(path, Settings())
    path.write_text('[server]\nport = true\n')  # a bool is still no integer
    with pytest.raises(ConfigError, match="server.port"):
        load_file(path, Settings())
