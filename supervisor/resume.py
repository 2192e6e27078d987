"""Requests that outlive their worker: suspended when it ends under them, resumed on the model's next one.

When a worker ends for a reason its clients did not ask for (a crash, a hang kill, a hard-pressure
eviction), each of its requests that may resume is **suspended** instead of failed: its stream
(workers.Stream) stays with the gateway, which keeps the client's connection alive; its lease lets
go of the dead worker; and a task acquires the model again like any request for a cold model
(back-off, admission and memory pressure included: a request suspended by hard pressure waits
until the pressure is no longer hard) and resubmits it as a continuation: the Submit as the client sent it, with
the ids of every token whose text the client has as `resume_tokens`, and `max_tokens` reduced by
them. The worker replays its text stream through those ids, so the text continues where it
stopped, nothing repeated and nothing lost; a greedy request's text is that of an uninterrupted run.

Bounds, so a resume never becomes a loop; each ends the request with the error it would have had:
- at most `max_resumes` resumes per request (0: requests are never suspended);
- each suspension ends within `resume_timeout_s`;
- a model marked failed (the crash-loop rule, a failed load) fails its suspended requests;
- an explicit evict, the client's disconnect and the daemon's shutdown end requests at once, as
  always: only a crash, a hang kill and a hard-pressure eviction suspend.

Invariants: a request is in exactly one place, a worker's `streams` or `suspended` (or done); a
resumed request is resubmitted in the turn its new lease is taken (no await in between), so no
worker can end unseen in between; a Lease counts in at most one worker's `leases`.

A collaborator the Router (router.py) owns: it owns the suspended requests and sends requests to
workers (`send`). It hears of a worker's end as the lifecycle's listener (core_api.LifecycleEvents),
reads the lifecycle only through core_api.ResumeHost, and gets a new lease through the `acquire`
it is given (the Router's); it imports none of the other collaborators.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from protocol.codec import ProtocolError
from protocol.messages import Submit
from supervisor import errors
from supervisor.config import Settings
from supervisor.core_api import ResumeHost
from supervisor.effects import Clock, LifecycleMetrics, Messenger
from supervisor.lease import Lease
from supervisor.tasks import background
from supervisor.workers import State, Stream, Worker

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Suspension:
    stream: Stream
    left: Worker  # the worker it was taken from (the next is not acquired before this one is gone)
    model_id: str
    cause: str  # crash | hang | pressure
    error: errors.MlxsupError  # what the client gets if the request cannot resume
    since: float  # the router's clock
    task: asyncio.Task | None = None  # the resume
    deadline: asyncio.Task | None = None


Acquire = Callable[[str], Awaitable[Lease]]  # a model's id -> a lease on its ready worker (Router.acquire)


class Resumption:
    """Sends requests to workers, and suspends and resumes them when a worker ends under them."""

    def __init__(self, settings: Settings, *, host: ResumeHost, acquire: Acquire, transport: Messenger,
                 clock: Clock, metrics: LifecycleMetrics) -> None:
        self.settings = settings
        self.host = host
        self.acquire = acquire
        self.transport = transport
        self.clock = clock
        self.metrics = metrics
        self.suspended: dict[str, Suspension] = {}  # rid -> its suspension

    # --- sending ---------------------------------------------------------------------------

    def send(self, worker: Worker, stream: Stream, msg: Submit) -> None:
        """Send the request to the worker, its stream registered there; a worker already on its way out
        fails it, and one found unreachable suspends it (when it may resume)."""
        if worker.state is not State.READY:
            stream.fail(errors.ModelEvicted(f"the model '{worker.spec.id}' is being evicted"))
            return
        worker.streams[msg.rid] = stream
        try:
            sent = self.transport.send(worker.identity, msg)
        except ProtocolError as exc:  # a value the wire cannot carry: the request's fault, not the worker's
            del worker.streams[msg.rid]
            stream.fail(errors.InvalidRequest(f"the request cannot be sent to the worker: {exc}"))
            return
        if not sent:
            del worker.streams[msg.rid]
            error = errors.WorkerDied(f"the worker of '{worker.spec.id}' is not reachable")
            if self._why_not_resume(worker.spec.id, stream) is None:  # it is on its way out: wait for the next
                self._suspend(worker, stream, error, "crash")
            else:
                stream.fail(error)

    def abandon(self, rid: str) -> bool:
        """The client left: a suspended request stops waiting for a worker (True), else nothing is done here."""
        suspension = self.suspended.pop(rid, None)
        if suspension is None:
            return False
        self._stop_waiting(suspension)
        log.info("[resume] model=%s rid=%s abandoned after %.2fs suspended: the client is gone",
                 suspension.model_id, rid, self.clock.monotonic() - suspension.since)
        return True

    # --- the lifecycle's events (core_api.LifecycleEvents) ----------------------------------

    def streams_lost(self, worker: Worker, error: errors.MlxsupError, cause: str | None) -> None:
        """A crash or a hang kill suspends what may resume and fails the rest; an eviction leaves them all."""
        if cause is not None:
            self._suspend_resumable(worker, error, cause, fail_others=True)

    def evicting(self, worker: Worker, reason: str) -> None:
        if reason == "pressure-hard":
            # the others stay: the worker's abort fails them (model_evicted), as without resumes
            self._suspend_resumable(worker, errors.ModelEvicted(f"the model '{worker.spec.id}' was evicted"),
                                    "pressure", fail_others=False)

    def shutting_down(self, why: str) -> None:
        """Fail every suspended request now."""
        for suspension in list(self.suspended.values()):
            self._give_up(suspension, why)

    # --- suspending ----------------------------------------------------------------------

    def _why_not_resume(self, model_id: str, stream: Stream) -> str | None:
        """Why a request of a worker that ended cannot resume, or None when it can."""
        limit = self.settings.max_resumes
        submit = stream.submit
        if submit is None or stream.lease is None or limit <= 0:
            return "resumes are off"
        if self.host.shutting_down:
            return "the server is shutting down"
        if stream.resumes >= limit:
            return f"it was resumed {stream.resumes} time(s) already (max_resumes {limit})"
        record = self.host.slots.get(model_id)
        if record is not None and record.failed_until > self.clock.monotonic():
            return "the model is marked failed"
        if submit.max_tokens and len(stream.token_ids) >= submit.max_tokens:
            return "nothing is left to generate"
        return None

    def _suspend_resumable(self, worker: Worker, error: errors.MlxsupError, cause: str, fail_others: bool) -> None:
        """Suspend each of the worker's requests that may resume; with `fail_others`, fail the rest now."""
        for rid, stream in list(worker.streams.items()):
            why_not = self._why_not_resume(worker.spec.id, stream)
            if why_not is None:
                del worker.streams[rid]
                self._suspend(worker, stream, error, cause)
            elif why_not != "resumes are off":
                log.error("[resume] model=%s rid=%s not suspended (%s): %s", worker.spec.id, rid, cause, why_not)
                self._count_failure(worker.spec.id)
                if fail_others:
                    del worker.streams[rid]
                    stream.fail(type(error)(f"{error.message}; not resumed: {why_not}"))

    def _suspend(self, worker: Worker, stream: Stream, error: errors.MlxsupError, cause: str) -> None:
        now = self.clock.monotonic()
        model_id = worker.spec.id
        stream.lease.let_go()
        stream.paused_at = now
        suspension = Suspension(stream, worker, model_id, cause, error, now)
        self.suspended[stream.rid] = suspension
        self.host.slots[model_id].suspended += 1
        self.metrics.suspensions.labels(model_id, cause).inc()
        log.warning("[resume] model=%s rid=%s suspended why=%s pid=%s tokens=%d resumes=%d/%d",
                    model_id, stream.rid, cause, worker.pid, len(stream.token_ids), stream.resumes,
                    self.settings.max_resumes)
        suspension.task = background(self._resume(suspension), name=f"resume[{stream.rid}]")
        suspension.deadline = background(self._expire(suspension), name=f"resume-deadline[{stream.rid}]")

    # --- resuming ------------------------------------------------------------------------

    async def _resume(self, suspension: Suspension) -> None:
        """Wait for the model like any request for a cold one, then resubmit in the turn the lease is taken."""
        await suspension.left.gone.wait()  # a worker found unreachable may not be reaped yet
        while True:
            try:
                if suspension.cause == "pressure":
                    while self.host.pressure == "hard":  # a reload now would only be evicted again (soft takes idle ones)
                        await self.clock.sleep(self.settings.housekeeping_s)
                lease = await self.acquire(suspension.model_id)
                break
            except errors.ModelLoadFailed as exc:
                record = self.host.slots.get(suspension.model_id)
                if record is not None and record.failed_until <= self.clock.monotonic():  # one crash while loading
                    log.warning("[resume] model=%s rid=%s its next worker failed to load (%s); trying again",
                                suspension.model_id, suspension.stream.rid, exc.message)
                    continue
                self._give_up(suspension, f"the model could not be had again: {exc.message}")
                return
            except errors.MlxsupError as exc:  # shutting down, no memory
                self._give_up(suspension, f"the model could not be had again: {exc.message}")
                return
        if self.suspended.get(suspension.stream.rid) is not suspension:  # ended meanwhile
            lease.release()
            return
        self._continue(suspension, lease)

    def _continue(self, suspension: Suspension, lease: Lease) -> None:
        stream, submit = suspension.stream, suspension.stream.submit
        assert submit is not None and stream.lease is not None
        del self.suspended[stream.rid]
        self._stop_waiting(suspension)
        stream.lease.take_over(lease)
        stream.resumes += 1
        done = len(stream.token_ids)
        msg = replace(submit, max_tokens=submit.max_tokens - done if submit.max_tokens else 0,
                      resume_tokens=list(stream.token_ids))
        model_id = suspension.model_id
        self.host.slots[model_id].resumed += 1
        self.metrics.resumes.labels(model_id, "resumed").inc()
        log.info("[resume] model=%s rid=%s resubmitted to pid=%s after %.2fs suspended (%s) tokens=%d resume=%d/%d",
                 model_id, stream.rid, lease.worker.pid, self.clock.monotonic() - suspension.since,
                 suspension.cause, done, stream.resumes, self.settings.max_resumes)
        self.send(lease.worker, stream, msg)

    def flowing(self, worker: Worker, stream: Stream) -> None:
        """A resumed request's first event: the pause its client saw ends here (logged and measured)."""
        if stream.paused_at is None or stream.rid in self.suspended:
            return
        pause = self.clock.monotonic() - stream.paused_at
        stream.paused_at = None
        self.metrics.resume_pause.labels(worker.spec.id).observe(pause)
        log.info("[resume] model=%s rid=%s flowing again on pid=%s: paused %.2fs", worker.spec.id, stream.rid,
                 worker.pid, pause)

    async def _expire(self, suspension: Suspension) -> None:
        timeout = self.settings.resume_timeout_s
        await self.clock.sleep(timeout)
        self._give_up(suspension, f"no worker took it within {timeout:.0f}s (resume_timeout_s)")

    def _give_up(self, suspension: Suspension, why: str) -> None:
        stream = suspension.stream
        if self.suspended.get(stream.rid) is not suspension:
            return
        del self.suspended[stream.rid]
        self._stop_waiting(suspension)
        self._count_failure(suspension.model_id)
        log.error("[resume] model=%s rid=%s failed after %.2fs suspended (%s): %s", suspension.model_id, stream.rid,
                  self.clock.monotonic() - suspension.since, suspension.cause, why)
        error = suspension.error
        stream.fail(type(error)(f"{error.message}; not resumed: {why}"))

    def _stop_waiting(self, suspension: Suspension) -> None:
        current = asyncio.current_task()
        for task in (suspension.task, suspension.deadline):
            if task is not None and task is not current:
                task.cancel()

    def _count_failure(self, model_id: str) -> None:
        self.host.slots[model_id].resume_failed += 1
        self.metrics.resumes.labels(model_id, "failed").inc()

    def suspension(self, rid: str) -> Suspension | None:
        """The request's suspension while it waits for a worker (the gateway says so to its client)."""
        return self.suspended.get(rid)

