"""HTTP routes of Ollama's API: every app that speaks it (the `ollama` clients, Copilot's and JetBrains'
Ollama providers, Open WebUI, ...) works unmodified against mlxsup.

A generation (`/api/chat`, `/api/generate`) runs on the one request path of the other APIs (sse.py: a `Calls` with
the lease released on every path; the same Submit, constraints, prompt caches and resume), with Ollama's shapes
(ollama_shape.py) written as NDJSON lines, `stream` true unless it is false. The model's worker is made ready first
(its wait is `load_duration`), then the request runs. Embeddings (`/api/embed`, `/api/embeddings`) ask the
embedder's worker as /v1/embeddings does. Model management maps onto mlxsup's own: `/api/tags` the models on disk,
`/api/show` one model's facts (ollama_models.py), `/api/ps` the loaded ones with when they expire, `/api/pull` a
Hugging Face pull (hf.co/ORG/NAME[:REVISION]; mlxsup's own body on the same path is served as before),
`/api/delete` the model's files (a copy's name only, for a copy), `/api/copy` a new name for a model (an alias, for
the daemon's life), `/api/create` from an uploaded GGUF file `mlxsup import` (ollama_create.py).

Errors are Ollama's `{"error": "..."}` with its status codes (an unknown model is a 404, which its clients raise as
ResponseError); an error after a stream began is an `{"error"}` line, as Ollama ends a stream with one.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import Message

from protocol.messages import Embed, Embedded, Finished
from protocol.modelkind import CHAT, EMBEDDING, RERANK, VISION
from supervisor import errors
from supervisor.config import Settings
from supervisor.gateway import ollama_models as om
from supervisor.gateway.body import decode_json
from supervisor.gateway.call import Calls
from supervisor.gateway.http import SSEResponse, error_response, read_body, read_json
from supervisor.gateway.images import ImageLimits, attach
from supervisor.gateway.ollama_api import OllamaRequest, bad, parse_chat, parse_embed, parse_generate
from supervisor.gateway.ollama_create import Blobs, create
from supervisor.gateway.ollama_keepalive import KeepAlive
from supervisor.gateway.ollama_shape import OllamaShaper, Timing, dumps
from supervisor.gateway.openai_routes import _config_context
from supervisor.gateway.pull_routes import PullRoutes, failure
from supervisor.gateway.sampling import fill
from supervisor.gateway.sse import streamed, whole
from supervisor.gateway.transcript import Delta
from supervisor.gateway.worker_ask import ask_worker
from supervisor.hub.pull import Plan
from supervisor.registry import ModelSpec
from supervisor.router import Router

log = logging.getLogger(__name__)
OLLAMA_VERSION = "0.12.10"  # the Ollama release whose API this one speaks (clients gate features on it)
RUNNING = "Ollama is running"
ADMIN_BODY_LIMIT = 64 * 1024
BLOBS = "/api/blobs/"  # a path under it names a blob: /api/blobs/sha256:<hex>
PATHS = ("/api/version", "/api/tags", "/api/show", "/api/ps", "/api/chat", "/api/generate", "/api/embed",
         "/api/embeddings", "/api/pull", "/api/delete", "/api/copy", "/api/create", "/api/push")


def error_body(exc: errors.MlxsupError) -> dict:
    return {"error": exc.message}


def ndjson(lines: AsyncIterator[bytes], on_close: Callable[[], None]) -> SSEResponse:
    """A stream as Ollama writes it, one JSON object a line: the SSE response of the request path (its disconnect
    watch and `on_close` exactly once), said as NDJSON."""
    response = SSEResponse(lines, on_close)
    response.headers["content-type"] = "application/x-ndjson"
    return response


class NDJSONWriter:
    """A chat or generate stream's lines (sse.Writer). Ollama's clients read every line as JSON, so a wait writes
    nothing (no keep-alive line: Ollama sends none either)."""

    def __init__(self, calls: Calls, shaper: OllamaShaper, timing: Timing) -> None:
        self.calls = calls
        self.shaper = shaper
        self.timing = timing

    def opening(self) -> bytes:
        return b""

    def waiting(self) -> bytes:
        return b""

    def idle(self) -> bytes:
        return b""

    def delta(self, index: int, delta: Delta, first: bool) -> bytes:
        line = self.shaper.feed(delta[0], delta[2])
        return dumps(line) if line is not None else b""

    def end(self, index: int, fin: Finished, first: bool) -> bytes:
        durations = self.timing.durations(fin, self.calls.calls[0].t_first)
        return b"".join(dumps(line) for line in self.shaper.last(fin, durations))

    def done(self) -> bytes:
        return b""

    def failed(self, exc: errors.MlxsupError) -> bytes:
        return dumps(error_body(exc))


def _replayed(request: Request, raw: bytes) -> Request:
    """`request` with its body (already read) to be read again, by another route's handler."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await request.receive()

    return Request(request.scope, receive)


