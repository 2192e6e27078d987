"""HTTP routes of the coding agents' APIs: Anthropic Messages (Claude Code) and OpenAI Responses (Codex).

Both run on the chat API's request path (sse.py: a `Calls` with the lease released in `close()` on
every path, the same Submit, parsing and constraints); only the shapes differ (anthropic_shape.py,
responses_shape.py). One `AgentWriter` gives either API's shaper to that path: the events that open a
stream, those of each delta and of the end, a ping, the events of a failure and the whole response.
Invariants, as for chat: an error before the first token is the response's HTTP status (in the API's own error
body); after it, an error event (Anthropic's `error`, Responses' `error` and `response.failed`),
never a cut stream; a stream that waits (queued, loading, prefilling, a slow step, a resume) gets an event of
its API every `sse_keepalive_s`, which its clients count as activity: Anthropic's `ping` (Claude Code), the
Responses API's `response.in_progress` (Codex's stream_idle_timeout_ms counts events, not SSE comments), with
an SSE comment beside it saying what the request waits for (waits.py).

Model names: the agents ask for their vendors' names (claude-sonnet-..., gpt-5-codex); a name no
model has is mapped by `model_aliases` (glob patterns, first match) and then `default_model`; with neither
configured, to the one chat model loaded (or the only one there is): `only_chat_model`.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from protocol.messages import Finished, Submit, Tokenize, Tokenized
from protocol.modelkind import CHAT
from supervisor import errors
from supervisor.config import Settings
from supervisor.gateway.anthropic_api import anthropic_error_body, parse_messages
from supervisor.gateway.anthropic_shape import MessageShaper
from supervisor.gateway.call import Calls
from supervisor.gateway.http import read_json, sse_event
from supervisor.gateway.images import ImageLimits, attach
from supervisor.gateway.openai_api import Parsed
from supervisor.gateway.response_store import ResponseStore
from supervisor.gateway.responses_api import parse_responses
from supervisor.gateway.responses_shape import ResponseShaper
from supervisor.gateway.sampling import fill
from supervisor.gateway.sse import streamed, whole
from supervisor.gateway.transcript import Delta
from supervisor.gateway.waits import Waits
from supervisor.gateway.worker_ask import ask_worker
from supervisor.router import Router

log = logging.getLogger(__name__)
TOKENIZE_TIMEOUT_S = 60.0  # a worker answers a Tokenize between two steps: this long only if it is stuck


class AgentWriter:
    """A Messages or Responses stream's events (sse.Writer) from its shaper; the whole response from the same.
    A keep-alive is `ping()`'s events (the API's own), after the comment of `waits` (set once the request's
    Calls are made) saying what the request waits for."""

    def __init__(self, shaper: MessageShaper | ResponseShaper, ping: Callable[[], list[dict]],
                 failed: Callable[[errors.MlxsupError], list[dict]]) -> None:
        self.shaper = shaper
        self.ping = ping
        self._failed = failed
        self.waits: Waits | None = None
        self.on_done: Callable[[dict], None] | None = None  # given the whole response once it is complete

    def opening(self) -> bytes:
        return b"".join(sse_event(e) for e in self.shaper.start())

    def waiting(self) -> bytes:
        return (self.waits.waiting() if self.waits else b"") + self._ping()

    def idle(self) -> bytes:
        return (self.waits.idle() if self.waits else b"") + self._ping()

    def _ping(self) -> bytes:
        return b"".join(sse_event(e) for e in self.ping())

    def delta(self, index: int, delta: Delta, first: bool) -> bytes:
        return b"".join([sse_event(e) for e in self.shaper.feed(delta[0], delta[2])])  # a delta's events in one write

    def end(self, index: int, fin: Finished, first: bool) -> bytes:
        events = [*self.shaper.feed(fin.text, fin.extra), *self.shaper.finish(fin)]
        if self.on_done is not None:
            self.on_done(self.shaper.whole(fin))
        return b"".join(sse_event(e) for e in events)

    def done(self) -> bytes:
        return b""

    def failed(self, exc: errors.MlxsupError) -> bytes:
        return b"".join(sse_event(e) for e in self._failed(exc))


def anthropic_writer(parsed: Parsed, model: str) -> AgentWriter:
    return AgentWriter(MessageShaper(parsed.submit.rid, model), lambda: [{"type": "ping"}],
                       lambda exc: [anthropic_error_body(exc)])


class AgentRoutes:
    def __init__(self, router: Router, settings: Settings) -> None:
        self.router = router
        self.settings = settings
        self.store = ResponseStore(settings.response_store_count, settings.response_store_bytes)

    def local_model(self, name: str) -> str:
        """The local model for a requested name: itself, a `model_aliases` pattern's, or `default_model`."""
        try:
            return self.router.registry.resolve(name).id
        except errors.ModelNotFound:
            for pattern, target in self.settings.model_aliases.items():
                if fnmatch.fnmatchcase(name, pattern):
                    return target
            if self.settings.default_model:
                return self.settings.default_model
            if not self.settings.model_aliases and (only := self.only_chat_model()) is not None:
                return only
            raise

    def only_chat_model(self) -> str | None:
        """With neither `model_aliases` nor `default_model` configured, an agent's name for a model (Claude Code's
        side requests name claude-haiku-*) goes to the one chat model loaded, or, none loaded, to the one there
        is: never a second worker for it, and never a guess between several."""
        loaded = {w.spec.id for w in self.router.workers.values() if w.spec.kind == CHAT}
        there = loaded or {s.id for s in self.router.registry.specs.values() if s.kind == CHAT}
        return next(iter(there)) if len(there) == 1 else None

    # --- Anthropic ---------------------------------------------------------------------------

    async def messages(self, request: Request) -> Response:
        return await _anthropic_errors(self._messages(request))

    async def _messages(self, request: Request) -> Response:
        parsed = parse_messages(await read_json(request, self.settings.max_body_bytes))
        requested, parsed.model = parsed.model, self.local_model(parsed.model)
        await attach(parsed, self.router.registry, ImageLimits.of(self.settings))
        return await self.serve(request, parsed, anthropic_writer(parsed, requested))

    async def count_tokens(self, request: Request) -> Response:
        return await _anthropic_errors(self._count_tokens(request))

    async def _count_tokens(self, request: Request) -> Response:
        """The prompt's tokens, by the model's own chat template and tokenizer, as the same body's request would
        encode them; nothing is generated and the batch is not touched (the worker answers a Tokenize)."""
        parsed = parse_messages(await read_json(request, self.settings.max_body_bytes), counting=True)
        parsed.model = self.local_model(parsed.model)
        await attach(parsed, self.router.registry, ImageLimits.of(self.settings))  # checked; not counted yet
        return JSONResponse({"input_tokens": await self.count_prompt(parsed.model, parsed.submit)})

    async def count_prompt(self, model: str, submit: Submit) -> int:
        """The prompt tokens of `submit` on `model`'s worker (loaded if it is not; held by a lease meanwhile)."""
        reply = await ask_worker(self.router, model, lambda rid: Tokenize(
            rid, submit.messages, submit.prompt, submit.tools, submit.template_kwargs), TOKENIZE_TIMEOUT_S,
            "count the prompt")
        assert isinstance(reply, Tokenized)
        return reply.count

    # --- OpenAI Responses ---------------------------------------------------------------------

    def _history(self, response_id: str) -> list[dict]:
        conversation = self.store.conversation(response_id)
        if conversation is None:
            raise errors.NotFound(f"Previous response with id {response_id[:100]!r} not found (never stored, "
                                  "deleted, or it or an earlier turn of its conversation dropped from the daemon's "
                                  "bounded store).", param="previous_response_id")
        return conversation

    async def responses(self, request: Request) -> Response:
        wanted = parse_responses(await read_json(request, self.settings.max_body_bytes), self._history,
                                 self.settings.strict_fields)
        parsed = wanted.parsed
        requested, parsed.model = parsed.model, self.local_model(parsed.model)
        await attach(parsed, self.router.registry, ImageLimits.of(self.settings))
        fill(parsed, self.router.registry)  # the echo says what applies: the request's, else the model's defaults
        wanted.echo.update(temperature=parsed.submit.temperature, top_p=parsed.submit.top_p)
        shaper = ResponseShaper(parsed.submit.rid, requested, wanted.echo)
        writer = AgentWriter(shaper, shaper.in_progress, shaper.failed)

        def keep(body: dict) -> None:
            if wanted.store and body["status"] in ("completed", "incomplete"):
                self.store.put(body, [*wanted.turn, shaper.turn()], wanted.previous_id)

        writer.on_done = keep
        return await self.serve(request, parsed, writer)

    async def get_response(self, request: Request) -> Response:
        stored = self.store.get(request.path_params["response_id"])
        if stored is None:
            raise errors.NotFound(f"Response with id {request.path_params['response_id'][:100]!r} not found.")
        return Response(stored, media_type="application/json")

    async def delete_response(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not self.store.delete(response_id):
            raise errors.NotFound(f"Response with id '{response_id}' not found.")
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    # --- the request path --------------------------------------------------------------------

    async def serve(self, request: Request, parsed: Parsed, writer: AgentWriter) -> Response:
        """Run a request and answer in `writer`'s shapes (its `on_done` gets the whole response once complete)."""
        fill(parsed, self.router.registry)  # unset sampling fields: the model's defaults
        calls = Calls(self.router, parsed, request.url.path)
        if parsed.stream:
            writer.waits = Waits(self.router, calls)
            return await streamed(calls, writer, self.settings.sse_keepalive_s)
        fin, = await whole(calls, request.receive, [writer.shaper.feed])
        body = writer.shaper.whole(fin)
        if writer.on_done is not None:
            writer.on_done(body)
        return JSONResponse(body)


async def _anthropic_errors(handling: Awaitable[Response]) -> Response:
    """Any error of a Messages route in Anthropic's error body."""
    try:
        return await handling
    except errors.MlxsupError as exc:
        return JSONResponse(anthropic_error_body(exc), status_code=exc.status, headers=exc.headers())


def agent_routes(router: Router, settings: Settings) -> list[Route]:
    routes = AgentRoutes(router, settings)
    return [
        Route("/v1/messages", routes.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", routes.count_tokens, methods=["POST"]),
        Route("/v1/responses", routes.responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", routes.get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", routes.delete_response, methods=["DELETE"]),
    ]
