"""A recording HTTP proxy between a coding agent and the daemon: what each program sends, kept for the tests.

Every request is forwarded as it came (method, path, headers, body) and its response streamed back byte for byte
as it arrives (a stream stays a stream; the connection closes after each response). Each request is recorded as
a `Seen` with its JSON body, when it has one, and the response's status and bytes as the program received them.
`drop`: top-level JSON fields removed before forwarding (to see what a program does past a field the daemon refuses
today). Test-only; it listens on loopback.
"""

from __future__ import annotations

import http.client
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self
from urllib.parse import urlsplit

HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "accept-encoding"}


class LoopbackServer:
    """A threaded HTTP server on 127.0.0.1 serving `handler`, for the length of a `with` block."""

    def _serve(self, handler: type[BaseHTTPRequestHandler], name: str) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name=name, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


@dataclass
class Seen:
    method: str
    path: str
    body: dict | None
    status: int = 0
    response: bytearray = field(default_factory=bytearray)


class RecordingProxy(LoopbackServer):
    def __init__(self, upstream: str, drop: frozenset[str] = frozenset()) -> None:
        self.drop = drop
        up = urlsplit(upstream)
        self.host, self.port = up.hostname or "127.0.0.1", up.port or 80
        self.seen: list[Seen] = []
        self._serve(self._handler(), "recording-proxy")

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # quiet: what matters is in `seen`
                pass

            def _forward(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = None
                seen = Seen(self.command, self.path, body if isinstance(body, dict) else None)
                proxy.seen.append(seen)
                if seen.body is not None and proxy.drop & seen.body.keys():
                    raw = json.dumps({k: v for k, v in seen.body.items() if k not in proxy.drop}).encode()
                up = http.client.HTTPConnection(proxy.host, proxy.port, timeout=600)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                up.request(self.command, self.path, body=raw or None, headers=headers)
                resp = up.getresponse()
                seen.status = resp.status
                self.close_connection = True
                try:
                    self.send_response(resp.status)
                    for k, v in resp.getheaders():
                        if k.lower() not in HOP:
                            self.send_header(k, v)
                    self.send_header("Connection", "close")
                    self.end_headers()
                    while chunk := resp.read1(65536):
                        seen.response += chunk
                        self.wfile.write(chunk)
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):  # the program went away mid-response (killed)
                    pass
                finally:
                    up.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _forward

        return Handler


class OutsideRefused(LoopbackServer):
    """The programs' HTTP(S)_PROXY: every request for the outside world (CONNECT or absolute URL) is refused
    with 403 and its target recorded in `attempts`, so a test sees what a program tried to reach beyond loopback."""

    def __init__(self) -> None:
        self.attempts: list[str] = []
        attempts = self.attempts

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def _refuse(self) -> None:
                attempts.append(self.path)
                try:
                    self.send_error(403, "outside access refused by the test")
                except (BrokenPipeError, ConnectionResetError):  # it gave up first: refused all the same
                    pass

            do_CONNECT = do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _refuse

        self._serve(Handler, "outside-refused")

