"""What every route of the gateway uses of HTTP: bodies read under a limit, the error response, SSE
framing, and the client's disconnect seen while a request runs.

Imported by app.py and by each API's routes (openai_routes.py, agent_routes.py), and imports none of
them. Invariants: a body is refused with 413 as soon as it passes its limit, never buffered whole
first; a body not whole within `body_timeout_s` of the request's arrival is refused with 408 and its connection
closed (`BodyDeadline`: neither uvicorn nor starlette times a body, so a stalled upload was held for ever); an `SSEResponse` runs its `on_close` exactly once, whether its body finished, failed, or the
client left (even before the first byte); a whole response's work is cancelled the moment its client
disconnects (`unless_client_leaves`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from supervisor import errors
from supervisor.gateway.body import decode_json_off_loop

log = logging.getLogger(__name__)
T = TypeVar("T")
SSE_DONE = b"data: [DONE]\n\n"


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def sse(obj: Any) -> bytes:
    """An OpenAI-style SSE event: data only."""
    return f"data: {_dumps(obj)}\n\n".encode()


def sse_event(event: dict) -> bytes:
    """An event as Anthropic and the Responses API write it: its type as the SSE event name, the object as data."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()


def error_response(exc: errors.MlxsupError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes `limit` bytes (never buffered whole first)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise errors.PayloadTooLarge(f"the request body exceeds the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise errors.PayloadTooLarge(f"the request body exceeds the limit of {limit} bytes")
    return bytes(body)


class BodyDeadline:
    """ASGI middleware: a request's body is whole within `timeout_s` of its arrival, or reading it raises
    RequestTimeout (the routes' error mapping makes it a 408) and the response closes the connection, so a
    slow-loris upload holds neither a connection nor a task past the deadline. Once the body is whole (or for a
    request that never reads it) `receive` is passed through untimed: the watch for a client leaving runs as long
    as its answer does. Under an `uploads` path prefix (a file of gigabytes) the deadline is for each part of the
    body instead: a stalled upload is cut as soon, one that keeps coming is not."""

    def __init__(self, app: ASGIApp, timeout_s: float, uploads: tuple[str, ...] = ()) -> None:
        self.app = app
        self.timeout_s = timeout_s
        self.uploads = uploads

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.timeout_s:
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        upload = scope["path"].startswith(self.uploads) if self.uploads else False
        whole = False
        late = False

        async def timed_receive() -> Message:
            nonlocal whole, late, deadline
            if whole:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                late = True
                log.warning("[http] %s %s: the request body was not whole within %gs (client %s): 408",
                            scope["method"], scope["path"], self.timeout_s, (scope.get("client") or ("?",))[0])
                raise errors.RequestTimeout(f"the request body did not arrive within {self.timeout_s:g}s "
                                            "(server.body_timeout_s)") from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                whole = True
            elif upload:
                deadline = loop.time() + self.timeout_s
            return message

        async def closing_send(message: Message) -> None:
            if late and message["type"] == "http.response.start":  # the rest of the body is never read
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, timed_receive, closing_send)


async def read_json(request: Request, limit: int) -> Any:
    return await decode_json_off_loop(await read_body(request, limit))


async def client_gone(receive: Receive) -> None:
    """Returns once the client has disconnected (the request body, if any, is already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(work: Coroutine[Any, Any, T], receive: Receive, name: str) -> T:
    """`work`'s result; RequestAborted, with `work` cancelled and settled, when the client disconnects first."""
    task = asyncio.create_task(work, name=name)
    gone = asyncio.create_task(client_gone(receive), name="watch-disconnect")
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise errors.RequestAborted("the client disconnected")
    return task.result()


class SSEResponse(Response):
    """Streams `body` as text/event-stream (or as `media_type`: a chunked audio body), racing it against the
    client's disconnect.

    `on_close` runs exactly once, whether the body finished, failed, or the client left
    (even before the first byte); the body is closed first, so its own `finally` runs before.
    """

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], None], media_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        self.body_iterator = body
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        if media_type is not None:
            self.media_type = media_type
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        tasks = [asyncio.create_task(stream(), name="sse-send"),
                 asyncio.create_task(client_gone(receive), name="sse-recv")]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self.on_close()
