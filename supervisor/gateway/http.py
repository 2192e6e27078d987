"""What every route of the gateway uses of HTTP: bodies read under a limit, the error response, SSE
framing, and the client's disconnect seen while a request runs.

Imported by app.py and by each API's routes (openai_routes.py, agent_routes.py), and imports none of
them. Invariants: a body is refused with 413 as soon as it passes its limit, never buffered whole
first; an `SSEResponse` runs its `on_close` exactly once, whether its body finished, failed, or the
client left (even before the first byte); a whole response's work is cancelled the moment its client
disconnects (`unless_client_leaves`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from supervisor import errors
from supervisor.gateway.body import decode_json_off_loop

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
    return JSONResponse(exc.body(), status_code=exc.status)


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
    """Streams `body` as text/event-stream, racing it against the client's disconnect.

    `on_close` runs exactly once, whether the body finished, failed, or the client left
    (even before the first byte); the body is closed first, so its own `finally` runs before.
    """

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        self.body_iterator = body
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

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
