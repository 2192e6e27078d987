"""The HTTP gateway: Starlette routes, SSE, and the one mapping of errors to HTTP responses.

With guard.py (the Host, Origin and body-type checks in front of every route), the only module
that knows HTTP. Every body is decoded by body.py, so a bad one is a 400. Each generation
request takes a lease from the router, and the lease is released (and the worker told to abort,
if the request is still running) in a `finally` that runs on every path: completion, error,
client disconnect, server shutdown. An explicit load's lease goes back as soon as it is taken.
Errors before the first token become HTTP errors; after it, an SSE `error` event, never a
silently truncated stream. A request suspended because its worker ended under it (resume.py)
keeps its stream: SSE comments say so until it resumes; a whole response just comes later.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from protocol.messages import Finished
from supervisor import __version__, errors
from supervisor.config import Settings
from supervisor.config_view import effective
from supervisor.gateway.agent_routes import HttpKit, agent_routes
from supervisor.gateway.anthropic_api import anthropic_error_body
from supervisor.gateway.body import decode_json, decode_json_off_loop
from supervisor.gateway.call import Calls
from supervisor.gateway.guard import WebGuard
from supervisor.gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from supervisor.gateway.openai_api import Parsed, parse_chat, parse_completion
from supervisor.gateway.openai_shape import Shaper
from supervisor.gateway.transcript import Transcript
from supervisor.gateway.ui import UI_PATH, Dashboard
from supervisor.router import Router
from supervisor.units import is_number

log = logging.getLogger(__name__)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def sse(obj: Any) -> bytes:
    return f"data: {_dumps(obj)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
ADMIN_BODY_LIMIT = 4096
MAX_EVICT_TIMEOUT_S = 86400  # a drain deadline past a day is a mistake, and past 2**64 cannot go to the worker


def error_response(exc: errors.MlxsupError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


T = TypeVar("T")


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


RESUME_CAUSES = {"crash": "its worker crashed", "hang": "its worker hung",
                 "pressure": "its model was evicted under memory pressure"}


def resume_note(router: Router, call: Calls, shaper: Shaper) -> bytes | None:
    """An SSE comment for a suspended request's client (None while none of its choices is suspended)."""
    for c in call.calls:
        suspension = router.suspension(c.submit.rid)
        if suspension is not None:
            paused = router.clock.monotonic() - suspension.since
            return f": resuming {shaper.model}: {RESUME_CAUSES[suspension.cause]}; paused {paused:.0f}s\n\n".encode()
    return None


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


