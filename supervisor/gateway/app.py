"""The HTTP gateway assembled: the API routes, the daemon's own routes (status, metrics, admin), the API
key and web guard middleware, and the one mapping of errors to HTTP responses.

The APIs' routes live with them (openai_routes.py; agent_routes.py for Anthropic and Responses), on the
one request path of sse.py; http.py has what every route uses of HTTP. Every body is decoded by
body.py, so a bad one is a 400. An explicit load takes a lease from the router and gives it back as
soon as it is taken, on every path; a streamed load says its progress in SSE events.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from supervisor import __version__, errors
from supervisor.config import Settings
from supervisor.config_view import effective
from supervisor.gateway.agent_routes import agent_routes
from supervisor.gateway.anthropic_api import anthropic_error_body
from supervisor.gateway.arrivals import Arrivals
from supervisor.gateway.audio_routes import UPLOAD_PATHS, audio_routes
from supervisor.gateway.body import decode_json
from supervisor.gateway.embeddings_routes import embeddings_routes
from supervisor.gateway.guard import WebGuard
from supervisor.gateway.http import BodyDeadline, SSEResponse, error_response, read_body, sse
from supervisor.gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from supervisor.gateway.ollama_listener import STATUS as OLLAMA_LISTENER
from supervisor.gateway.ollama_routes import BLOBS as OLLAMA_BLOBS
from supervisor.gateway.ollama_routes import PATHS as OLLAMA_PATHS
from supervisor.gateway.ollama_routes import error_body as ollama_error_body
from supervisor.gateway.ollama_routes import ollama_routes
from supervisor.gateway.openai_routes import openai_routes
from supervisor.gateway.pull_routes import PullRoutes
from supervisor.gateway.rerank_routes import rerank_routes
from supervisor.gateway.ui import UI_PATH, Dashboard
from supervisor.router import Router
from supervisor.units import is_number

log = logging.getLogger(__name__)
ADMIN_BODY_LIMIT = 4096
MAX_EVICT_TIMEOUT_S = 86400  # a drain deadline past a day is a mistake, and past 2**64 cannot go to the worker


class Gateway:
    def __init__(self, router: Router, settings: Settings) -> None:
        self.router = router
        self.settings = settings
        self.started = time.time()

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "shutting_down" if self.router.shutting_down else "ok"})

    async def status(self, request: Request) -> Response:
        return JSONResponse({"version": __version__, "uptime_s": round(time.time() - self.started, 1),
                             "security_warning": self.settings.security_warning(),
                             "ollama_listener": OLLAMA_LISTENER.to_dict(),
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
        loading = asyncio.create_task(self.router.acquire(name, explicit=True, queued=False), name=f"load[{name}]")
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
                elif scope["path"] in OLLAMA_PATHS:
                    await JSONResponse(ollama_error_body(err), status_code=err.status)(scope, receive, send)
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
        Route(UI_PATH, dashboard.page, methods=["GET"]),
        Route("/api/config", gw.config, methods=["GET"]),
        *openai_routes(router, settings),
        *embeddings_routes(router, settings),  # /v1/embeddings
        *rerank_routes(router, settings),  # /v1/rerank, /rerank, /v2/rerank
        *audio_routes(router, settings),  # /v1/audio/transcriptions, /v1/audio/translations, /v1/audio/speech
        Route("/health", gw.health, methods=["GET"]),
        Route("/api/status", gw.status, methods=["GET"]),
        Route("/metrics", gw.metrics, methods=["GET"]),
        Route("/api/models/{model:path}/load", gw.load, methods=["POST"]),
        Route("/api/models/{model:path}/evict", gw.evict, methods=["POST"]),
        Route("/api/hot-cache/clear", gw.clear_hot_cache, methods=["POST"]),
        Route("/api/ssd-cache/clear", gw.clear_ssd_cache, methods=["POST"]),
        # Ollama's API: /, /api/version, /api/tags, /api/show, /api/ps, /api/chat, /api/generate, /api/embed(dings),
        # /api/pull (mlxsup's own pull body too), /api/delete, /api/copy
        *ollama_routes(router, settings, dashboard.root, PullRoutes(router, settings)),
        *agent_routes(router, settings),  # /v1/messages (Anthropic), /v1/responses (OpenAI Responses)
    ]
    handlers = {errors.MlxsupError: _on_error, HTTPException: _on_error, Exception: _on_error}
    app: ASGIApp = Arrivals(Starlette(routes=routes, exception_handlers=handlers))  # each Submit says what follows
    # a body not whole in time (an upload: a part of it): 408, never held for ever
    app = BodyDeadline(app, settings.body_timeout_s, uploads=(OLLAMA_BLOBS,))
    if settings.api_key:
        app = RequireApiKey(app, settings.api_key)
    # outermost: a request from a foreign Host or Origin is refused before anything else looks at it
    return WebGuard(app, hosts=[settings.host, *settings.allowed_hosts], origins=settings.allowed_origins,
                    untyped=[*OLLAMA_PATHS, OLLAMA_BLOBS], multipart=UPLOAD_PATHS,  # Ollama's clients send bodies with no Content-Type
                    error_body=lambda path, exc: ollama_error_body(exc) if path in OLLAMA_PATHS else exc.body())
