"""The router: routing, leases, the message table, and the collaborators it owns and wires together.

The Router owns three collaborators, each in its own file and each calling the others only through
the interfaces in core_api.py (docs/architecture.md draws it):
- the Lifecycle (lifecycle.py): the models' slots (slot.py: each one's worker, record and wait queue), the spare,
  memory; start, watch,
  crash, evict, shut down. It tells its listener, the Resumption, what happens to a worker's requests;
- the Resumption (resume.py): sending requests, and those suspended when their worker ends under
  them and resumed on the next one, through the `acquire` it is given (the Router's);
- Admission (admission.py): may a model with no worker start one now, and what must go first.
The Router itself routes (`acquire`, `ask`), gives out leases (lease.py, calling the Router's
LeaseHost methods), dispatches workers' messages (HANDLERS) and builds the status. Everything runs
on the one asyncio loop, and every effect goes through the interfaces in effects.py, passed to the
constructor (daemon.build_router wires the real ones). Rules that keep it race-free:
- A check-then-act decision never has an `await` in the middle: a worker is picked and its
  lease taken in the same loop turn; a worker is marked `evicting` in the same turn that
  decides to evict it.
- Slow work (spawn, stop) runs as tasks that report back through futures and events.
- Message handlers (`_on_<kind>`, dispatched by HANDLERS) never await.
- A request with a reply (`ask`) waits on a future in its worker's `replies` table: resolved by
  the reply's handler, failed when the worker exits. One mechanism for every such request.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar, Generic, TypeVar

from protocol.messages import (
    WATCH_SUFFIX,
    Abort,
    Bye,
    CacheCleared,
    CacheStats,
    Embedded,
    Failed,
    Finished,
    Heartbeat,
    Message,
    Progress,
    Pulse,
    Ready,
    Reranked,
    Spoken,
    SpokenPart,
    StepStarted,
    Submit,
    Tokenized,
    Tokens,
    Transcribed,
)
from protocol.modelkind import CHAT, VISION
from supervisor import cache_admin, errors
from supervisor.admission import Admission, Busy
from supervisor.config import Settings
from supervisor.effects import Clock, LifecycleMetrics, MemoryProbe, Messenger, Spawn
from supervisor.lease import Lease
from supervisor.lifecycle import Lifecycle
from supervisor.registry import ModelSpec, Registry
from supervisor.reports import EvictReport, LoadProgress, ModelStatus, RecentEviction, SpareStatus, Status
from supervisor.resume import Resumption, Suspension
from supervisor.sampling import applied
from supervisor.slot import ModelSlot, Waiter
from supervisor.workers import Spare, State, Stream, Worker

log = logging.getLogger(__name__)

MetricsT = TypeVar("MetricsT", bound=LifecycleMetrics)  # the gateway's Metrics, which counts requests too

__all__ = ["Lease", "Router"]


class Router(Generic[MetricsT]):
    def __init__(self, registry: Registry, settings: Settings, *, transport: Messenger, spawn: Spawn,
                 memory: MemoryProbe, clock: Clock, metrics: MetricsT) -> None:
        self.registry = registry
        self.settings = settings
        self.transport = transport
        self.memory = memory
        self.clock = clock
        self.metrics = metrics
        self.lifecycle = Lifecycle(registry, settings, transport=transport, spawn=spawn, memory=memory,
                                   clock=clock, metrics=metrics)
        self.resumption = Resumption(settings, host=self.lifecycle, acquire=self._acquire_unbounded,
                                     transport=transport, clock=clock, metrics=metrics)
        self.lifecycle.events = self.resumption
        self.admission = Admission(self.lifecycle, clock)
        self._by_identity = self.lifecycle.by_identity  # the same dict, looked up once per message
        self._arrivals = 0  # requests routed, in all: each one's arrival order (slot.Waiter.seq)
        self._to_load: list[Waiter] = []  # queued requests whose model has no worker: the first decides its load

    def start(self) -> None:
        self.transport.start(self._on_message, self.lifecycle.refused)
        self.lifecycle.boot()

    # --- the lifecycle's state and verbs, as the gateway, the daemon and the tests use them ----

    @property
    def workers(self) -> dict[str, Worker]:
        return self.lifecycle.workers

    @property
    def slots(self) -> dict[str, ModelSlot]:
        return self.lifecycle.slots

    @property
    def spare(self) -> Spare | None:
        return self.lifecycle.spare

    @property
    def spawn(self) -> Spawn:
        return self.lifecycle.spawn

    @spawn.setter
    def spawn(self, spawn: Spawn) -> None:
        self.lifecycle.spawn = spawn

    @property
    def shutting_down(self) -> bool:
        return self.lifecycle.shutting_down

    @property
    def ceiling(self) -> int:
        return self.lifecycle.ceiling

    @property
    def suspended(self) -> dict[str, Suspension]:
        return self.resumption.suspended

    def suspension(self, rid: str) -> Suspension | None:
        """The request's suspension while it waits for a worker (the gateway says so to its client)."""
        return self.resumption.suspension(rid)

    def _estimate(self, spec: ModelSpec) -> int:
        return self.lifecycle.estimate(spec)

    async def evict(self, name: str, mode: str = "drain", timeout_s: float | None = None,
                    reason: str = "api") -> EvictReport:
        """Run the eviction sequence and wait until the process is reaped. Joins one in progress."""
        return await self.lifecycle.evict(name, mode, timeout_s, reason)

    async def shutdown(self) -> list[EvictReport]:
        """Refuse new work, then evict every worker in parallel, draining up to the deadline."""
        return await self.lifecycle.shutdown()

    def kill_all(self, why: str) -> None:
        """The forced exit (a second Ctrl-C): SIGKILL every worker process, the spare too."""
        self.lifecycle.kill_all(why)

    # --- routing -----------------------------------------------------------------------

    async def acquire(self, name: str, explicit: bool = False, queued: bool = True) -> Lease:
        """Route to the model's worker, loading it if needed; the lease is taken in the deciding turn.

        A request that cannot take a lease at once waits in the model's queue (slot.py) in arrival order, for a load,
        for room (busy models to idle, then their eviction), for a place on its worker (`running_limit`); `queued`
        bounds it (`max_queued_requests`: QueueFull at once, `queue_timeout_s`: QueueTimeout), else (an explicit
        load) it waits unbounded. A request waiting on a load holds a lease on the loading worker too, and the ready
        worker is owed to the requests queued for it that go before every other model's waiter (ModelSlot.owed), so
        nothing evicts it between its Ready and their leases, in whatever order the loop wakes them.
        """
        return (await self._acquire(name, 1, explicit, queued))[0]

    async def acquire_many(self, name: str, count: int) -> list[Lease]:
        """`count` leases on the model's worker, taken together in one turn (a request's choices: none of them waits
        for a place another holds, so a request never waits on itself)."""
        return await self._acquire(name, count)

    async def _acquire(self, name: str, count: int, explicit: bool = False, queued: bool = True,
                       seq: int | None = None) -> list[Lease]:
        spec = self.registry.resolve(name)
        slot = self.lifecycle.slot(spec.id)
        if explicit:
            slot.clear()
        if seq is None:
            self._arrivals += 1
            seq = self._arrivals
        worker = slot.worker
        if worker is not None and (self._may_run(slot, worker, seq, None, count)
                                   or explicit and worker.state is State.READY):  # a load: it is loaded already
            return self._lease(worker, count)
        settings = self.settings
        if queued and len(slot.queue) >= settings.max_queued_requests:
            raise self._refused(spec.id, slot, "full", errors.QueueFull(
                f"the model '{spec.id}' has {len(slot.queue)} requests waiting already, as many as it queues "
                "(max_queued_requests); try again later"))
        waiter = Waiter(seq, self.clock.monotonic(), count=count)
        slot.queue.append(waiter)
        try:
            leases = await (self._within_limit(spec, slot, waiter) if queued
                            else self._wait_in_line(spec, slot, waiter))
        finally:
            slot.queue.remove(waiter)
            self._stop_waiting_for(waiter)
            self._loaded_for(waiter)
            self.lifecycle.changes.fire()  # the next in line may go
        waited = self.clock.monotonic() - waiter.since
        slot.waited(waited)
        self.metrics.queue_wait.labels(spec.id).observe(waited)
        return leases

    async def _acquire_unbounded(self, name: str) -> Lease:
        """A lease for a suspended request's resume: first in line (it was admitted before anything waiting now),
        bounded by resume_timeout_s, not the queue's bounds."""
        return (await self._acquire(name, 1, queued=False, seq=0))[0]

    def _may_run(self, slot: ModelSlot, worker: Worker, seq: int, waiter: Waiter | None, count: int) -> bool:
        """Its `count` places fit under the worker's running limit (or it runs alone), and it is its turn."""
        return (worker.state is State.READY
                and (worker.leases + count <= self.settings.running_limit or worker.leases == 0)
                and slot.may_take(seq, waiter))

    def _lease(self, worker: Worker, count: int) -> list[Lease]:
        worker.leases += count
        return [Lease(self, worker) for _ in range(count)]

    async def _within_limit(self, spec: ModelSpec, slot: ModelSlot, waiter: Waiter) -> list[Lease]:
        """_wait_in_line's lease, or QueueTimeout once the request has waited queue_timeout_s (one timer, which
        cancels the wait: no wrapper around each of its awaits)."""
        task = asyncio.current_task()
        assert task is not None
        expired = False

        async def expire() -> None:
            nonlocal expired
            await self.clock.sleep(self.settings.queue_timeout_s)
            expired = True
            task.cancel()

        timer = asyncio.ensure_future(expire())
        try:
            return await self._wait_in_line(spec, slot, waiter)
        except asyncio.CancelledError:
            if not expired or task.uncancel() > 0:  # a cancel from outside too: it wins
                raise
        finally:
            timer.cancel()
        raise self._refused(spec.id, slot, "timeout", errors.QueueTimeout(
            f"the request waited {self.settings.queue_timeout_s:.0f}s (queue_timeout_s) for the model '{spec.id}', "
            f"the last while waiting for {waiter.what}"))

    def _refused(self, model_id: str, slot: ModelSlot, why: str, err: errors.MlxsupError) -> errors.MlxsupError:
        """The queue's refusal `err`, counted, with its Retry-After."""
        slot.refused += 1
        self.metrics.queue_refused.labels(model_id, why).inc()
        err.retry_after_s = slot.retry_after_s()
        return err

    async def _wait_in_line(self, spec: ModelSpec, slot: ModelSlot, waiter: Waiter) -> list[Lease]:
        """The queued request's lease, once it is its turn (see acquire)."""
        changes = self.lifecycle.changes
        while True:
            if self.lifecycle.shutting_down:
                raise errors.ShuttingDown("the server is shutting down")
            worker = slot.worker
            if worker is None:
                if waiter not in self._to_load:
                    self._to_load.append(waiter)
                first = min(self._to_load, key=lambda w: w.seq)
                if first is not waiter:  # loads are decided in arrival order, over all models
                    waiter.what = f"an earlier request's load ({first.what})"
                    await changes.wait()
                    continue
                waiter.what = "room to load"
                started = await self.admission.start(spec, slot)
                if isinstance(started, Busy):  # it fits once they are idle: wait for them (they yield to it)
                    self._wait_for(waiter, started.models)
                    waiter.what = f"{', '.join(started.models)} to finish"
                    await changes.wait()
                    continue
                if started is None:  # it waited (a back-off, evictions): decide again
                    continue
                worker = started
            self._stop_waiting_for(waiter)
            self._loaded_for(waiter)
            if worker.state is State.READY:
                if self._may_run(slot, worker, waiter.seq, waiter, waiter.count):
                    return self._lease(worker, waiter.count)
                waiter.what = "a place on its worker"
                await changes.wait()
            elif worker.state in (State.EVICTING, State.FAILED):  # on its way out: decide again once it is gone
                waiter.what = "its last worker to stop"
                await worker.gone.wait()
            else:
                worker.leases += 1
                waiter.what = "its load"
                try:
                    await asyncio.shield(worker.ready)
                finally:
                    worker.leases -= 1
                    changes.fire()  # a place it held may let a waiter behind it on

    def _loaded_for(self, waiter: Waiter) -> None:
        """The waiter's model has a worker (or it waits no more): the next load in line may be decided."""
        if waiter in self._to_load:
            self._to_load.remove(waiter)
            self.lifecycle.changes.fire()

    def _wait_for(self, waiter: Waiter, models: tuple[str, ...]) -> None:
        """From now on the waiter waits for these models' workers to idle: their later requests wait behind it."""
        slots = [self.lifecycle.slot(m) for m in models]
        self._stop_waiting_for(waiter, keep=slots)
        for slot in slots:
            if waiter not in slot.yield_to:
                slot.yield_to.add(waiter)
                waiter.waits_for.append(slot)

    def _stop_waiting_for(self, waiter: Waiter, keep: list[ModelSlot] | None = None) -> None:
        for slot in [s for s in waiter.waits_for if keep is None or s not in keep]:
            slot.yield_to.discard(waiter)
            waiter.waits_for.remove(slot)
            self.lifecycle.changes.fire()  # its own requests may go on

    # --- leases (lease.LeaseHost) ----------------------------------------------------------

    def submit(self, lease: Lease, msg: Submit) -> Stream:
        resumable = self.settings.max_resumes > 0  # else neither the Submit nor the token ids are kept
        stream = Stream(msg.rid, msg if resumable else None, lease)
        self.resumption.send(lease.worker, stream, msg)
        return stream

    def abort(self, lease: Lease, rid: str) -> None:
        if self.resumption.abandon(rid):  # the client left while its request waited for a worker
            return
        if lease.worker.streams.pop(rid, None) is not None:
            self.transport.send(lease.worker.identity, Abort(rid))

    def lease_ended(self, worker: Worker) -> None:
        worker.leases -= 1
        worker.last_used = self.clock.monotonic()
        self.lifecycle.changes.fire()  # a place on it is free, or it idles: a queued request may go on

    def keep_alive(self, model_id: str, seconds: float) -> bool:
        """An API's keep_alive for the model's current worker (workers.Worker.keep_alive); False: none runs."""
        worker = self.lifecycle.workers.get(model_id)
        if worker is None or worker.state not in (State.LOADING, State.READY):
            return False
        worker.keep_alive = seconds
        return True

    def loading(self, name: str) -> Worker | None:
        """The model's worker while it loads (for progress), else None."""
        worker = self.lifecycle.workers.get(self.registry.resolve(name).id)
        return worker if worker is not None and worker.state is State.LOADING else None

    # --- requests with a reply ---------------------------------------------------------

    async def ask(self, model_id: str, build: Callable[[str], Message], timeout_s: float,
                  silence: bool = False, on_part: Callable[[Message], None] | None = None) -> Message | None:
        """Send `build(rid)` to the model's worker and return its reply; None when no worker runs.

        Waits out a load (the ready worker answers), an eviction and a refused worker's end (each
        wait ends in another state or with the worker gone, so the loop never spins); a worker that exits before
        it answers fails the pending reply, and the model is looked at again. None is returned in
        the turn that found no worker, so a caller that acts on it before its next await acts
        while none can start. Raises WorkerDied if the worker is unreachable, TimeoutError
        after `timeout_s` (on the router's clock): counted from the question's sending, or with `silence` from the
        worker's last Heartbeat since then (work the worker does over many loop turns, an embedding's batches: it
        heartbeats between them, so only a worker gone quiet runs out the limit, however long the work). A question
        left unanswered (timed out, or the caller cancelled: its client gone) is withdrawn with an Abort, so the
        worker stops computing what nobody will read. `on_part` is given each part the worker sends before its
        reply (SpokenPart), in order, from the message handler (it must not await).
        """
        while True:
            worker = self.lifecycle.workers.get(model_id)
            if worker is None:
                return None
            if worker.state in (State.EVICTING, State.FAILED):
                await worker.gone.wait()
                continue
            if worker.state is State.LOADING:  # its load ends in READY, or in FAILED or gone (never stays LOADING)
                try:
                    await asyncio.shield(worker.ready)
                except errors.MlxsupError:
                    pass
                continue
            rid = f"req-{uuid.uuid4().hex[:12]}"
            reply: asyncio.Future = asyncio.get_running_loop().create_future()
            reply.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if we stop waiting
            worker.replies[rid] = reply
            if on_part is not None:
                worker.parts[rid] = on_part
            try:
                sent = self.transport.send(worker.identity, build(rid))
            except BaseException:  # a value the wire cannot carry (ProtocolError): the caller's to answer
                worker.replies.pop(rid, None)
                worker.parts.pop(rid, None)
                raise
            if not sent:
                worker.replies.pop(rid, None)
                worker.parts.pop(rid, None)
                raise errors.WorkerDied(f"the worker of '{model_id}' is not reachable")
            try:
                return await self._reply_within(reply, timeout_s, worker if silence else None)
            except errors.MlxsupError:
                continue  # it exited before it answered (its exit failed the reply): look again
            except BaseException:  # no reply in time, or the asker gone (cancelled): the worker drops the work
                if not reply.done():
                    self.transport.send(worker.identity, Abort(rid))
                raise
            finally:
                worker.replies.pop(rid, None)
                worker.parts.pop(rid, None)

    async def _reply_within(self, reply: asyncio.Future, timeout_s: float, beating: Worker | None = None) -> Message:
        """The reply, or TimeoutError once `timeout_s` passed since the question was sent, or (`beating`) since the
        later of that and the worker's last heartbeat."""
        sent = self.clock.monotonic()
        while True:
            since = max(sent, beating.heartbeat_at or sent) if beating is not None else sent
            left = since + timeout_s - self.clock.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply in {timeout_s:.0f}s" if beating is None else
                                   f"no heartbeat in {timeout_s:.0f}s")
            timer = asyncio.ensure_future(self.clock.sleep(left))
            try:
                await asyncio.wait({reply, timer}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                timer.cancel()
            if reply.done():
                return reply.result()

    async def clear_cache(self, which: str, name: str | None = None) -> dict:
        """Empty one cache tier of one model (`name`) or of all; see supervisor/cache_admin.py."""
        return await cache_admin.clear(self, which, name)

    # --- messages from workers (never await) -------------------------------------------

    def _on_message(self, identity: bytes, msg: Message) -> None:
        worker = self._by_identity.get(identity)  # a spare's identity is here only once it is a model's worker
        if worker is None and identity.endswith(WATCH_SUFFIX) and msg.KIND == Pulse.KIND:  # its watchdog's socket
            worker = self._by_identity.get(identity[:-len(WATCH_SUFFIX)])
        if worker is None:
            if not self.lifecycle.on_spare_message(identity, msg):
                log.warning("[transport] message kind=%s from unknown worker %r", msg.KIND, identity)
            return
        worker.last_seen = self.clock.monotonic()
        handler = self.HANDLERS.get(msg.KIND)
        if handler is None:
            log.warning("[transport] unexpected kind=%s from %r", msg.KIND, identity)
            return
        handler(self, worker, msg)

    def _on_tokens(self, worker: Worker, msg: Tokens) -> None:
        streams = worker.streams
        for chunk in msg.chunks:
            try:
                rid, text, _, ids, *extra = chunk
            except (TypeError, ValueError):
                log.warning("[transport] malformed chunk from %r dropped", worker.identity)
                continue
            stream = streams.get(rid)
            if stream is not None:
                if stream.paused_at is not None:
                    self.resumption.flowing(worker, stream)
                stream.put(text, ids if isinstance(ids, list) else [],
                           extra[0] if extra and isinstance(extra[0], dict) else None)

    def _on_finished(self, worker: Worker, msg: Finished) -> None:
        worker.drafted += msg.drafted_tokens
        worker.accepted += msg.accepted_tokens
        stream = worker.streams.pop(msg.rid, None)
        if stream is not None:
            if stream.paused_at is not None:
                self.resumption.flowing(worker, stream)
            stream.queue.put_nowait(msg)

    def _on_failed(self, worker: Worker, msg: Failed) -> None:
        stream = worker.streams.pop(msg.rid, None)
        if stream is not None:
            stream.fail(errors.from_worker(msg.code, msg.message))

    def _on_reply(self, worker: Worker, msg: CacheCleared | Tokenized | Embedded | Reranked | Transcribed | Spoken
                  ) -> None:
        """A reply (a kind that carries its request's rid, mapped here in HANDLERS): resolves its `ask`."""
        pending = worker.replies.pop(msg.rid, None)
        if pending is not None and not pending.done():
            pending.set_result(msg)

    def _on_part(self, worker: Worker, msg: SpokenPart) -> None:
        """A part of a reply still to come: to its `ask`'s listener."""
        listener = worker.parts.get(msg.rid)
        if listener is not None:
            listener(msg)

    def _on_ready(self, worker: Worker, msg: Ready) -> None:
        self.lifecycle.loaded(worker, msg)

    def _on_progress(self, worker: Worker, msg: Progress) -> None:
        worker.progress = msg
        worker.progressed.set()
        worker.progressed = asyncio.Event()

    def _on_heartbeat(self, worker: Worker, msg: Heartbeat) -> None:
        worker.heartbeat = msg
        worker.heartbeat_at = worker.last_seen

    def _on_step_started(self, worker: Worker, msg: StepStarted) -> None:
        worker.step_started = worker.last_seen
        worker.step_predicted_s = msg.predicted_s

    def _on_pulse(self, worker: Worker, msg: Pulse) -> None:
        """Its loop is in a long turn, computing (worker/watchdog.py): counted as a message of the loop's, so a slow
        step is not a hang; logged once a turn outlasts the hang timeout, then at each further multiple of it."""
        timeout = self.settings.hang_timeout_s
        before = worker.pulse.turn_s if worker.pulse is not None else 0.0
        before = before if before <= msg.turn_s else 0.0  # a new turn
        worker.pulse = msg
        if timeout > 0 and int(msg.turn_s // timeout) > int(before // timeout) and msg.turn_s >= timeout:
            log.info("[slow] model=%s pid=%s one loop turn has run %.0fs, computing (cpu %.1fs in %.0fs) at %s; "
                     "not a hang", worker.spec.id, worker.pid, msg.turn_s, msg.cpu_s, msg.window_s, msg.where)

    def _on_cache_stats(self, worker: Worker, msg: CacheStats) -> None:
        worker.cache = msg

    def _on_bye(self, worker: Worker, msg: Bye) -> None:
        worker.bye = msg

    HANDLERS: ClassVar[dict[str, Callable[[Router[Any], Worker, Any], None]]] = {
        Tokens.KIND: _on_tokens,
        Finished.KIND: _on_finished,
        Failed.KIND: _on_failed,
        Ready.KIND: _on_ready,
        Progress.KIND: _on_progress,
        Heartbeat.KIND: _on_heartbeat,
        StepStarted.KIND: _on_step_started,
        Pulse.KIND: _on_pulse,
        CacheStats.KIND: _on_cache_stats,
        CacheCleared.KIND: _on_reply,
        Tokenized.KIND: _on_reply,
        Embedded.KIND: _on_reply,
        Reranked.KIND: _on_reply,
        Transcribed.KIND: _on_reply,
        Spoken.KIND: _on_reply,
        SpokenPart.KIND: _on_part,
        Bye.KIND: _on_bye,
    }

    # --- status ------------------------------------------------------------------------

    def model_status(self, model_id: str) -> ModelStatus:
        lifecycle = self.lifecycle
        worker = lifecycle.workers.get(model_id)
        record = lifecycle.slots.get(model_id) or ModelSlot()
        spec = self.registry.specs[model_id]
        ttl = lifecycle.ttl(worker) if worker is not None else self.settings.model_ttl(spec)
        pinned = lifecycle.pinned(worker) if worker is not None else spec.pinned
        now = self.clock.monotonic()
        status = ModelStatus(id=model_id, state=State.STOPPED.value, kind=spec.kind, ttl_s=ttl, pinned=pinned,
                             weights_bytes=spec.weights_bytes,
                             restarts=max(0, record.starts - 1), crashes=record.crashes, last_error=record.last_error,
                             stderr_tail=tuple(record.last_stderr), last_eviction=record.last_eviction,
            suspended=sum(1 for s in self.resumption.suspended.values() if s.model_id == model_id),
            resumed=record.resumed, resume_failed=record.resume_failed,
            sampling=applied(spec) if spec.kind in (CHAT, VISION) else None,
            waiting=len(record.queue), oldest_wait_s=round(record.oldest_wait_s(now), 1), queue_refused=record.refused)
        if worker is None:
            if record.failed_until > now:
                return replace(status, state=State.FAILED.value, retry_in_s=round(record.failed_until - now, 1))
            return status
        hb = worker.heartbeat
        idle = now - worker.last_used if worker.leases == 0 and worker.state is State.READY else 0.0
        return replace(
            status, state=worker.state.value, pid=worker.pid,
            memory_bytes=lifecycle.measured(worker), ranks=lifecycle.ranks(worker),
            in_flight=len(worker.streams), leases=worker.leases, idle_s=round(idle, 1),
            ttl_remaining_s=round(max(0.0, ttl - idle), 1) if ttl and not pinned else None,
            queued=hb.waiting if hb else 0, worker_active=hb.active if hb else 0, batch_size=hb.batch_size if hb else 0,
            peak_batch_size=hb.max_batch_size if hb else 0, generated_tokens=hb.generated_tokens if hb else 0,
            context_length=worker.info.context_length if worker.info else None,
            drafted_tokens=worker.drafted, accepted_tokens=worker.accepted,
            drafting=worker.info.drafting if worker.info else "", drafting_priced=hb.priced if hb else False,
            cache=cache_admin.stats_view(worker.cache),
            progress=LoadProgress(worker.progress.stage, worker.progress.fraction)
            if worker.state is State.LOADING else None,
        )

    def status(self) -> Status:
        lifecycle = self.lifecycle
        views = lifecycle.views()
        now = self.clock.monotonic()
        spare = lifecycle.spare
        return Status(
            ceiling_bytes=lifecycle.ceiling,
            used_bytes=sum(v.bytes for v in views),
            system_available_bytes=self.memory.system_available(),
            system_total_bytes=self.memory.system_total(),
            max_loaded_models=self.settings.max_loaded_models,
            spare=SpareStatus(spare.process.pid, spare.standing_by) if spare else None,
            models=[self.model_status(m) for m in self.registry.ids()],
            recent_evictions=[RecentEviction(round(now - ended, 1), report)
                              for ended, report in reversed(lifecycle.recent_evictions)],
            stranded_bytes=lifecycle.stranded.bytes,
        )
