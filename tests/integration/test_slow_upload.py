"""Stalled uploads against a real daemon (issue 48): a client that sends its headers and part of a body, then
nothing, is answered 408 once `body_timeout_s` has passed and its connection is closed; while dozens of them
stall, /health and generation requests are answered as ever (a stalled upload holds nothing another request
needs)."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from tests.conftest import Daemon

TIMEOUT_S = 1.0
STALLED = 40


def stall(url: str) -> socket.socket:
    """A chat request whose body stops after 40 of its 4000 bytes."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 4000\r\n\r\n" + b'{"model": "tiny", "messages": [{"role": "')
    return sock


def answer(sock: socket.socket) -> tuple[bytes, bool]:
    """(what the daemon wrote, whether it closed the connection after it)."""
    got = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return got, False
        if not chunk:
            return got, True
        got += chunk


def test_stalled_uploads_are_408s_and_hold_nothing(daemon_factory, model_dir: Path, tmp_path: Path) -> None:
    """Catches: a body read with no deadline (neither uvicorn nor starlette has one): the upload was held for
    ever, its connection open."""
    cfg = tmp_path / "slow.toml"
    cfg.write_text(f'[server]\nmodel_dirs = ["{model_dir}"]\nbody_timeout_s = {TIMEOUT_S}\n')
    d: Daemon = daemon_factory("--config", str(cfg))
    assert httpx.post(f"{d.url}/api/models/tiny/load", timeout=60).status_code == 200
    t0 = time.monotonic()
    stalled = [stall(d.url) for _ in range(STALLED)]
    health = httpx.get(d.url + "/health", timeout=5)
    ok = httpx.post(d.v1 + "/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=60)
    assert health.status_code == 200 and ok.status_code == 200, ok.text
    answers = [answer(s) for s in stalled]
    took = time.monotonic() - t0
    for s in stalled:
        s.close()
    for got, closed in answers:
        assert got.startswith(b"HTTP/1.1 408 "), got[:200]
        assert b'"code":"request_timeout"' in got and closed
    print(f"{STALLED} stalled uploads answered 408 within {took:.2f}s")
    assert TIMEOUT_S <= took < TIMEOUT_S + 20
    log = (d.state_dir / "daemon.log").read_text()
    assert "was not whole within 1s" in log
