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
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from typing import Any

from protocol.codec import ProtocolError
from protocol.messages import Abort, Submit
from supervisor import errors
from supervisor.config import Settings
from supervisor.effects import Clock, MemoryProbe, Messenger, Spawn
from supervisor.lifecycle import Lifecycle, MetricsT
from supervisor.registry import Registry
from supervisor.tasks import background
from supervisor.workers import State, Stream, Worker

log = logging.getLogger(__name__)


class Lease:
    """A request's claim on a worker, taken when routed and released when its response ends.

    `held`: it counts in `worker.leases`. A suspended request's lease holds nothing; its resume
    moves it to the model's next worker (`take_over`).
    """

    def __init__(self, router: Resumption[Any], worker: Worker) -> None:
        self._router = router
        self.worker = worker
        self.released = False
        self.held = True

    def submit(self, msg: Submit) -> Stream:
        return self._router._submit(self, msg)

    def abort(self, rid: str) -> None:
        self._router._abort(self, rid)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.let_go()

    def let_go(self) -> None:
        """Stop counting in the worker's leases (its request is done there, or suspended)."""
        if self.held:
            self.held = False
            self._router._release(self.worker)

    def take_over(self, other: Lease) -> None:
        """The request moves to `other`'s worker: this lease holds it from now on, `other` is spent."""
        self.let_go()
        self.worker, self.held = other.worker, True
        other.held, other.released = False, True


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


class Resumption(Lifecycle[MetricsT]):
    """The router's layer that submits requests and suspends and resumes them (the Router builds on it)."""

    def __init__(self, registry: Registry, settings: Settings, *, transport: Messenger, spawn: Spawn,
                 memory: MemoryProbe, clock: Clock, metrics: MetricsT) -> None:
        super().__init__(registry, settings, transport=transport, spawn=spawn, memory=memory, clock=clock,
                         metrics=metrics)
        self.suspended: dict[str, Suspension] = {}  # rid -> its suspension

    async def acquire(self, name: str, explicit: bool = False) -> Lease:
        raise NotImplementedError  # the Router's: route to the model's worker, loading it if needed

    # --- submit, abort, release ----------------------------------------------------------

    def _submit(self, lease: Lease, msg: Submit) -> Stream:
        resumable = self.settings.max_resumes > 0  # else neither the Submit nor the token ids are kept
        stream = Stream(msg.rid, msg if resumable else None, lease)
        self._send(lease.worker, stream, msg)
        return stream

    def _send(self, worker: Worker, stream: Stream, msg: Submit) -> None:
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

    def _abort(self, lease: Lease, rid: str) -> None:
        suspension = self.suspended.pop(rid, None)
        if suspension is not None:  # the client left while its request waited for a worker
            self._stop_waiting(suspension)
            log.info("[resume] model=%s rid=%s abandoned after %.2fs suspended: the client is gone",
                     suspension.model_id, rid, self.clock.monotonic() - suspension.since)
            return
        if lease.worker.streams.pop(rid, None) is not None:
            self.transport.send(lease.worker.identity, Abort(rid))

    def _release(self, worker: Worker) -> None:
        worker.leases -= 1
        worker.last_used = self.clock.monotonic()

    # --- suspending ----------------------------------------------------------------------

    def _streams_lost(self, worker: Worker, error: errors.MlxsupError, cause: str | None) -> None:
        if cause is not None:
            self._suspend_resumable(worker, error, cause, fail_others=True)
        super()._streams_lost(worker, error, cause)

    def _begin_evict(self, worker: Worker, mode: str, timeout_s: float | None, reason: str) -> asyncio.Task:
        if reason == "pressure-hard" and worker.evicting is None:
            # the others stay: the worker's abort fails them (model_evicted), as without resumes
            self._suspend_resumable(worker, errors.ModelEvicted(f"the model '{worker.spec.id}' was evicted"),
                                    "pressure", fail_others=False)
        return super()._begin_evict(worker, mode, timeout_s, reason)

    def _why_not_resume(self, model_id: str, stream: Stream) -> str | None:
        """Why a request of a worker that ended cannot resume, or None when it can."""
        limit = self.settings.max_resumes
        submit = stream.submit
        if submit is None or stream.lease is None or limit <= 0:
            return "resumes are off"
        if self.shutting_down:
            return "the server is shutting down"
        if stream.resumes >= limit:
            return f"it was resumed {stream.resumes} time(s) already (max_resumes {limit})"
        record = self.records.get(model_id)
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
        self.records[model_id].suspended += 1
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
                    while self._pressure == "hard":  # a reload now would only be evicted again (soft takes idle ones)
                        await self.clock.sleep(self.settings.housekeeping_s)
                lease = await self.acquire(suspension.model_id)
                break
            except errors.ModelLoadFailed as exc:
                record = self.records.get(suspension.model_id)
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
        self.records[model_id].resumed += 1
        self.metrics.resumes.labels(model_id, "resumed").inc()
        log.info("[resume] model=%s rid=%s resubmitted to pid=%s after %.2fs suspended (%s) tokens=%d resume=%d/%d",
                 model_id, stream.rid, lease.worker.pid, self.clock.monotonic() - suspension.since,
                 suspension.cause, done, stream.resumes, self.settings.max_resumes)
        self._send(lease.worker, stream, msg)

    def _flowing(self, worker: Worker, stream: Stream) -> None:
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
        self.records[model_id].resume_failed += 1
        self.metrics.resumes.labels(model_id, "failed").inc()

    def suspension(self, rid: str) -> Suspension | None:
        """The request's suspension while it waits for a worker (the gateway says so to its client)."""
        return self.suspended.get(rid)

    def _end_suspensions(self, why: str) -> None:
        for suspension in list(self.suspended.values()):
            self._give_up(suspension, why)
