"""One generation request's life in the supervisor: lease, submit, events, close, metrics.

HTTP-agnostic: sse.py decides how events are written. Invariant: close() runs once per Call,
and releases the lease (telling the worker to abort if the request still runs) on every path:
completion, error, client disconnect, shutdown. Metrics are observed there, once per request.
A request whose worker ends under it may be suspended and resumed on the next one
(supervisor/resume.py): its events just pause, and `next_within(keepalive_s)` lets the caller
write something to the client meanwhile. Reading an event starts no task (one keep-alive timer per
Call, moved on lazily), and deltas queued together come out as one (transcript.merged), so a
client gets one write for them. A request with several choices (n, or several prompts) has one
Call each, grouped in `Calls`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import cast

from protocol.messages import Finished, Submit
from supervisor import errors
from supervisor.gateway.arrivals import expect, still_coming
from supervisor.gateway.openai_api import Parsed
from supervisor.gateway.transcript import Delta, merged, span
from supervisor.router import Lease, Router
from supervisor.workers import EventQueue

log = logging.getLogger(__name__)
STATUS_DISCONNECTED = 499  # the client left before the end (nginx's code for it)
_TICK = object()  # a Call's keep-alive timer's wake-up, put in its stream's queue while it waits there


class Call:
    """One choice's generation (a request with n choices, or several prompts, has one Call each)."""

    def __init__(self, router: Router, parsed: Parsed, endpoint: str, submit: Submit | None = None) -> None:
        self.router = router
        self.parsed = parsed
        self.submit = submit or parsed.submit
        self.endpoint = endpoint
        self.lease: Lease | None = None
        self.first: Delta | Finished | None = None
        self.finished: Finished | None = None
        self.outcome = "disconnected"  # until the request ends otherwise
        self.status = STATUS_DISCONNECTED  # the HTTP status this request's outcome maps to
        self.t0 = time.monotonic()
        self.t_first: float | None = None
        self.t_leased: float | None = None  # when it had its worker (a load's end)
        self._queue: asyncio.Queue = asyncio.Queue()  # its stream's events (the stream's own queue once submitted)
        self._held: object | None = None  # an item taken from the queue that did not merge into the last delta
        self._timer: asyncio.TimerHandle | None = None  # the keep-alive timer (while one is set)
        self._deadline = 0.0  # the latest keep-alive wait's end, on the loop's clock
        self._waiting = False  # a keep-alive wait is on: a tick may wake it
        self._closed = False

    @property
    def model_id(self) -> str:
        return self.lease.worker.spec.id if self.lease else self.parsed.model

    async def start(self, lease: Lease | None = None) -> None:
        """Route (unless given its `lease`), submit and wait for the first event: an error up to here is the
        response's status."""
        try:
            if lease is None:
                expect(self.router.registry.resolve(self.parsed.model).id)  # read whole, on its way to this model
                lease = await self.router.acquire(self.parsed.model)
            self.lease = lease
            self.t_leased = time.monotonic()
            # a burst's rest for the same worker, so it waits for them (gateway/arrivals.py)
            self.submit.more = await still_coming(self.lease.worker.spec.id)
            self._queue = self.lease.submit(self.submit).queue
            self.first = await self.next()
        except errors.MlxsupError as exc:
            self.outcome, self.status = exc.code, exc.status
            raise
        self.t_first = time.monotonic()

    async def next(self) -> Delta | Finished:
        item = await self.next_within(None)
        assert item is not None, "with no timeout, an event or an error"
        return item

    def next_queued(self, waker: asyncio.Event) -> Delta | Finished | None:
        """The next event if one is queued already (merged as next_within merges), else None; `waker` is set
        from now on whenever this Call's stream gets an item (Calls.events waits on it for all its choices)."""
        if isinstance(self._queue, EventQueue):
            self._queue.waker = waker
        item, self._held = self._held, None
        if item is None and (item := self._queued()) is None:
            return None
        if isinstance(item, tuple) and not self._queue.empty():
            item = self._coalesce(item)
        return self._took(item)

    def has_queued(self) -> bool:
        return self._held is not None or not self._queue.empty()

    def next_queued_stop(self) -> None:
        """No waker from now on (the request's reading ended)."""
        if isinstance(self._queue, EventQueue):
            self._queue.waker = None

    async def next_within(self, keepalive_s: float | None) -> Delta | Finished | None:
        """The next event, deltas already queued merged into it; None when none came within `keepalive_s`.

        This runs once per token, so it starts no task: it awaits the stream's queue itself, and one
        keep-alive timer per Call, moved on lazily, wakes it (a tick in the queue) when the time is up."""
        item, self._held = self._held, None
        if item is None and (item := self._queued()) is None:
            if keepalive_s is None:
                item = await self._queue.get()  # no tick comes: one is put only while a keep-alive wait is on
            elif (item := await self._wait(keepalive_s)) is _TICK:
                return None
        if isinstance(item, tuple) and not self._queue.empty():
            item = self._coalesce(item)
        return self._took(item)

    def _queued(self) -> object | None:
        """The next item already queued; a tick there is stale (its wait got an event first) and dropped."""
        queue = self._queue
        while not queue.empty():
            item = queue.get_nowait()
            if item is not _TICK:
                return item
        return None

    async def _wait(self, keepalive_s: float) -> object:
        """The next item, or a tick once `keepalive_s` passed: the one timer is set, or moved on when it fires."""
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + keepalive_s
        if self._timer is None or self._timer.when() > self._deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(self._deadline, self._tick, loop)
        self._waiting = True
        try:
            return await self._queue.get()
        finally:
            self._waiting = False

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        """The keep-alive timer: moved on to the latest wait's deadline, or, past it, wakes that wait."""
        assert self._timer is not None
        if self._deadline > self._timer.when():
            self._timer = loop.call_at(self._deadline, self._tick, loop)
            return
        self._timer = None
        if self._waiting:
            self._queue.put_nowait(_TICK)

    def _coalesce(self, delta: Delta) -> Delta:
        """`delta` and the deltas queued behind it as one, as far as they join (transcript.span); the first
        item that does not is held for the next call. One SSE event then carries what several would."""
        reach = span(delta)
        if reach is None:
            return delta  # it joins nothing, and nothing joins it
        run, last = [delta], reach[1]  # `last`: the last part (in ORDER) the run says
        while (item := self._queued()) is not None:
            reach = span(item) if isinstance(item, tuple) else None
            if reach is None or reach[0] < last:
                self._held = item
                break
            run.append(cast(Delta, item))
            last = max(last, reach[1])
        return merged(run) if len(run) > 1 else delta

    def _took(self, item: object) -> Delta | Finished:
        if isinstance(item, errors.MlxsupError):
            self.outcome, self.status = item.code, item.status
            raise item
        if isinstance(item, Finished):
            self.finished = item
            self.outcome, self.status = "completed", 200
            return item
        return cast(Delta, item)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.lease is not None:
            self.lease.abort(self.submit.rid)  # a no-op once the worker has finished it
            self.lease.release()
        self._observe()

    def _observe(self) -> None:
        model = self.model_id if self.model_id in self.router.registry.specs else "unknown"
        m = self.router.metrics
        m.requests.labels(model, self.endpoint, self.outcome).inc()
        if self.t_first is not None:
            m.ttft.labels(model).observe(self.t_first - self.t0)
        fin = self.finished
        if fin is not None:
            m.prompt_tokens.labels(model).inc(fin.prompt_tokens)
            m.completion_tokens.labels(model).inc(fin.completion_tokens)
            m.draft_tokens.labels(model).inc(fin.drafted_tokens)
            m.draft_accepted_tokens.labels(model).inc(fin.accepted_tokens)
            if fin.completion_tokens > 1 and self.t_first is not None:
                m.itl.labels(model).observe((time.monotonic() - self.t_first) / (fin.completion_tokens - 1))
        ttft_ms = f"{(self.t_first - self.t0) * 1000:.0f}" if self.t_first is not None else "-"
        log.info("[request] model=%s endpoint=%s status=%d outcome=%s prompt_tokens=%s completion_tokens=%s "
                 "ttft_ms=%s ms=%.0f", model, self.endpoint, self.status, self.outcome,
                 fin.prompt_tokens if fin else "-", fin.completion_tokens if fin else "-", ttft_ms,
                 (time.monotonic() - self.t0) * 1000)


