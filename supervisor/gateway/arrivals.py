"""Generation requests counted, per model, from the moment they are on their way to a model's worker to their
Submit, so each Submit can say how many others are coming to the same worker (Submit.more).

Clients that start together reach the daemon together, but its one event loop takes their requests one at a time
(~2 ms of CPU each: the guard, the body, parsing, routing), so a worker hears of a burst of 32 over ~60 ms. Without
a word of what is coming, it started the first request alone and took the others a few per step, each step a
batch shape of its own (a 32-client ramp). Told more are coming, it waits a
little for them (worker/loop.py, `--burst-wait-ms`) and prefills them together.

`Arrivals` wraps the app and gives each POST to a generation endpoint a mark. The mark counts for a model only once
the request's body has been read and parsed and its Call is about to be routed there (`expect(model)`, called by
the gateway's Call as it starts), until its first Submit leaves (`still_coming`, called by the Call as it submits)
or the request ends without one. So an upload still arriving, stalled or slow, counts for no model, nor does a
request for another model (waiting on that one's load, say): either made every idle worker wait out its burst
window when the count was of every request from its arrival.
Invariant: `coming[m]` is the number of requests between those two points for model m; the mark lives in the
request's context, so a Call started in a task of its own (n choices) finds its request's mark, and a request
counts once however many choices it has.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from contextvars import ContextVar

from starlette.types import ASGIApp, Receive, Scope, Send

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"})


class Arrivals:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.coming: Counter[str] = Counter()  # by model id: the requests on their way to its worker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        mark = _Mark(self)
        token = _mark.set(mark)
        try:
            await self.app(scope, receive, send)
        finally:
            _mark.reset(token)
            mark.submitted()


class _Mark:
    __slots__ = ("arrivals", "model", "done")

    def __init__(self, arrivals: Arrivals) -> None:
        self.arrivals = arrivals
        self.model: str | None = None  # the model it counts for, once expected
        self.done = False  # submitted, or ended without a submit

    def expect(self, model: str) -> None:
        if self.model is None and not self.done:
            self.model = model
            self.arrivals.coming[model] += 1

    def submitted(self) -> None:
        if self.model is not None and not self.done:
            coming = self.arrivals.coming
            coming[self.model] -= 1
            if coming[self.model] <= 0:
                del coming[self.model]
        self.done = True


_mark: ContextVar[_Mark | None] = ContextVar("arrival", default=None)


def expect(model: str) -> None:
    """This request's body is read and it is on its way to `model`'s worker (routed, or waiting on its load):
    from now until its Submit, another Submit to that model counts it (a request counts once: its first call)."""
    if (mark := _mark.get()) is not None:
        mark.expect(model)


LOOK_AROUND = 3  # event-loop turns a Submit yields first: a request that came meanwhile is parsed and counted


async def still_coming(model: str) -> int:
    """As this request's Submit to `model` leaves: it is no longer coming; how many other generation requests
    still are, to the same model (0 outside a counted request). The event loop turns a few times first
    (LOOK_AROUND): requests already read get their turn (parsed, their Call started), and so their count, before
    this one is submitted."""
    mark = _mark.get()
    if mark is None:
        return 0
    for _ in range(LOOK_AROUND):
        await asyncio.sleep(0)
    mark.submitted()
    return mark.arrivals.coming[model]
