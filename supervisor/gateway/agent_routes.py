"""HTTP routes of the coding agents' APIs: Anthropic Messages (Claude Code) and OpenAI Responses (Codex).

Both run on the chat API's request path (a `Calls` with the lease released in `close()` on every
path, the same Submit, parsing and constraints); only the shapes differ (anthropic_shape.py,
responses_shape.py). An `Api` adapter gives a route its shapes: the events that open a stream, those
of each delta and of the end, a ping, the events of a failure and the whole response. Invariants,
as for chat: an error before the first token is the response's HTTP status (in the API's own error
body); after it, an error event (Anthropic's `error`, Responses' `error` and `response.failed`),
never a cut stream; a stream waiting on a cold load or a slow step gets the API's ping (or an SSE
comment) every `sse_keepalive_s`.

Model names: the agents ask for their vendors' names (claude-sonnet-..., gpt-5-codex); a name no
model has is mapped by `model_aliases` (glob patterns, first match) and then `default_model`.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive

from protocol.codec import ProtocolError
from protocol.messages import Finished, Submit, Tokenize, Tokenized
from supervisor import errors
from supervisor.config import Settings
from supervisor.gateway.anthropic_api import anthropic_error_body, parse_messages
from supervisor.gateway.anthropic_shape import MessageShaper, sse_event
from supervisor.gateway.call import Calls
from supervisor.gateway.openai_api import Parsed
from supervisor.gateway.response_store import ResponseStore
from supervisor.gateway.responses_api import ResponsesRequest, parse_responses
from supervisor.gateway.responses_shape import ResponseShaper
from supervisor.gateway.responses_shape import sse_event as responses_event
from supervisor.router import Router

log = logging.getLogger(__name__)
TOKENIZE_TIMEOUT_S = 60.0  # a worker answers a Tokenize between two steps: this long only if it is stuck


@dataclass(frozen=True)
class HttpKit:
    """What these routes use of app.py (given by it, so that neither module imports the other)."""

    sse_response: Callable[[AsyncIterator[bytes], Callable[[], None]], Response]
    unless_client_leaves: Callable[[Coroutine[Any, Any, Finished], Receive, str], Awaitable[Finished]]
    read_json: Callable[[Request, int], Awaitable[Any]]


class Api(Protocol):
    """One response's shapes, streamed (bytes of SSE events) or whole."""

    def opening(self) -> list[bytes]: ...

    def delta(self, text: str, extra: dict | None) -> list[bytes]: ...

    def record(self, text: str, extra: dict | None) -> None: ...  # a whole response's delta: nothing written

    def end(self, fin: Finished) -> list[bytes]: ...

    def ping(self) -> bytes: ...

    def failed(self, exc: errors.MlxsupError) -> list[bytes]: ...

    def whole(self, fin: Finished) -> dict: ...


class AnthropicApi:
    def __init__(self, parsed: Parsed, model: str) -> None:
        self.shaper = MessageShaper(parsed.submit.rid, model)

    def opening(self) -> list[bytes]:
        return [sse_event(e) for e in self.shaper.start()]

    def delta(self, text: str, extra: dict | None) -> list[bytes]:
        return [sse_event(e) for e in self.shaper.feed(text, extra)]

    def record(self, text: str, extra: dict | None) -> None:
        self.shaper.feed(text, extra)

    def end(self, fin: Finished) -> list[bytes]:
        return [sse_event(e) for e in self.shaper.finish(fin)]

    def ping(self) -> bytes:
        return sse_event({"type": "ping"})

    def failed(self, exc: errors.MlxsupError) -> list[bytes]:
        return [sse_event(anthropic_error_body(exc))]

    def whole(self, fin: Finished) -> dict:
        return self.shaper.whole(fin)


class ResponsesApi:
    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self.shaper = ResponseShaper(request.parsed.submit.rid, model, request.echo)

    def opening(self) -> list[bytes]:
        return [responses_event(e) for e in self.shaper.start()]

    def delta(self, text: str, extra: dict | None) -> list[bytes]:
        return [responses_event(e) for e in self.shaper.feed(text, extra)]

    def record(self, text: str, extra: dict | None) -> None:
        self.shaper.feed(text, extra)

    def end(self, fin: Finished) -> list[bytes]:
        return [responses_event(e) for e in self.shaper.finish(fin)]

    def ping(self) -> bytes:
        return b": keep-alive\n\n"  # the Responses API has no ping event: an SSE comment

    def failed(self, exc: errors.MlxsupError) -> list[bytes]:
        return [responses_event(e) for e in self.shaper.failed(exc)]

    def whole(self, fin: Finished) -> dict:
        return self.shaper.whole(fin)