def ollama_pull(body: dict) -> bool:
    """Whether an /api/pull body is Ollama's (its clients' fields, `name` or `insecure`; an hf.co name; a tag), not
    mlxsup's own `{"model": "ORG/NAME[@REVISION]"}` (the dashboard's and `curl`'s: a bare name is refused in its shape)."""
    name = body.get("model", body.get("name"))
    if "name" in body or "insecure" in body:
        return True
    return isinstance(name, str) and (name.lower().startswith(om.HF_PREFIXES) or (":" in name and "@" not in name))


class OllamaRoutes:
    def __init__(self, router: Router, settings: Settings, dashboard: Callable[[Request], Awaitable[Response]],
                 pulls: PullRoutes) -> None:
        self.router = router
        self.settings = settings
        self.dashboard = dashboard
        self.pulls = pulls
        self.keep = KeepAlive(router)
        self.copies: dict[str, str] = {}  # names /api/copy gave -> model id
        self.blobs = Blobs(settings)  # /api/create's uploads

    # --- the daemon --------------------------------------------------------------------------

    async def root(self, request: Request) -> Response:
        """Ollama's "Ollama is running"; a browser (it asks for HTML) still gets the dashboard."""
        if request.method == "GET" and "text/html" in request.headers.get("accept", ""):
            return await self.dashboard(request)
        return PlainTextResponse(RUNNING)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": OLLAMA_VERSION})

    # --- models ------------------------------------------------------------------------------

    def _spec(self, name: Any) -> ModelSpec:
        if isinstance(name, str) and name.removesuffix(f":{om.LATEST}") in self.copies:
            spec = self.router.registry.specs.get(self.copies[name.removesuffix(f":{om.LATEST}")])
            if spec is not None:  # its model gone: the name is looked up as any other (a 404)
                return spec
        return om.resolve(self.router.registry, name)

    async def tags(self, request: Request) -> Response:
        self.router.registry.refresh()
        specs = [s for s in self.router.registry.on_disk() if s.kind != RERANK]
        models = [om.tag(s) for s in specs]
        for copy, model_id in sorted(self.copies.items()):
            spec = self.router.registry.specs.get(model_id)
            if spec is not None and spec.path.is_dir():
                models.append({**om.tag(spec), "name": om.ollama_name(copy), "model": om.ollama_name(copy)})
        return JSONResponse({"models": models})

    def _status(self, model_id: str) -> dict:
        return next((m for m in self.router.status().to_dict()["models"] if m["id"] == model_id), {})

    async def show(self, request: Request) -> Response:
        body = await self._body(request)
        self.router.registry.refresh()
        spec = self._spec(body.get("model", body.get("name")))
        status = self._status(spec.id)
        context = status.get("context_length") or _config_context(spec.path, self.router.lifecycle.context_cap(spec))
        return JSONResponse(om.show(spec, context, status.get("sampling")))

    async def ps(self, request: Request) -> Response:
        models = []
        for status in self.router.status().to_dict()["models"]:
            if status["state"] in ("ready", "loading") and status["id"] in self.router.registry.specs:
                models.append(om.running(self.router.registry.specs[status["id"]], status))
        return JSONResponse({"models": models})

    async def _body(self, request: Request, limit: int = ADMIN_BODY_LIMIT) -> dict:
        raw = await read_body(request, limit)
        body = decode_json(raw) if raw else None
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        return body

    async def delete(self, request: Request) -> Response:
        body = await self._body(request)
        name = body.get("model", body.get("name"))
        if not isinstance(name, str) or not name:
            raise bad("model is required", "model")
        if name.removesuffix(f":{om.LATEST}") in self.copies:  # a copy: its name goes, the model stays
            del self.copies[name.removesuffix(f":{om.LATEST}")]
            return Response(status_code=200)
        spec = om.resolve(self.router.registry, name)
        hub, imports = self.settings.hf_cache, self.settings.import_dir
        in_hub = hub is not None and (spec.path.is_relative_to(hub) or spec.path.resolve().is_relative_to(hub.resolve()))
        if not in_hub and not spec.path.resolve().is_relative_to(imports.resolve()):
            raise bad(f"'{spec.id}' is served from {spec.path}, which mlxsup did not put there (a model folder or a "
                      "[models] entry): remove it yourself", "model")
        await self.router.evict(spec.id, "drain", None, reason="api")
        if in_hub:
            from supervisor.hub import store

            assert hub is not None
            await asyncio.to_thread(store.remove, hub, spec.id)
        else:
            await asyncio.to_thread(shutil.rmtree, spec.path)
        for copy in [c for c, m in self.copies.items() if m == spec.id]:
            del self.copies[copy]
        log.info("[ollama] deleted %s (%s)", spec.id, spec.path)
        return Response(status_code=200)

    async def copy(self, request: Request) -> Response:
        body = await self._body(request)
        source, destination = body.get("source"), body.get("destination")
        if not isinstance(source, str) or not source:
            raise bad("source is required", "source")
        if not isinstance(destination, str) or not destination:
            raise bad("destination is required", "destination")
        self.name_copy(source, destination)
        return Response(status_code=200)

    def name_copy(self, source: str, destination: str) -> None:
        """`destination` names the model `source` names, from now on (for the daemon's life)."""
        spec = self._spec(source)
        name = destination.removesuffix(f":{om.LATEST}")
        if om.NAME_RULE.fullmatch(name) is None:
            raise bad("destination must be a model name: letters, digits, '-', '_', '.', '/' and ':'", "destination")
        try:
            taken = om.resolve(self.router.registry, name)
        except errors.MlxsupError:
            taken = None
        if taken is not None and taken.id != spec.id:
            raise bad(f"destination '{destination}' is a model already ({taken.id})", "destination")
        self.copies[name] = spec.id

    async def create(self, request: Request) -> Response:
        made = await create(await self._body(request), self.settings, self.blobs, self.name_copy,
                            lambda: self.router.registry.refresh(force=True))
        return made if isinstance(made, Response) else ndjson(made, lambda: None)

    async def push(self, request: Request) -> Response:
        raise bad("mlxsup does not push models to a registry")

    # --- pull ---------------------------------------------------------------------------------

    async def pull(self, request: Request) -> Response:
        raw = await read_body(request, ADMIN_BODY_LIMIT)
        body = decode_json(raw) if raw else None
        if not isinstance(body, dict) or not ollama_pull(body):  # mlxsup's own pull, answered as before
            try:
                return await self.pulls.pull(_replayed(request, raw))
            except errors.MlxsupError as exc:
                return error_response(exc)
        name = body.get("model", body.get("name"))
        stream = body.get("stream")
        if not isinstance(name, str) or not name:
            raise bad("model is required", "model")
        if stream is not None and not isinstance(stream, bool):
            raise bad("stream must be a boolean", "stream")
        if not name.lower().startswith(om.HF_PREFIXES):
            raise bad(f"pull model manifest: file does not exist: mlxsup pulls models from the Hugging Face hub, "
                      f"named hf.co/ORG/NAME[:REVISION] (not '{name[:100]}')", "model")
        ref = om.candidates(name)[-1]
        tag = name.rpartition(":")[2] if ":" in name.partition("/")[2] else ""
        if re.fullmatch(r"(?i)i?q\d\w*|f16|f32|bf16", tag):
            raise bad(f"pull model manifest: '{tag[:40]}' names a GGUF quantization; mlxsup pulls MLX repos "
                      "(hf.co/ORG/NAME[:REVISION], a branch, tag or commit of the repo); `mlxsup import` takes a "
                      "GGUF file", "model")
        if tag and tag != om.LATEST:
            ref = f"{ref}@{tag}"
        p, events, done = await self.pulls.begin(ref)
        if stream is False:
            try:
                await asyncio.shield(done)
            except Exception as exc:
                raise failure(p, exc) from None
            return JSONResponse({"status": "success"})
        return ndjson(_pull_lines(p, events, done), lambda: None)

    # --- generation ----------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, parse_chat, True)

    async def generate(self, request: Request) -> Response:
        return await self._generate(request, parse_generate, False)

    async def _ready(self, model_id: str) -> None:
        """The model's worker loaded (a lease taken and given back at once, as an explicit load does)."""
        lease = await self.router.acquire(model_id)
        lease.release()

    async def _generate(self, request: Request, parse: Callable[[Any], OllamaRequest], chat: bool) -> Response:
        timing = Timing()
        req = parse(await read_json(request, self.settings.max_body_bytes))
        spec = self._spec(req.model)
        if spec.kind not in (CHAT, VISION):
            raise bad(f'"{req.model}" does not support {"chat" if chat else "generate"}', "model")
        if req.think and "thinking" not in om.capabilities(spec):
            raise bad(f'"{req.model}" does not support thinking', "think")
        shaper = OllamaShaper(req.model, chat, req.parsed.logprobs if req.parsed else False)
        if req.parsed is None:  # nothing to generate: load the model (or, keep_alive 0, unload it)
            if req.keep_alive == 0:
                await self.router.evict(spec.id, "drain", None, reason="keep_alive")
                return JSONResponse(shaper.nothing("unload", timing.durations(None, None)))
            await self._ready(spec.id)
            timing.loaded = time.monotonic()
            self.keep.after(spec.id, req.keep_alive)
            return JSONResponse(shaper.nothing("load", timing.durations(None, None)))
        parsed = req.parsed
        parsed.model = spec.id
        await attach(parsed, self.router.registry, ImageLimits.of(self.settings))
        fill(parsed, self.router.registry)  # unset sampling fields: the model's defaults
        calls = Calls(self.router, parsed, request.url.path)
        timing.calls = calls  # its load's end is when its call has its worker (one acquire: no lease let go between)
        if parsed.stream:
            try:
                sse = await streamed(calls, NDJSONWriter(calls, shaper, timing), self.settings.sse_keepalive_s)
            except BaseException:
                self.keep.after(spec.id, req.keep_alive)
                raise

            def close() -> None:
                sse.on_close()
                self.keep.after(spec.id, req.keep_alive)

            return ndjson(sse.body_iterator, close)
        try:
            fin, = await whole(calls, request.receive, [shaper.feed])
        finally:
            self.keep.after(spec.id, req.keep_alive)
        return JSONResponse(shaper.whole(fin, timing.durations(fin, calls.calls[0].t_first)))

    # --- embeddings ----------------------------------------------------------------------------

    async def embed(self, request: Request) -> Response:
        return await self._embed(request, False)

    async def embeddings(self, request: Request) -> Response:
        return await self._embed(request, True)

    async def _embed(self, request: Request, old: bool) -> Response:
        timing = Timing()
        req = parse_embed(await read_json(request, self.settings.max_body_bytes), old)
        spec = self._spec(req.model)
        if spec.kind != EMBEDDING:
            raise bad(f'"{req.model}" does not support embeddings', "model")
        if old and req.inputs == [""]:  # Ollama's answer to an empty prompt
            return JSONResponse({"embedding": []})
        def leased() -> None:
            timing.loaded = time.monotonic()

        try:
            reply = await ask_worker(self.router, spec.id,
                                     lambda rid: Embed(rid, req.inputs, req.truncate, req.dimensions),
                                     self.settings.embed_timeout_s, "embed the inputs", param="input",
                                     request=request, silence=True, on_lease=leased)
        finally:
            self.keep.after(spec.id, req.keep_alive)
        assert isinstance(reply, Embedded)
        if old:
            return JSONResponse({"embedding": reply.vectors[0]})
        return JSONResponse({"model": req.model, "embeddings": reply.vectors, **timing.durations(None, None),
                             "prompt_eval_count": reply.tokens})