class Calls:
    """A request's choices (n, or several prompts), one Call each, started together and read as one stream
    of (choice index, event). close() closes them all; an error of any choice is the request's."""

    def __init__(self, router: Router, parsed: Parsed, endpoint: str) -> None:
        self.parsed = parsed
        self.calls = [Call(router, parsed, endpoint, submit) for submit in parsed.choices]

    async def start(self) -> None:
        """Route the choices together (their leases in one turn: no choice waits for a place another holds), then
        start each."""
        if len(self.calls) > 1:
            first = self.calls[0]
            expect(first.router.registry.resolve(self.parsed.model).id)
            try:
                leases = await first.router.acquire_many(self.parsed.model, len(self.calls))
            except errors.MlxsupError as exc:
                first.outcome, first.status = exc.code, exc.status
                raise
            for call, lease in zip(self.calls, leases):  # each Call's now: its close releases it, started or not
                call.lease = lease
        tasks = [asyncio.create_task(c.start(c.lease), name=f"start[{c.submit.rid}]") for c in self.calls]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def events(self, keepalive_s: float | None = None) -> AsyncGenerator[tuple[int, Delta | Finished | None], None]:
        """Every choice's events as they come, each choice's in order, starting with their first ones;
        (-1, None) when none came within `keepalive_s` (a choice suspended for a resume, or just slow)."""
        if len(self.calls) == 1:  # the common case: no task per token
            call = self.calls[0]
            item = call.first
            assert item is not None, "a request is read only after its first event"
            yield 0, item
            while not isinstance(item, Finished):
                if (event := await call.next_within(keepalive_s)) is None:
                    yield -1, None
                    continue
                item = event
                yield 0, item
            return
        for i, call in enumerate(self.calls):
            assert call.first is not None, "a request is read only after every choice's first event"
            yield i, call.first
        live = [i for i, call in enumerate(self.calls) if not isinstance(call.first, Finished)]
        waker = asyncio.Event()  # one waiter for every choice's stream: set by any of their queues, or the timer
        loop = asyncio.get_running_loop()
        timer: asyncio.TimerHandle | None = None
        try:
            while live:
                waker.clear()
                came = False
                for i in list(live):
                    while (item := self.calls[i].next_queued(waker)) is not None:
                        came = True
                        yield i, item
                        if isinstance(item, Finished):
                            live.remove(i)
                            break
                if came or not live:
                    continue
                if keepalive_s is not None:
                    timer = loop.call_later(keepalive_s, waker.set)
                await waker.wait()
                if timer is not None:
                    timer.cancel()
                    timer = None
                    if not any(self.calls[i].has_queued() for i in live):
                        yield -1, None  # nothing within keepalive_s
        finally:
            if timer is not None:
                timer.cancel()
            for call in self.calls:
                call.next_queued_stop()

    def close(self) -> None:
        for call in self.calls:
            call.close()
