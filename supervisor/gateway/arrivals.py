"""Generation requests counted from their arrival to their Submit, so each Submit can say how many others are still
on their way (Submit.more).

Clients that start together reach the daemon together, but its one event loop takes their requests one at a time
(~2 ms of CPU each: the guard, the body, parsing, routing), so a worker hears of a burst of 32 over ~60 ms. Without
a word of what is coming, it started the first request alone and took the others a few per step, each step a
batch shape of its own (issue 30's 32-client ramp, bench/results/gpu/itl-s12/). Told more are coming, it waits a
little for them (worker/loop.py, `--burst-wait-ms`) and prefills them together.

`Arrivals` wraps the app: a POST to a generation endpoint counts from the moment it arrives until its first Submit
leaves (`still_coming`, called by the gateway's Call as it submits) or the request ends without one.
Invariant: `coming` is the number of such requests between those two points; the count lives in the request's
context, so a Call started in a task of its own (n choices) finds its request's mark.
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar

from starlette.types import ASGIApp, Receive, Scope, Send

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"})


class Arrivals:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.coming = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        mark = _Mark(self)
        token = _mark.set(mark)
        self.coming += 1
        try:
            await self.app(scope, receive, send)
        finally:
            _mark.reset(token)
            mark.submitted()


class _Mark:
    __slots__ = ("arrivals", "counted")

    def __init__(self, arrivals: Arrivals) -> None:
        self.arrivals, self.counted = arrivals, True

    def submitted(self) -> int:
        if self.counted:
            self.counted = False
            self.arrivals.coming -= 1
        return self.arrivals.coming


_mark: ContextVar[_Mark | None] = ContextVar("arrival", default=None)


LOOK_AROUND = 3  # event-loop turns a Submit yields first: a request that came meanwhile is parsed and counted


async def still_coming() -> int:
    """As this request's Submit leaves: it is no longer coming; how many other generation requests still are
    (0 outside a counted request). The event loop turns a few times first (LOOK_AROUND): requests already on their
    sockets get their turn (read, then their app started), and so their count, before this one is submitted."""
    mark = _mark.get()
    if mark is None:
        return 0
    for _ in range(LOOK_AROUND):
        await asyncio.sleep(0)
    return mark.submitted()