async def _pull_lines(p: Plan, events: asyncio.Queue[dict[str, Any]], done: asyncio.Future) -> AsyncIterator[bytes]:
    """Ollama's pull progress: the manifest, each file as a layer (`pulling <digest>`, its total and completed
    bytes), the verification, the manifest written, success; a failure is an `{"error"}` line."""
    yield dumps({"status": "pulling manifest"})
    digests = {f.name: f"sha256:{f.sha256 or f.etag}" for f in p.files}
    while not done.done() or not events.empty():
        getting = asyncio.ensure_future(events.get())
        await asyncio.wait({getting, done}, return_when=asyncio.FIRST_COMPLETED)
        if not getting.done():
            getting.cancel()
            continue
        event = getting.result()
        digest = digests.get(event.get("file", ""), "sha256:")
        yield dumps({"status": f"pulling {digest.removeprefix('sha256:')[:12]}", "digest": digest,
                     "total": event.get("file_total", 0), "completed": event.get("file_done", 0)})
    exc = done.exception()
    if exc is not None:
        yield dumps(error_body(failure(p, exc)))
        return
    for status in ("verifying sha256 digest", "writing manifest", "success"):
        yield dumps({"status": status})


def ollama_errors(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """A route's errors in Ollama's body, `{"error": "..."}`, with their status."""
    async def handle(request: Request) -> Response:
        try:
            return await handler(request)
        except errors.MlxsupError as exc:
            return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers())

    return handle


