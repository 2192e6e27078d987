"""A request body must be whole within `body_timeout_s` of the request's arrival (issue 48): a slow-loris upload (the
headers and part of a body, then nothing) is refused with 408 and its connection closed, never held for ever. Once
the body is whole nothing is timed: a long answer, and the watch for the client leaving, go on. In process: the
real gateway (build_app) driven through ASGI, on test_call's stub router."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

from supervisor.config import Settings
from supervisor.gateway.app import build_app
from tests.unit.test_call import StubRouter, fin

TIMEOUT_S = 0.3


def settings() -> Settings:
    s = Settings(sse_keepalive_s=60)
    s.body_timeout_s = TIMEOUT_S
    return s


def request(parts: list[bytes], gaps: list[float], length: int) -> tuple[dict, Callable[[], Awaitable[dict]]]:
    """A chat request whose body comes as `parts`, `gaps[i]` seconds before part i; then the client stays."""
    headers = [(b"host", b"127.0.0.1:8800"), (b"content-type", b"application/json"),
               (b"content-length", str(length).encode())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "headers": headers, "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8800)}
    parts, gaps = list(parts), list(gaps)
    stays = asyncio.Event()

    async def receive() -> dict:
        if not parts:
            await stays.wait()  # no disconnect
        await asyncio.sleep(gaps.pop(0))
        return {"type": "http.request", "body": parts.pop(0), "more_body": len(parts) > 0}

    return scope, receive


async def answered(app: object, scope: dict, receive: Callable[[], Awaitable[dict]]) -> tuple[int, dict, dict]:
    start: dict = {}
    body = bytearray()

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
        elif message["type"] == "http.response.body":
            body.extend(message.get("body", b""))

    await asyncio.wait_for(app(scope, receive, send), 10)  # type: ignore[operator]
    return start["status"], dict(start["headers"]), json.loads(body)


RAW = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


def test_a_stalled_upload_is_a_408_and_its_connection_is_closed() -> None:
    """Catches: a body read that waits for ever (no timeout anywhere: uvicorn and starlette have none for a body)."""

    async def main() -> None:
        app = build_app(StubRouter([fin(1)]), settings())  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        status, headers, body = await answered(app, *request([RAW[:10], RAW[10:]], [0, 3600], len(RAW)))
        took = loop.time() - t0
        assert status == 408 and body["error"]["code"] == "request_timeout", body
        assert headers[b"connection"] == b"close"
        assert TIMEOUT_S <= took < TIMEOUT_S + 2

    asyncio.run(main())


def test_a_slow_upload_whole_in_time_and_a_long_answer_are_not_timed() -> None:
    async def main() -> None:
        router = StubRouter([])  # its answer is put in its stream later
        app = build_app(router, settings())  # type: ignore[arg-type]
        slow = asyncio.create_task(answered(app, *request([RAW[:10], RAW[10:20], RAW[20:]],
                                                          [0, TIMEOUT_S / 3, TIMEOUT_S / 3], len(RAW))))
        await asyncio.sleep(TIMEOUT_S * 3)  # the answer comes long after the deadline a body had
        assert not slow.done()
        assert router.lease.stream is not None
        router.lease.stream.queue.put_nowait(("ok", 1, None))
        router.lease.stream.queue.put_nowait(fin(1))
        status, headers, body = await slow
        assert status == 200 and body["choices"][0]["message"]["content"] == "ok", body
        assert b"connection" not in headers

    asyncio.run(main())


def test_an_upload_that_keeps_coming_is_timed_per_part_and_one_that_stalls_is_still_cut() -> None:
    """Catches: a blob upload of gigabytes (Ollama's /api/blobs) cut at body_timeout_s however steadily it comes, or
    an upload path exempt from the deadline altogether (a stalled one held for ever)."""
    from supervisor.errors import RequestTimeout
    from supervisor.gateway.http import BodyDeadline

    async def reader(scope: dict, receive: Callable[[], Awaitable[dict]], send: object) -> None:
        while (await receive()).get("more_body"):
            pass

    def upload(path: str, gaps: list[float]) -> tuple[dict, Callable[[], Awaitable[dict]]]:
        scope, receive = request([b"x"] * len(gaps), gaps, len(gaps))
        return {**scope, "path": path}, receive

    async def main() -> None:
        app = BodyDeadline(reader, TIMEOUT_S, uploads=("/api/blobs/",))
        steady = [0.0] + [TIMEOUT_S / 2] * 6  # whole after 3 deadlines, no part later than half of one
        await asyncio.wait_for(app(*upload("/api/blobs/sha256:ab", steady), None), 10)
        for path, gaps in (("/v1/chat/completions", steady), ("/api/blobs/sha256:ab", [0.0, 3600.0])):
            try:
                await asyncio.wait_for(app(*upload(path, gaps), None), 10)
            except RequestTimeout:
                continue
            raise AssertionError(f"{path} was not cut")

    asyncio.run(main())
