"""The one request path of every generation route, streamed (SSE) or whole; each API gives only its shapes.

`streamed` starts a request's choices and answers with an SSE stream run by `stream`, the one SSE
loop: the API's opening, its keep-alive while nothing is said (queued, a cold load, a prefill, a slow step, a
resume: an event the API defines, which its clients count as activity, and a comment saying why), each
event's bytes as one write (a Call merges the deltas queued together, call.py), its end, and its error
event. `whole` reads every choice to its end for a whole response. An API's `Writer` says only how a
delta, a finish, a failure and a keep-alive are written.
Invariants: an error before the first token is the response's HTTP status (raised here, written by the
route in the API's own error body); after it, the API's error event, never a silently cut stream. The
calls are closed (the lease released, the worker told to abort) on every path: by the SSE response's
`on_close` once the client has the end or has left, by `whole` before it returns or raises. A stream
that ends early cancels a start still under way in its `finally`. Per token the loop does one read,
one shape and one write: no task, no wait beyond the read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import Protocol

from starlette.types import Receive

from protocol.messages import Finished
from supervisor import errors
from supervisor.gateway.call import Calls
from supervisor.gateway.http import SSEResponse, unless_client_leaves
from supervisor.gateway.transcript import Delta

log = logging.getLogger(__name__)


class Writer(Protocol):
    """How one API writes a stream (each method's bytes are one write; b"" writes nothing)."""

    def opening(self) -> bytes: ...  # before anything else, even before a cold load ends

    def waiting(self) -> bytes: ...  # every keep-alive before every choice's first event (queued, loading, prefilling)

    def idle(self) -> bytes: ...  # every keep-alive with nothing said since (a slow step, a suspended choice)

    def delta(self, index: int, delta: Delta, first: bool) -> bytes: ...  # `first`: the choice's first event

    def end(self, index: int, fin: Finished, first: bool) -> bytes: ...

    def done(self) -> bytes: ...  # after every choice's end

    def failed(self, exc: errors.MlxsupError) -> bytes: ...


async def streamed(calls: Calls, writer: Writer, keepalive_s: float) -> SSEResponse:
    """Start `calls` and stream them in `writer`'s shapes; a start that fails within a keep-alive is raised
    (the response's HTTP status), one still under way after it goes on in the stream (keep-alives meanwhile)."""
    rid = calls.parsed.submit.rid
    starting = asyncio.create_task(calls.start(), name=f"start[{rid}]")
    try:
        done, _ = await asyncio.wait({starting}, timeout=keepalive_s)
    except asyncio.CancelledError:  # the server is going away under this request: leave nothing held
        starting.cancel()
        calls.close()
        raise
    if done and (exc := starting.exception()) is not None:
        calls.close()
        raise exc
    return SSEResponse(stream(calls, starting, writer, keepalive_s), calls.close)


async def stream(calls: Calls, starting: asyncio.Task, writer: Writer, keepalive_s: float) -> AsyncIterator[bytes]:
    """The SSE body of a request whose start is `starting` (see the module's docstring)."""
    if opening := writer.opening():
        yield opening
    events = calls.events(keepalive_s)
    started: set[int] = set()
    try:
        while not starting.done():  # a load, a queue, a prefill: keep the client waiting meanwhile
            if note := writer.waiting():
                yield note
            await asyncio.wait({starting}, timeout=keepalive_s)
        starting.result()
        delta, end = writer.delta, writer.end  # looked up once: they run once per token
        async for index, item in events:
            if item is None:  # nothing within a keep-alive: a choice may wait to be resumed on the next worker
                if note := writer.idle():
                    yield note
                continue
            first = index not in started
            if first:
                started.add(index)
            chunk = end(index, item, first) if isinstance(item, Finished) else delta(index, item, first)
            if chunk:
                yield chunk
        if last := writer.done():
            yield last
    except errors.MlxsupError as exc:
        log.info("[sse] stream failed rid=%s code=%s", calls.parsed.submit.rid, exc.code)
        yield writer.failed(exc)
    finally:
        if not starting.done():
            starting.cancel()
        await events.aclose()


async def whole(calls: Calls, receive: Receive, record: Sequence[Callable[[str, dict | None], object]]) -> list[Finished]:
    """Start `calls` and read every choice to its end, each delta (a finish's last text too) given to its choice's
    `record`: each choice's Finished. A client that leaves first aborts it (RequestAborted); the calls are closed."""
    async def read() -> list[Finished]:
        await calls.start()
        finished: dict[int, Finished] = {}
        async with aclosing(calls.events()) as events:
            async for index, item in events:
                if item is None:
                    continue
                if isinstance(item, Finished):
                    record[index](item.text, item.extra)
                    finished[index] = item
                else:
                    record[index](item[0], item[2])
        if len(finished) < len(calls.calls):
            raise errors.MlxsupError("the generation ended without finishing")
        return [finished[i] for i in range(len(calls.calls))]

    try:
        return await unless_client_leaves(read(), receive, f"whole[{calls.parsed.submit.rid}]")
    finally:
        calls.close()