class Gateway:
    def __init__(self, router: Router, settings: Settings) -> None:
        self.router = router
        self.settings = settings
        self.started = time.time()

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, parse_chat)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion)

    async def _generate(self, request: Request, parse: Callable[[Any, bool], Parsed]) -> Response:
        parsed = parse(await read_json(request, self.settings.max_body_bytes), self.settings.strict_fields)
        call = Calls(self.router, parsed, request.url.path)
        shaper = Shaper(parsed, self.router.registry.resolve(parsed.model).id)
        if not parsed.stream:  # a client that leaves during the load or the prefill is seen at once, too
            try:
                return await unless_client_leaves(self._whole(call, shaper), request.receive,
                                                  f"whole[{parsed.submit.rid}]")
            finally:
                call.close()
        starting = asyncio.create_task(call.start(), name=f"start[{parsed.submit.rid}]")
        try:
            done, _ = await asyncio.wait({starting}, timeout=self.settings.sse_keepalive_s)
        except asyncio.CancelledError:  # the server is going away under this request: leave nothing held
            starting.cancel()
            call.close()
            raise
        if not done:  # a cold load: keep the client's connection alive with SSE comments meanwhile
            return SSEResponse(self._sse_waiting(call, starting, shaper), call.close)
        try:
            starting.result()  # an error before the first token is an HTTP error
        except BaseException:
            call.close()
            raise
        return SSEResponse(self._sse(call, shaper), call.close)

    async def _sse_waiting(self, call: Calls, starting: asyncio.Task, shaper: Shaper) -> AsyncIterator[bytes]:
        try:
            while not starting.done():
                worker = self.router.loading(call.parsed.model)
                note = f"{worker.progress.stage} {worker.progress.fraction:.0%}" if worker else "waiting for memory"
                yield resume_note(self.router, call, shaper) or f": loading {shaper.model}: {note}\n\n".encode()
                await asyncio.wait({starting}, timeout=self.settings.sse_keepalive_s)
            starting.result()
        except errors.MlxsupError as exc:
            yield sse(exc.body())
            return
        finally:
            if not starting.done():
                starting.cancel()
        async for chunk in self._sse(call, shaper):
            yield chunk

    async def _sse(self, call: Calls, shaper: Shaper) -> AsyncIterator[bytes]:
        started: set[int] = set()
        finished: dict[int, Finished] = {}
        events = call.events(self.settings.sse_keepalive_s)
        try:
            async for index, item in events:
                if item is None:  # nothing within a keep-alive: a choice may wait to be resumed on the next worker
                    if note := resume_note(self.router, call, shaper):
                        yield note
                    continue
                first = index not in started
                started.add(index)
                if isinstance(item, Finished):
                    said = first or shaper.has_delta(item.text, item.extra)
                    chunks = [shaper.chunk(index, item.text, item.extra, first=first)] if said else []
                    chunks.append(shaper.chunk(index, "", None, finish_reason=item.finish_reason))
                    yield b"".join(sse(c) for c in chunks)  # one write for the end's chunks
                    finished[index] = item
                    continue
                yield sse(shaper.chunk(index, item[0], item[2], first=first))
            usage = [shaper.usage_chunk([finished[i] for i in sorted(finished)])] if call.parsed.include_usage else []
            yield b"".join([*(sse(u) for u in usage), SSE_DONE])
        except errors.MlxsupError as exc:
            yield sse(exc.body())
        finally:
            await events.aclose()

    async def _whole(self, call: Calls, shaper: Shaper) -> Response:
        """Start and collect every choice; an error before the first token is the response's status."""
        await call.start()
        said = [Transcript() for _ in call.calls]
        finished: dict[int, Finished] = {}
        async for index, item in call.events():
            if item is None:
                continue
            if isinstance(item, Finished):
                said[index].feed(item.text, item.extra)
                finished[index] = item
            else:
                said[index].feed(item[0], item[2])
        return JSONResponse(shaper.whole(said, [finished[i] for i in range(len(said))]))

    async def models(self, request: Request) -> Response:
        created = int(self.started)
        self.router.registry.refresh()  # a model folder added since is listed too
        data = [{"id": m, "object": "model", "created": created, "owned_by": "mlxsup"}
                for m in self.router.registry.ids()]
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        """One model (the openai client's models.retrieve): its context length and whether it is loaded."""
        self.router.registry.refresh()
        spec = self.router.registry.resolve(request.path_params["model"])
        status: dict = next((m for m in self.router.status().to_dict()["models"] if m["id"] == spec.id), {})
        state = status.get("state")
        return JSONResponse({"id": spec.id, "object": "model", "created": int(self.started), "owned_by": "mlxsup",
                             "loaded": state == "ready", "state": state or "unloaded",
                             "context_length": status.get("context_length") or _config_context(spec.path)})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "shutting_down" if self.router.shutting_down else "ok"})

    async def status(self, request: Request) -> Response:
        return JSONResponse({"version": __version__, "uptime_s": round(time.time() - self.started, 1),
                             "security_warning": self.settings.security_warning(),
                             **self.router.status().to_dict()})

    async def load(self, request: Request) -> Response:
        """Load a model now; with {"stream": true}, SSE progress events until it is ready."""
        body = await _admin_body(request, {"stream"})
        stream = body.get("stream") or False
        if not isinstance(stream, bool):
            raise errors.InvalidRequest("'stream' must be a boolean", param="stream")
        name = request.path_params["model"]
        self.router.registry.resolve(name)
        t0 = time.monotonic()
        loading = asyncio.create_task(self.router.acquire(name, explicit=True), name=f"load[{name}]")
        loading.add_done_callback(_release_lease)

        def report() -> dict:
            w = loading.result().worker
            return {"model": w.spec.id, "pid": w.pid, "state": w.state.value,
                    "duration_s": round(time.monotonic() - t0, 3)}

        if not stream:
            await loading
            return JSONResponse(report())

        async def events() -> AsyncIterator[bytes]:
            try:
                while not loading.done():
                    worker = self.router.loading(name)
                    waits: set[asyncio.Future] = {loading}
                    if worker is not None:
                        yield sse({"stage": worker.progress.stage, "fraction": worker.progress.fraction})
                        waits.add(asyncio.ensure_future(worker.progressed.wait()))
                    await asyncio.wait(waits, timeout=self.settings.sse_keepalive_s,
                                       return_when=asyncio.FIRST_COMPLETED)
                    for w in waits - {loading}:
                        w.cancel()
                yield sse(report())
            except errors.MlxsupError as exc:
                yield sse(exc.body())

        def close() -> None:  # the client left, or the stream ended: a load still waiting is abandoned
            if not loading.done():
                loading.cancel()

        return SSEResponse(events(), close)

    async def config(self, request: Request) -> Response:
        """The daemon's effective configuration (`mlxsup config show`, the dashboard), the API key redacted."""
        specs = [self.router.registry.specs[m] for m in self.router.registry.ids()]
        return JSONResponse(effective(self.settings, specs, self.router.ceiling))

    async def metrics(self, request: Request) -> Response:
        return Response(self.router.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    async def evict(self, request: Request) -> Response:
        body = await _admin_body(request, {"mode", "timeout"})
        mode = body.get("mode", "drain")
        if mode not in ("drain", "now"):
            raise errors.InvalidRequest("'mode' must be 'drain' or 'now'", param="mode")
        timeout = body.get("timeout")
        if timeout is not None and (not is_number(timeout) or not 0 <= timeout <= MAX_EVICT_TIMEOUT_S):
            raise errors.InvalidRequest(f"'timeout' must be a number of seconds from 0 to {MAX_EVICT_TIMEOUT_S}",
                                        param="timeout")
        report = await self.router.evict(request.path_params["model"], mode, timeout)
        return JSONResponse(report.to_dict())

    async def clear_hot_cache(self, request: Request) -> Response:
        return await self._clear_cache(request, "hot")

    async def clear_ssd_cache(self, request: Request) -> Response:
        return await self._clear_cache(request, "ssd")

    async def _clear_cache(self, request: Request, which: str) -> Response:
        """Body `{"model": id}` for one model, none (or `{}`) for all; answers with the bytes reclaimed."""
        body = await _admin_body(request, {"model"})
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise errors.InvalidRequest("'model' must be a string", param="model")
        return JSONResponse(await self.router.clear_cache(which, model))


def _config_context(path: Path) -> int | None:
    """A model's context length from its config.json (a nested text_config first), before any worker reads it."""
    try:
        config = json.loads((path / "config.json").read_text())
        value = {**config, **(config.get("text_config") or {})}.get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


def _release_lease(loading: asyncio.Task) -> None:
    """An explicit load needs the worker ready, not held: its lease goes back the moment it is taken,
    on every path, even when no one is left to read the load's result (a client gone mid-stream)."""
    if not loading.cancelled() and loading.exception() is None:
        loading.result().release()


async def _admin_body(request: Request, keys: set[str]) -> dict:
    """An admin route's body: none (or `{}`) for the defaults, else an object with some of `keys`."""
    raw = await read_body(request, ADMIN_BODY_LIMIT)
    body = decode_json(raw) if raw else {}
    if not isinstance(body, dict):
        raise errors.InvalidRequest("the body must be a JSON object")
    unknown = sorted(set(body) - keys)
    if unknown:
        raise errors.InvalidRequest(f"unrecognized argument(s): {', '.join(unknown)}; this route takes "
                                    f"{', '.join(sorted(keys))}", param=unknown[0])
    return body


class RequireApiKey:
    """ASGI middleware: every HTTP route but /health and the dashboard's bare page needs `Authorization: Bearer
    <key>` or, as Anthropic's clients send it, `x-api-key: <key>`.

    The dashboard's page (and `/`, which redirects to it) is open too: it holds no state, and a
    browser cannot send a header when it navigates; the page asks for the key and sends it with
    every request it makes (gateway/ui.py)."""

    OPEN = ("/health", UI_PATH, "/")

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.OPEN:
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            # the scheme is case-insensitive (RFC 7235: `bearer` is as good as `Bearer`)
            bearer = hmac.compare_digest(token.strip(b" "), self.key) and scheme.lower() == b"bearer"
            if not bearer and not hmac.compare_digest(headers.get(b"x-api-key", b""), self.key):
                err = errors.Unauthorized("a valid API key is required: send 'Authorization: Bearer <key>' "
                                          "or 'x-api-key: <key>'")
                if scope["path"].startswith("/v1/messages"):
                    await JSONResponse(anthropic_error_body(err), status_code=err.status)(scope, receive, send)
                else:
                    await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


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


def build_app(router: Router, settings: Settings) -> ASGIApp:
    gw = Gateway(router, settings)
    dashboard = Dashboard()
    routes = [
        Route("/", dashboard.root, methods=["GET"]),
        Route(UI_PATH, dashboard.page, methods=["GET"]),
        Route("/api/config", gw.config, methods=["GET"]),
        Route("/v1/chat/completions", gw.chat, methods=["POST"]),
        Route("/v1/completions", gw.completions, methods=["POST"]),
        Route("/v1/models", gw.models, methods=["GET"]),
        Route("/v1/models/{model:path}", gw.model, methods=["GET"]),
        Route("/health", gw.health, methods=["GET"]),
        Route("/api/status", gw.status, methods=["GET"]),
        Route("/metrics", gw.metrics, methods=["GET"]),
        Route("/api/models/{model:path}/load", gw.load, methods=["POST"]),
        Route("/api/models/{model:path}/evict", gw.evict, methods=["POST"]),
        Route("/api/hot-cache/clear", gw.clear_hot_cache, methods=["POST"]),
        Route("/api/ssd-cache/clear", gw.clear_ssd_cache, methods=["POST"]),
        # /v1/messages (Anthropic), /v1/responses (OpenAI Responses), on this module's SSE and body helpers
        *agent_routes(router, settings, HttpKit(SSEResponse, unless_client_leaves, read_json)),
    ]
    handlers = {errors.MlxsupError: _on_error, HTTPException: _on_error, Exception: _on_error}
    app: ASGIApp = Starlette(routes=routes, exception_handlers=handlers)
    if settings.api_key:
        app = RequireApiKey(app, settings.api_key)
    # outermost: a request from a foreign Host or Origin is refused before anything else looks at it
    return WebGuard(app, hosts=[settings.host, *settings.allowed_hosts], origins=settings.allowed_origins)