def ollama_routes(router: Router, settings: Settings, dashboard: Callable[[Request], Awaitable[Response]],
                  pulls: PullRoutes) -> list[Route]:
    r = OllamaRoutes(router, settings, dashboard, pulls)
    table: list[tuple[str, Callable[[Request], Awaitable[Response]], list[str]]] = [
        ("/", r.root, ["GET", "HEAD"]),
        ("/api/version", r.version, ["GET"]),
        ("/api/tags", r.tags, ["GET"]),
        ("/api/show", r.show, ["POST"]),
        ("/api/ps", r.ps, ["GET"]),
        ("/api/chat", r.chat, ["POST"]),
        ("/api/generate", r.generate, ["POST"]),
        ("/api/embed", r.embed, ["POST"]),
        ("/api/embeddings", r.embeddings, ["POST"]),
        ("/api/pull", r.pull, ["POST"]),
        ("/api/delete", r.delete, ["DELETE"]),
        ("/api/copy", r.copy, ["POST"]),
        ("/api/create", r.create, ["POST"]),
        ("/api/blobs/{digest}", r.blobs.head, ["HEAD"]),
        ("/api/blobs/{digest}", r.blobs.upload, ["POST"]),
        ("/api/push", r.push, ["POST"]),
    ]
    return [Route(path, ollama_errors(handler), methods=methods) for path, handler, methods in table]
