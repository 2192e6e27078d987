"""The HTTP gateway: Starlette routes, SSE, and the one mapping of errors to HTTP responses.

The only module that knows HTTP. Each generation request takes a lease from the router, and
the lease is released (and the worker told to abort, if the request is still running) in a
`finally` that runs on every path: completion, error, client disconnect, server shutdown.
Errors before the first token become HTTP errors; after it, an SSE `error` event, never a
silently truncated stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from protocol.messages import Finished
from supervisor import __version__, errors
from supervisor.config import Settings
from supervisor.openai_api import Parsed, Shaper, parse_chat, parse_completion
from supervisor.router import Lease, Router, Stream

log = logging.getLogger(__name__)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def sse(obj: Any) -> bytes:
    return f"data: {_dumps(obj)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def error_response(exc: errors.MlxsupError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


class SSEResponse(Response):
    """Streams `body` as text/event-stream, racing it against the client's disconnect.

    `on_close` runs exactly once, whether the body finished, failed, or the client left
    (even before the first byte).
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

        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.create_task(stream(), name="sse-send"), asyncio.create_task(disconnected(), name="sse-recv")]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self.on_close()


async def read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise errors.PayloadTooLarge(f"the request body exceeds the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise errors.PayloadTooLarge(f"the request body exceeds the limit of {limit} bytes")
    try:
        return json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise errors.InvalidRequest("the request body is not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise errors.InvalidRequest(f"the request body is not valid JSON: {exc}") from None


class Gateway:
    def __init__(self, router: Router, settings: Settings) -> None:
        self.router = router
        self.settings = settings
        self.started = time.time()

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, parse_chat)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion)

    async def _generate(self, request: Request, parse: Callable[[Any], Parsed]) -> Response:
        parsed = parse(await read_json(request, self.settings.max_body_bytes))
        lease = await self.router.acquire(parsed.model)
        rid = parsed.submit.rid

        def close() -> None:
            lease.abort(rid)  # a no-op once the worker has finished it
            lease.release()

        try:
            stream = lease.submit(parsed.submit)
            events = stream.events()
            first = await anext(events)  # an error before the first token is an HTTP error
        except BaseException:
            close()
            raise
        shaper = Shaper(parsed, lease.worker.spec.id)
        if parsed.stream:
            return SSEResponse(self._sse(first, events, shaper, parsed.include_usage), close)
        try:
            return await self._whole(request, first, events, shaper)
        finally:
            close()

    async def _sse(self, first: Any, events: AsyncIterator, shaper: Shaper, include_usage: bool
                   ) -> AsyncIterator[bytes]:
        item, is_first = first, True
        try:
            while True:
                if isinstance(item, Finished):
                    if item.text or is_first:
                        yield sse(shaper.chunk(item.text, first=is_first))
                    yield sse(shaper.chunk("", item.finish_reason))
                    if include_usage:
                        yield sse(shaper.usage_chunk(item))
                    yield SSE_DONE
                    return
                yield sse(shaper.chunk(item[0], first=is_first))
                is_first = False
                item = await anext(events)
        except errors.MlxsupError as exc:
            yield sse(exc.body())

    async def _whole(self, request: Request, first: Any, events: AsyncIterator, shaper: Shaper) -> Response:
        async def collect() -> Response:
            parts, item = [], first
            while not isinstance(item, Finished):
                parts.append(item[0])
                item = await anext(events)
            parts.append(item.text)
            return JSONResponse(shaper.whole("".join(parts), item))

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.create_task(collect(), name="collect")
        gone = asyncio.create_task(disconnected(), name="watch-disconnect")
        try:
            await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
        if work.cancelled():
            raise errors.RequestAborted("the client disconnected")
        return work.result()

    async def models(self, request: Request) -> Response:
        created = int(self.started)
        data = [{"id": m, "object": "model", "created": created, "owned_by": "mlxsup"}
                for m in self.router.registry.ids()]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "shutting_down" if self.router.shutting_down else "ok"})

    async def status(self, request: Request) -> Response:
        return JSONResponse({"version": __version__, "uptime_s": round(time.time() - self.started, 1),
                             **self.router.status()})

    async def load(self, request: Request) -> Response:
        t0 = time.monotonic()
        lease = await self.router.acquire(request.path_params["model"])
        lease.release()
        worker = lease.worker
        return JSONResponse({"model": worker.spec.id, "pid": worker.pid, "state": worker.state.value,
                             "duration_s": round(time.monotonic() - t0, 3)})

    async def evict(self, request: Request) -> Response:
        body = await read_json(request, 4096) if await request.body() else {}
        if not isinstance(body, dict):
            raise errors.InvalidRequest("the body must be a JSON object")
        mode = body.get("mode", "drain")
        if mode not in ("drain", "now"):
            raise errors.InvalidRequest("'mode' must be 'drain' or 'now'", param="mode")
        timeout = body.get("timeout")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0):
            raise errors.InvalidRequest("'timeout' must be a non-negative number of seconds", param="timeout")
        report = await self.router.evict(request.path_params["model"], mode, timeout)
        return JSONResponse(report)

    async def clear_hot_cache(self, request: Request) -> Response:
        return await self._clear_cache(request, "hot")

    async def clear_ssd_cache(self, request: Request) -> Response:
        return await self._clear_cache(request, "ssd")

    async def _clear_cache(self, request: Request, which: str) -> Response:
        """Body `{"model": id}` for one model, none (or `{}`) for all; answers with the bytes reclaimed."""
        body = await read_json(request, 4096) if await request.body() else {}
        if not isinstance(body, dict) or set(body) - {"model"}:
            raise errors.InvalidRequest("the body must be a JSON object with at most a 'model' key")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise errors.InvalidRequest("'model' must be a string", param="model")
        return JSONResponse(await self.router.clear_cache(which, model))


async def _on_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, errors.MlxsupError):
        return error_response(exc)
    if isinstance(exc, HTTPException):
        kind = errors.NotFound if exc.status_code == 404 else errors.InvalidRequest
        err = kind(f"{request.method} {request.url.path}: {exc.detail}")
        err.status = exc.status_code
        return error_response(err)
    log.exception("[http] unhandled error on %s %s", request.method, request.url.path)
    return error_response(errors.MlxsupError("internal server error"))


def build_app(router: Router, settings: Settings) -> Starlette:
    gw = Gateway(router, settings)
    routes = [
        Route("/v1/chat/completions", gw.chat, methods=["POST"]),
        Route("/v1/completions", gw.completions, methods=["POST"]),
        Route("/v1/models", gw.models, methods=["GET"]),
        Route("/health", gw.health, methods=["GET"]),
        Route("/api/status", gw.status, methods=["GET"]),
        Route("/api/models/{model:path}/load", gw.load, methods=["POST"]),
        Route("/api/models/{model:path}/evict", gw.evict, methods=["POST"]),
        Route("/api/hot-cache/clear", gw.clear_hot_cache, methods=["POST"]),
        Route("/api/ssd-cache/clear", gw.clear_ssd_cache, methods=["POST"]),
    ]
    handlers = {errors.MlxsupError: _on_error, HTTPException: _on_error, Exception: _on_error}
    return Starlette(routes=routes, exception_handlers=handlers)
