"""`POST /api/pull {"model": "ORG/NAME[@REV]", "stream": true}`: the daemon pulls a model into its Hugging Face
cache (supervisor/hub/pull.py), its progress streamed as SSE `data:` events, as `mlxsup load` streams a load.

Events: `{"status": "downloading", file, index, count, file_done, file_total, done, total, rate, eta_s}` while
bytes arrive, then `{"status": "success", "model", "commit", "path"}` or an error body. Without "stream", one
JSON answer when the pull ends. An id the hub's rules refuse (hub/pull.py's ID_RULE), a repo that is no MLX model,
or a revision the hub lacks, is a 400 before any byte is written; a hub that cannot be reached (no network, a wrong
HF_ENDPOINT, HF_HUB_OFFLINE, the hub answering 5xx) a 503 `hub_unreachable` that says what to check. Behind the same guard as every /api route (Host, Origin, JSON body, the API key).
Invariants: the download runs in a daemon thread, never on the event loop, and goes on to its end when the
client leaves (the next pull resumes it if the daemon itself stops); one pull per repo at a time (409); the
registry looks at the cache again the moment a pull completes, so the model is served from its next request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from supervisor import errors
from supervisor.config import Settings
from supervisor.gateway.body import decode_json
from supervisor.gateway.http import SSEResponse, read_body, sse
from supervisor.hub.pull import BadReference, HubUnreachable, Plan, Progress, PullError, parse_ref, plan, pull
from supervisor.router import Router

log = logging.getLogger(__name__)
BODY_LIMIT = 4096


class PullRoutes:
    def __init__(self, router: Router, settings: Settings) -> None:
        self.router = router
        self.settings = settings
        self.pulling: set[str] = set()  # repo ids with a pull under way in this daemon

    async def pull(self, request: Request) -> Response:
        model, stream = await _body(request)
        p, events, done = await self.begin(model)
        if not stream:
            try:
                return JSONResponse(_outcome(p, await asyncio.shield(done)))  # the client leaving leaves it running
            except Exception as exc:
                raise failure(p, exc) from None
        return SSEResponse(_events(p, events, done), lambda: None)

    async def begin(self, model: str) -> tuple[Plan, asyncio.Queue[dict[str, Any]], asyncio.Future[Path]]:
        """Plan the pull of `model` (ORG/NAME[@REVISION]) and start it on its thread: (its plan, its progress
        events, its end); the errors before any byte is fetched are raised here (the module's docstring)."""
        hub = self.settings.hf_cache
        if hub is None:
            raise errors.InvalidRequest("this daemon reads no Hugging Face cache ([server] hf_cache is empty)")
        repo_id = _repo_id(model)
        if repo_id in self.pulling:
            err = errors.InvalidRequest(f"{repo_id} is being pulled already", param="model", code="already_pulling")
            err.status = 409
            raise err
        self.pulling.add(repo_id)
        try:
            p = await asyncio.to_thread(plan, model)
        except HubUnreachable as exc:  # no network, a wrong HF_ENDPOINT, offline mode, the hub failing: try later
            self.pulling.discard(repo_id)
            unreachable = errors.MlxsupError(str(exc), param="model", code="hub_unreachable")
            unreachable.status = 503
            raise unreachable from None
        except BadReference as exc:
            self.pulling.discard(repo_id)
            raise errors.InvalidRequest(str(exc), param="model") from None
        except PullError as exc:
            self.pulling.discard(repo_id)
            raise errors.InvalidRequest(str(exc), param="model", code="not_pullable") from None
        except BaseException:
            self.pulling.discard(repo_id)
            raise
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        done: asyncio.Future[Path] = loop.create_future()

        def report(pr: Progress) -> None:
            loop.call_soon_threadsafe(events.put_nowait, pr.to_dict())

        def run() -> None:
            try:
                path = pull(p, hub, report)
            except BaseException as exc:  # handed to the loop, which answers with it
                loop.call_soon_threadsafe(_settle, done, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, done, path, None)

        done.add_done_callback(lambda _: self._finished(repo_id))
        threading.Thread(target=run, name=f"pull[{repo_id}]", daemon=True).start()  # daemon: a stop is not held up
        return p, events, done

    def _finished(self, repo_id: str) -> None:
        self.pulling.discard(repo_id)
        self.router.registry.refresh(force=True)


def _settle(done: asyncio.Future[Path], path: Path | None, exc: BaseException | None) -> None:
    if exc is not None:
        done.set_exception(exc)
    elif path is not None:
        done.set_result(path)


def _outcome(p: Plan, path: Path) -> dict[str, Any]:
    return {"status": "success", "model": p.repo_id, "revision": p.revision, "commit": p.commit, "path": str(path),
            "total": p.total}


async def _events(p: Plan, events: asyncio.Queue[dict[str, Any]], done: asyncio.Future[Path]) -> AsyncIterator[bytes]:
    while not done.done() or not events.empty():
        getting = asyncio.ensure_future(events.get())
        waits: set[asyncio.Future[Any]] = {getting, done}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if getting.done():
            yield sse(getting.result())
        else:
            getting.cancel()
    exc = done.exception()
    yield sse(_outcome(p, done.result()) if exc is None else failure(p, exc).body())


def failure(p: Plan, exc: BaseException) -> errors.MlxsupError:
    """A pull that failed once under way (the hub's bytes did not verify, it stopped sending): a 502."""
    err = errors.MlxsupError(str(exc) if isinstance(exc, PullError) else f"{p.repo_id}: the pull failed: {exc!r}",
                             code="pull_failed")
    err.status = 502
    return err


def _repo_id(model: str) -> str:
    try:
        return parse_ref(model)[0]
    except PullError as exc:
        raise errors.InvalidRequest(str(exc), param="model") from None


async def _body(request: Request) -> tuple[str, bool]:
    raw = await read_body(request, BODY_LIMIT)
    body = decode_json(raw) if raw else None
    if not isinstance(body, dict):
        raise errors.InvalidRequest('the body must be a JSON object: {"model": "ORG/NAME[@REVISION]"}')
    unknown = sorted(set(body) - {"model", "stream"})
    if unknown:
        raise errors.InvalidRequest(f"unrecognized argument(s): {', '.join(unknown)}; this route takes model, stream",
                                    param=unknown[0])
    model, stream = body.get("model"), body.get("stream", False)
    if not isinstance(model, str) or not model:
        raise errors.InvalidRequest("'model' must be a repository id string, ORG/NAME[@REVISION]", param="model")
    if not isinstance(stream, bool):
        raise errors.InvalidRequest("'stream' must be a boolean", param="stream")
    return model, stream
