"""A streamed explicit load releases its lease on every path, the client's leaving included.

In process: the real gateway (build_app) driven by hand through ASGI, with a stub router whose
`acquire` completes in the very loop turn in which the client disconnects, so the moment between
"the load is done" and "its report is written" is hit every time, not by luck. The stub is pure
logic; the real router's lease accounting is tested against real workers elsewhere.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from supervisor.config import Settings
from supervisor.gateway.app import build_app


class StubLease:
    def __init__(self) -> None:
        self.worker = SimpleNamespace(spec=SimpleNamespace(id="tiny"), pid=4242, state=SimpleNamespace(value="ready"))
        self.releases = 0
        self.released = asyncio.Event()

    def release(self) -> None:
        self.releases += 1
        self.released.set()


class StubRouter:
    """What Gateway.load uses of the router: resolve, acquire (held until `finish_load`), loading."""

    def __init__(self) -> None:
        self.registry = SimpleNamespace(resolve=lambda name: SimpleNamespace(id=name))
        self.lease = StubLease()
        self.gate: asyncio.Future = asyncio.get_running_loop().create_future()

    async def acquire(self, name: str, explicit: bool = False, queued: bool = True) -> StubLease:
        await self.gate
        return self.lease

    def finish_load(self) -> None:
        self.gate.set_result(None)

    def loading(self, name: str) -> None:
        return None


def _scope(path: str, body: bytes) -> dict:
    headers = [(b"host", b"127.0.0.1:8800"), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
            "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8800)}


async def _load_and_leave_as_it_completes() -> tuple[StubRouter, list[dict]]:
    router = StubRouter()
    app = build_app(router, Settings())  # type: ignore[arg-type]
    body = json.dumps({"stream": True}).encode()
    sent: list[dict] = []
    calls = 0

    async def receive() -> dict:
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        # The SSE response now watches for the disconnect while the load is pending: the load
        # completes and the client is gone in this same turn, before the report can be written.
        router.finish_load()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await asyncio.wait_for(app(_scope("/api/models/tiny/load", body), receive, send), timeout=10)
    return router, sent


def test_client_leaving_as_the_load_completes_does_not_keep_the_lease() -> None:
    async def scenario() -> None:
        router, sent = await _load_and_leave_as_it_completes()
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
        written = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        assert b'"pid"' not in written  # the report never went out: the client left first
        await asyncio.wait_for(router.lease.released.wait(), timeout=5)
        assert router.lease.releases == 1

    asyncio.run(scenario())


def test_a_completed_streamed_load_releases_its_lease_once() -> None:
    async def scenario() -> None:
        router = StubRouter()
        app = build_app(router, Settings())  # type: ignore[arg-type]
        body = json.dumps({"stream": True}).encode()
        sent: list[dict] = []
        client_gone = asyncio.Event()
        calls = 0

        async def receive() -> dict:
            nonlocal calls
            calls += 1
            if calls == 1:
                return {"type": "http.request", "body": body, "more_body": False}
            await client_gone.wait()  # the client stays until the whole answer is in
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)
            if message["type"] == "http.response.start":
                router.finish_load()
            if message["type"] == "http.response.body" and not message.get("more_body"):
                client_gone.set()

        await asyncio.wait_for(app(_scope("/api/models/tiny/load", body), receive, send), timeout=10)
        written = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        report = json.loads(written.decode().strip().removeprefix("data: "))
        assert report["pid"] == 4242 and report["state"] == "ready"
        await asyncio.wait_for(router.lease.released.wait(), timeout=5)
        assert router.lease.releases == 1

    asyncio.run(scenario())