class AgentRoutes:
    def __init__(self, router: Router, settings: Settings, kit: HttpKit) -> None:
        self.router = router
        self.settings = settings
        self.kit = kit
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
            raise

    # --- Anthropic ---------------------------------------------------------------------------

    async def messages(self, request: Request) -> Response:
        return await _anthropic_errors(self._messages(request))

    async def _messages(self, request: Request) -> Response:
        parsed = parse_messages(await self.kit.read_json(request, self.settings.max_body_bytes))
        requested, parsed.model = parsed.model, self.local_model(parsed.model)
        return await self.serve(request, parsed, AnthropicApi(parsed, requested))

    async def count_tokens(self, request: Request) -> Response:
        return await _anthropic_errors(self._count_tokens(request))

    async def _count_tokens(self, request: Request) -> Response:
        """The prompt's tokens, by the model's own chat template and tokenizer, as the same body's request would
        encode them; nothing is generated and the batch is not touched (the worker answers a Tokenize)."""
        parsed = parse_messages(await self.kit.read_json(request, self.settings.max_body_bytes), counting=True)
        parsed.model = self.local_model(parsed.model)
        return JSONResponse({"input_tokens": await self.count_prompt(parsed.model, parsed.submit)})

    async def count_prompt(self, model: str, submit: Submit) -> int:
        """The prompt tokens of `submit` on `model`'s worker (loaded if it is not; held by a lease meanwhile)."""
        lease = await self.router.acquire(model)
        try:
            reply = await self.router.ask(lease.worker.spec.id, lambda rid: Tokenize(
                rid, submit.messages, submit.prompt, submit.tools, submit.template_kwargs), TOKENIZE_TIMEOUT_S)
        except ProtocolError as exc:  # a value the wire cannot carry: the request's fault, not the worker's
            raise errors.InvalidRequest(f"the request cannot be sent to the worker: {exc}") from None
        except TimeoutError:
            raise errors.MlxsupError(f"the worker of '{model}' did not count the prompt in "
                                     f"{TOKENIZE_TIMEOUT_S:.0f}s") from None
        finally:
            lease.release()
        if reply is None:
            raise errors.WorkerDied(f"the worker of '{model}' ended before it counted the prompt")
        assert isinstance(reply, Tokenized)
        if reply.code is not None:
            raise errors.from_worker(reply.code, reply.message)
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
        wanted = parse_responses(await self.kit.read_json(request, self.settings.max_body_bytes), self._history,
                                 self.settings.strict_fields)
        parsed = wanted.parsed
        requested, parsed.model = parsed.model, self.local_model(parsed.model)
        api = ResponsesApi(wanted, requested)

        def keep(body: dict) -> None:
            if wanted.store and body["status"] in ("completed", "incomplete"):
                self.store.put(body, [*wanted.turn, api.shaper.turn()], wanted.previous_id)

        return await self.serve(request, parsed, api, keep)

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

    async def serve(self, request: Request, parsed: Parsed, api: Api,
                    on_done: Callable[[dict], None] | None = None) -> Response:
        """Run a request and answer in `api`'s shapes; `on_done` gets the whole response once it is complete."""
        if not parsed.stream:
            fin = await self.run_whole(request, parsed, api.record)
            body = api.whole(fin)
            if on_done is not None:
                on_done(body)
            return JSONResponse(body)
        call = Calls(self.router, parsed, request.url.path)
        starting = asyncio.create_task(call.start(), name=f"start[{parsed.submit.rid}]")
        try:
            done, _ = await asyncio.wait({starting}, timeout=self.settings.sse_keepalive_s)
        except asyncio.CancelledError:
            starting.cancel()
            call.close()
            raise
        if done and starting.exception() is not None:
            call.close()
            raise starting.exception()  # type: ignore[misc]
        return self.kit.sse_response(self._stream(call, starting, api, on_done), call.close)

    async def _stream(self, call: Calls, starting: asyncio.Task, api: Api,
                      on_done: Callable[[dict], None] | None) -> AsyncIterator[bytes]:
        every = self.settings.sse_keepalive_s
        yield b"".join(api.opening())
        try:
            while not starting.done():  # a cold load
                await asyncio.wait({starting}, timeout=every)
                if not starting.done():
                    yield api.ping()
            starting.result()
            async with aclosing(call.events(every)) as items:
                async for _, item in items:
                    if item is None:  # nothing within `every`: a ping (the request may wait to be resumed)
                        yield api.ping()
                        continue
                    if isinstance(item, Finished):
                        yield b"".join([*api.delta(item.text, item.extra), *api.end(item)])
                        if on_done is not None:
                            on_done(api.whole(item))
                        return
                    if events := api.delta(item[0], item[2]):  # a delta's events in one write
                        yield b"".join(events)
        except errors.MlxsupError as exc:
            log.info("[agents] stream failed rid=%s code=%s", call.parsed.submit.rid, exc.code)
            yield b"".join(api.failed(exc))
        finally:
            if not starting.done():
                starting.cancel()

    async def run_whole(self, request: Request, parsed: Parsed, feed: Callable[[str, dict | None], Any]) -> Finished:
        """Run a request to its end, feeding each delta; a client that leaves aborts it."""
        call = Calls(self.router, parsed, request.url.path)

        async def collect() -> Finished:
            await call.start()
            async with aclosing(call.events()) as events:
                async for _, event in events:
                    if event is None:
                        continue
                    if isinstance(event, Finished):
                        feed(event.text, event.extra)
                        return event
                    feed(event[0], event[2])
            raise errors.MlxsupError("the generation ended without finishing")

        try:
            return await self.kit.unless_client_leaves(collect(), request.receive, f"collect[{parsed.submit.rid}]")
        finally:
            call.close()


async def _anthropic_errors(handling: Awaitable[Response]) -> Response:
    """Any error of a Messages route in Anthropic's error body."""
    try:
        return await handling
    except errors.MlxsupError as exc:
        return JSONResponse(anthropic_error_body(exc), status_code=exc.status)


def agent_routes(router: Router, settings: Settings, kit: HttpKit) -> list[Route]:
    routes = AgentRoutes(router, settings, kit)
    return [
        Route("/v1/messages", routes.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", routes.count_tokens, methods=["POST"]),
        Route("/v1/responses", routes.responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", routes.get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", routes.delete_response, methods=["DELETE"]),
    ]
