"""HTTP routes of the OpenAI API: chat completions, completions, and the model list.

A generation runs on the one request path (sse.py: a `Calls` with the lease released in `close()` on
every path); this module gives it OpenAI's shapes (openai_shape.py): a chunk per event, each choice's
end (its last delta and finish_reason) in one write, then the usage chunk and `[DONE]`; an error after
the first token is a `data:` error body, never a cut stream. A stream that waits (queued, loading,
prefilling, a slow step, its worker ended under it and it waits for its resume: resume.py) gets a chunk
that says nothing every `sse_keepalive_s` (clients that count chunks as activity keep waiting) and an SSE
comment saying what it waits for (waits.py); a whole response just comes later.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from protocol.messages import Finished
from protocol.modelconfig import MAX_CONTEXT, ConfigError, check_config, context_length, read_config, text_config
from protocol.modelkind import CHAT, VISION
from supervisor import errors
from supervisor.config import Settings
from supervisor.gateway.call import Calls
from supervisor.gateway.http import SSE_DONE, read_json, sse
from supervisor.gateway.images import ImageLimits, attach
from supervisor.gateway.openai_api import Parsed, parse_chat, parse_completion
from supervisor.gateway.openai_shape import Shaper
from supervisor.gateway.sampling import fill
from supervisor.gateway.sse import streamed, whole
from supervisor.gateway.transcript import Delta, Transcript
from supervisor.gateway.waits import Waits
from supervisor.router import Router
from supervisor.sampling import applied


class ChatWriter:
    """A chat or completion stream's events (sse.Writer).

    A keep-alive is a chunk per choice not yet ended: a chat choice's first says its role with empty content
    (as OpenAI's first chunk does), later ones have an empty delta; a completion's has empty text. Clients that
    count chunks as activity (Qwen Code) see one every keep-alive; the openai client reads no text from them.
    A choice's role is said once, in its first chunk, a keep-alive's or its first delta's. Beside it, an SSE
    comment says what the request waits for (waits.py)."""

    def __init__(self, router: Router, calls: Calls, shaper: Shaper) -> None:
        self.calls = calls
        self.shaper = shaper
        self.waits = Waits(router, calls)
        self.finished: dict[int, Finished] = {}
        self._opened: set[int] = set()  # the choices whose first chunk (the role) is written
        self._chunk = shaper.chunk  # looked up once: it runs once per token

    def opening(self) -> bytes:
        return b""

    def waiting(self) -> bytes:
        return self.waits.waiting() + self._alive()

    def idle(self) -> bytes:
        return self.waits.idle() + self._alive()

    def _alive(self) -> bytes:
        """A chunk that says nothing for each choice not yet ended (its first: the role)."""
        return b"".join(sse(self.shaper.chunk(index, "", None, first=self._opens(index)))
                        for index in range(len(self.calls.calls)) if index not in self.finished)

    def _opens(self, index: int) -> bool:
        """Whether this is the choice's first chunk (it says the role): true once per choice."""
        if index in self._opened:
            return False
        self._opened.add(index)
        return True

    def delta(self, index: int, delta: Delta, first: bool) -> bytes:
        return sse(self._chunk(index, delta[0], delta[2], first=first and self._opens(index)))

    def end(self, index: int, fin: Finished, first: bool) -> bytes:
        shaper = self.shaper
        opens = first and self._opens(index)
        said = opens or shaper.has_delta(fin.text, fin.extra)
        chunks = [shaper.chunk(index, fin.text, fin.extra, first=opens)] if said else []
        chunks.append(shaper.chunk(index, "", None, finish_reason=fin.finish_reason))
        self.finished[index] = fin
        return b"".join(sse(c) for c in chunks)  # one write for the end's chunks

    def done(self) -> bytes:
        if not self.calls.parsed.include_usage:
            return SSE_DONE
        return sse(self.shaper.usage_chunk([self.finished[i] for i in sorted(self.finished)])) + SSE_DONE

    def failed(self, exc: errors.MlxsupError) -> bytes:
        return sse(exc.body())


class OpenAIRoutes:
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
        await attach(parsed, self.router.registry, ImageLimits.of(self.settings))
        fill(parsed, self.router.registry)  # unset sampling fields: the model's defaults
        calls = Calls(self.router, parsed, request.url.path)
        shaper = Shaper(parsed, self.router.registry.resolve(parsed.model).id)
        if parsed.stream:
            return await streamed(calls, ChatWriter(self.router, calls, shaper), self.settings.sse_keepalive_s)
        said = [Transcript() for _ in calls.calls]
        # a client that leaves during the load or the prefill is seen at once, too
        finished = await whole(calls, request.receive, [t.feed for t in said])
        return JSONResponse(shaper.whole(said, finished))

    async def models(self, request: Request) -> Response:
        """Every model on disk (a model folder added since is listed too): who publishes it (the org of an
        `ORG/NAME` repo id, else mlxsup) and whether it is loaded."""
        created = int(self.started)
        self.router.registry.refresh()
        states = {model: w.state.value for model, w in self.router.lifecycle.workers.items()}
        data = [{"id": spec.id, "object": "model", "created": created, "owned_by": owner(spec.id),
                 "loaded": states.get(spec.id) == "ready", "state": states.get(spec.id) or "stopped"}
                for spec in self.router.registry.on_disk()]
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        """One model (the openai client's models.retrieve): its context length, whether it is loaded, and (a
        generating model) the sampling a request that sets none gets, each value with its source."""
        self.router.registry.refresh()
        spec = self.router.registry.resolve(request.path_params["model"])
        status: dict = next((m for m in self.router.status().to_dict()["models"] if m["id"] == spec.id), {})
        state = status.get("state")
        sampling = {"sampling": applied(spec)} if spec.kind in (CHAT, VISION) else {}
        return JSONResponse({"id": spec.id, "object": "model", "created": int(self.started), "owned_by": owner(spec.id),
                             "loaded": state == "ready", "state": state or "unloaded", **sampling,
                             "context_length": status.get("context_length")
                             or _config_context(spec.path, self.router.lifecycle.context_cap(spec))})


def owner(model_id: str) -> str:
    """OpenAI's `owned_by`: the org of a hub repo id, else this server."""
    org, slash, _ = model_id.partition("/")
    return org if slash else "mlxsup"


def _config_context(path: Path, cap: int | None) -> int | None:
    """A model's context length from its config.json (a nested text_config first), before any worker reads it: as its
    worker would publish it (modelconfig.context_length, under the memory's `cap`); None for a config its worker
    would refuse, or one that names none."""
    try:
        config = read_config(path)
        check_config(config)
    except ConfigError:
        return None
    if text_config(config).get("max_position_embeddings") is None:
        return None
    return min(context_length(config), cap or MAX_CONTEXT)


def openai_routes(router: Router, settings: Settings) -> list[Route]:
    routes = OpenAIRoutes(router, settings)
    return [
        Route("/v1/chat/completions", routes.chat, methods=["POST"]),
        Route("/v1/completions", routes.completions, methods=["POST"]),
        Route("/v1/models", routes.models, methods=["GET"]),
        Route("/v1/models/{model:path}", routes.model, methods=["GET"]),
    ]
