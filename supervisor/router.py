"""The router: the single owner of the supervisor's state (workers, leases, request streams).

Routing, messages from workers, requests with a reply, and status live here; submitting, leases,
and requests suspended when their worker ends and resumed on the next one in its base (resume.py);
starting, watching and stopping workers, and the state itself, in that one's base (lifecycle.py). Everything runs
on the one asyncio loop, and every effect goes through the interfaces in effects.py, passed to
the constructor (daemon.build_router wires the real ones). Rules that keep it race-free:
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
from typing import Any, ClassVar

from protocol.messages import (
    Bye,
    CacheCleared,
    CacheStats,
    Failed,
    Finished,
    Heartbeat,
    Message,
    Progress,
    Ready,
    Standby,
    StepStarted,
    Tokens,
)
from supervisor import cache_admin, errors, policy
from supervisor.lifecycle import MetricsT
from supervisor.registry import ModelSpec
from supervisor.reports import LoadProgress, ModelStatus, RecentEviction, SpareStatus, Status
from supervisor.resume import Lease, Resumption
from supervisor.tasks import background
from supervisor.workers import ModelRecord, State, Worker

log = logging.getLogger(__name__)


class Router(Resumption[MetricsT]):
    def start(self) -> None:
        self.transport.start(self._on_message, self._on_refused)
        for spec in self.registry.specs.values():
            if spec.pinned:
                self._start(spec)
        self._replenish_spare()
        self._housekeeping = background(self._keep_house(), name="housekeeping")

    # --- routing -----------------------------------------------------------------------

    async def acquire(self, name: str, explicit: bool = False) -> Lease:
        """Route to the model's worker, loading it if needed; the lease is taken in the deciding turn.

        A request waiting on a load holds a lease on the loading worker too, so nothing
        evicts it between its Ready and the request's submit.
        """
        spec = self.registry.resolve(name)
        record = self.records.setdefault(spec.id, ModelRecord())
        if explicit:
            record.clear()
        while True:
            if self.shutting_down:
                raise errors.ShuttingDown("the server is shutting down")
            worker = self.workers.get(spec.id)
            if worker is None:
                now = self.clock.monotonic()
                if record.failed_until > now:
                    raise errors.ModelLoadFailed(
                        f"the model '{spec.id}' is marked failed ({record.last_error}); it is tried again in "
                        f"{record.failed_until - now:.0f}s, or now with an explicit load")
                if record.backoff_until > now:
                    await self.clock.sleep(record.backoff_until - now)
                    continue
                decision = policy.admit(self._estimate(spec), self._views(), self.ceiling,
                                        self.settings.max_loaded_models)
                if decision.refused:
                    raise self._insufficient(spec, decision)
                if decision.evict or decision.wait:
                    for victim in decision.evict:
                        self._begin_evict(self.workers[victim], "drain", None, "admission")
                    await self._evictions_done()
                    continue
                worker = self._start(spec)
            if worker.state is State.READY:
                worker.leases += 1
                return Lease(self, worker)
            if worker.state in (State.EVICTING, State.FAILED):  # on its way out: decide again once it is gone
                await worker.gone.wait()
                continue
            worker.leases += 1
            try:
                await asyncio.shield(worker.ready)
            finally:
                worker.leases -= 1

    async def _evictions_done(self) -> None:
        """Wait until every worker on its way out (evicting, or refused: policy.LEAVING) is gone."""
        await asyncio.gather(*(w.gone.wait() for w in list(self.workers.values())
                               if w.state in (State.EVICTING, State.FAILED)))

    def _insufficient(self, spec: ModelSpec, decision: policy.Admission) -> errors.InsufficientMemory:
        views = self._views()
        loaded = ", ".join(f"{v.id} ({v.state}{', busy' if v.busy else ''}{', pinned' if v.pinned else ''}, "
                           f"{v.bytes / 2**20:.0f} MiB)" for v in views) or "nothing"
        if decision.too_many:
            why = f"the limit of {self.settings.max_loaded_models} loaded models is reached and none is idle"
        else:
            why = f"{decision.missing_bytes / 2**20:.0f} MiB are missing"
        err = errors.InsufficientMemory(
            f"cannot load '{spec.id}' (needs about {self._estimate(spec) / 2**20:.0f} MiB, ceiling "
            f"{self.ceiling / 2**20:.0f} MiB): {why}. Loaded: {loaded}.")
        err.extra = {"missing_bytes": decision.missing_bytes, "loaded": [v.__dict__ for v in views]}
        return err

    def loading(self, name: str) -> Worker | None:
        """The model's worker while it loads (for progress), else None."""
        worker = self.workers.get(self.registry.resolve(name).id)
        return worker if worker is not None and worker.state is State.LOADING else None

    # --- requests with a reply ---------------------------------------------------------

    async def ask(self, model_id: str, build: Callable[[str], Message], timeout_s: float) -> Message | None:
        """Send `build(rid)` to the model's worker and return its reply; None when no worker runs.

        Waits out a load (the ready worker answers), an eviction and a refused worker's end (each
        wait ends in another state or with the worker gone, so the loop never spins); a worker that exits before
        it answers fails the pending reply, and the model is looked at again. None is returned in
        the turn that found no worker, so a caller that acts on it before its next await acts
        while none can start. Raises WorkerDied if the worker is unreachable, TimeoutError
        after `timeout_s` (on the router's clock).
        """
        while True:
            worker = self.workers.get(model_id)
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
            if not self.transport.send(worker.identity, build(rid)):
                worker.replies.pop(rid, None)
                raise errors.WorkerDied(f"the worker of '{model_id}' is not reachable")
            try:
                return await self._reply_within(reply, timeout_s)
            except errors.MlxsupError:
                continue  # it exited before it answered (its exit failed the reply): look again
            finally:
                worker.replies.pop(rid, None)

    async def _reply_within(self, reply: asyncio.Future, timeout_s: float) -> Message:
        timer = asyncio.ensure_future(self.clock.sleep(timeout_s))
        try:
            await asyncio.wait({reply, timer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()
        if not reply.done():
            raise TimeoutError(f"no reply in {timeout_s:.0f}s")
        return reply.result()

    async def clear_cache(self, which: str, name: str | None = None) -> dict:
        """Empty one cache tier of one model (`name`) or of all; see supervisor/cache_admin.py."""
        return await cache_admin.clear(self, which, name)

    # --- messages from workers (never await) -------------------------------------------

    def _on_message(self, identity: bytes, msg: Message) -> None:
        if self.spare is not None and identity == self.spare.identity:
            self.spare.standing_by = isinstance(msg, Standby) or self.spare.standing_by
            return
        worker = self._by_identity.get(identity)
        if worker is None:
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
                    self._flowing(worker, stream)
                stream.put(text, ids if isinstance(ids, list) else [],
                           extra[0] if extra and isinstance(extra[0], dict) else None)

    def _on_finished(self, worker: Worker, msg: Finished) -> None:
        stream = worker.streams.pop(msg.rid, None)
        if stream is not None:
            if stream.paused_at is not None:
                self._flowing(worker, stream)
            stream.queue.put_nowait(msg)

    def _on_failed(self, worker: Worker, msg: Failed) -> None:
        stream = worker.streams.pop(msg.rid, None)
        if stream is not None:
            stream.fail(errors.from_worker(msg.code, msg.message))

    def _on_reply(self, worker: Worker, msg: CacheCleared) -> None:
        """A reply (a kind that carries its request's rid, mapped here in HANDLERS): resolves its `ask`."""
        pending = worker.replies.pop(msg.rid, None)
        if pending is not None and not pending.done():
            pending.set_result(msg)

    def _on_ready(self, worker: Worker, msg: Ready) -> None:
        worker.info = msg
        if worker.state is State.LOADING:
            worker.move(State.READY)
            worker.last_used = self.clock.monotonic()
            log.info("[load] model=%s pid=%d ready in %.2fs", worker.spec.id, msg.pid, msg.load_s)
            self.metrics.loads.labels(worker.spec.id, "ok").inc()
            self.metrics.load_seconds.labels(worker.spec.id).observe(self.clock.monotonic() - worker.started_at)
            worker.progressed.set()
        if not worker.ready.done():
            worker.ready.set_result(msg)

    def _on_progress(self, worker: Worker, msg: Progress) -> None:
        worker.progress = msg
        worker.progressed.set()
        worker.progressed = asyncio.Event()

    def _on_heartbeat(self, worker: Worker, msg: Heartbeat) -> None:
        worker.heartbeat = msg

    def _on_step_started(self, worker: Worker, msg: StepStarted) -> None:
        worker.step_started = worker.last_seen
        worker.step_predicted_s = msg.predicted_s

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
        CacheStats.KIND: _on_cache_stats,
        CacheCleared.KIND: _on_reply,
        Bye.KIND: _on_bye,
    }

    def _on_refused(self, identity: bytes, reason: str) -> None:
        """A worker of another protocol version: it fails in this very turn (every wait on it ends and none
        starts) and is killed; its exit then marks the model failed, since its next worker would be refused too."""
        worker = self._by_identity.get(identity)
        log.error("[protocol] refused worker %r: %s", identity, reason)
        if worker is None or worker.state is State.FAILED:  # one of its later frames: refused already
            return
        why = f"protocol mismatch: {reason}"
        self.records[worker.spec.id].last_error = why
        if worker.state is not State.EVICTING:  # an evicting one ends as evicted
            worker.move(State.FAILED)
        if not worker.ready.done():
            worker.ready.set_exception(errors.ModelLoadFailed(f"the worker was refused: {reason}"))
        for pending in worker.replies.values():
            if not pending.done():
                pending.set_exception(errors.WorkerDied(f"the worker of '{worker.spec.id}' was refused: {reason}"))
        worker.replies.clear()
        self._kill(worker, why)

    # --- status ------------------------------------------------------------------------

    def model_status(self, model_id: str) -> ModelStatus:
        worker = self.workers.get(model_id)
        record = self.records.get(model_id, ModelRecord())
        spec = self.registry.specs[model_id]
        ttl = self.settings.model_ttl(spec)
        now = self.clock.monotonic()
        status = ModelStatus(id=model_id, state=State.STOPPED.value, ttl_s=ttl, pinned=spec.pinned,
                             weights_bytes=spec.weights_bytes,
                             restarts=max(0, record.starts - 1), crashes=record.crashes, last_error=record.last_error,
                             stderr_tail=tuple(record.last_stderr), last_eviction=record.last_eviction,
            suspended=sum(1 for s in self.suspended.values() if s.model_id == model_id),
            resumed=record.resumed, resume_failed=record.resume_failed)
        if worker is None:
            if record.failed_until > now:
                return replace(status, state=State.FAILED.value, retry_in_s=round(record.failed_until - now, 1))
            return status
        hb = worker.heartbeat
        idle = now - worker.last_used if worker.leases == 0 and worker.state is State.READY else 0.0
        return replace(
            status, state=worker.state.value, pid=worker.pid,
            memory_bytes=self._measured(worker), ranks=self._ranks(worker),
            in_flight=len(worker.streams), leases=worker.leases, idle_s=round(idle, 1),
            ttl_remaining_s=round(max(0.0, ttl - idle), 1) if ttl and not spec.pinned else None,
            queued=hb.waiting if hb else 0, worker_active=hb.active if hb else 0, batch_size=hb.batch_size if hb else 0,
            peak_batch_size=hb.max_batch_size if hb else 0, generated_tokens=hb.generated_tokens if hb else 0,
            context_length=worker.info.context_length if worker.info else None,
            cache=cache_admin.stats_view(worker.cache),
            progress=LoadProgress(worker.progress.stage, worker.progress.fraction)
            if worker.state is State.LOADING else None,
        )

    def status(self) -> Status:
        views = self._views()
        now = self.clock.monotonic()
        return Status(
            ceiling_bytes=self.ceiling,
            used_bytes=sum(v.bytes for v in views),
            system_available_bytes=self.memory.system_available(),
            system_total_bytes=self.memory.system_total(),
            max_loaded_models=self.settings.max_loaded_models,
            spare=SpareStatus(self.spare.process.pid, self.spare.standing_by) if self.spare else None,
            models=[self.model_status(m) for m in self.registry.ids()],
            recent_evictions=[RecentEviction(round(now - ended, 1), report)
                              for ended, report in reversed(self.recent_evictions)],
        )
