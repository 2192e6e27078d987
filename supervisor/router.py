"""The router: the single owner of the supervisor's state (workers, leases, request streams).

Everything here runs on the one asyncio loop. Rules that keep it race-free:
- A check-then-act decision never has an `await` in the middle: a worker is picked and its
  lease taken in the same loop turn; a worker is marked `evicting` in the same turn that
  decides to evict it.
- Slow work (spawn, stop) runs as tasks that report back through futures and events.
- Message handlers (`_on_<kind>`) never await.
- A worker's route and accounting are dropped only after its process has been reaped.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from pathlib import Path

from protocol.messages import (
    EXIT_LOAD_FAILED, Abort, Bye, CacheCleared, CacheStats, Evict, Failed, Finished, Heartbeat, Load, Message,
    Progress, Ready, Standby, Submit, Tokens,
)
from supervisor import cache_admin, errors, policy
from supervisor.config import Settings
from supervisor.memory import footprint, system_available, system_total
from supervisor.gateway.metrics import Metrics
from supervisor.process import WorkerProcess, exit_meaning, model_args, worker_argv
from supervisor.registry import ModelSpec, Registry
from supervisor.transport import Transport
from supervisor.workers import Lease, ModelRecord, Spare, State, Stream, Worker

__all__ = ["Lease", "ModelRecord", "Router", "Spare", "State", "Stream", "Worker"]

log = logging.getLogger(__name__)


class Router:
    def __init__(self, registry: Registry, settings: Settings, runtime_dir: Path) -> None:
        self.registry = registry
        self.settings = settings
        self.runtime_dir = runtime_dir
        self.transport = Transport(runtime_dir, self._on_message, self._on_refused)
        self.workers: dict[str, Worker] = {}
        self.records: dict[str, ModelRecord] = {}
        self._by_identity: dict[bytes, Worker] = {}
        self._spawned = 0
        self._housekeeping: asyncio.Task | None = None
        self.spare: Spare | None = None
        self._pressure: str | None = None
        self.shutting_down = False
        self.metrics = Metrics()
        self.metrics.watch(self.status)

    def start(self) -> None:
        self.transport.start()
        for spec in self.registry.specs.values():
            if spec.pinned:
                self._start(spec)
        self._replenish_spare()
        self._housekeeping = asyncio.create_task(self._keep_house(), name="housekeeping")

    # --- TTL and memory pressure -------------------------------------------------------

    async def _keep_house(self) -> None:
        while True:
            await asyncio.sleep(self.settings.housekeeping_s)
            try:
                self._housekeep()
            except Exception:
                log.exception("[housekeeping] failed; going on")

    def _housekeep(self) -> None:
        s = self.settings
        level = policy.pressure_level(system_available(), system_total(), s.pressure_soft, s.pressure_hard)
        self._pressure = level
        if level is not None and self.spare is not None:  # the spare is pure overhead: it goes first
            asyncio.create_task(self._stop_spare(), name="stop[spare]")
        if not self.workers:
            return
        self._watch_liveness(time.monotonic())
        views = self._views()
        ttls = {w.spec.id: s.model_ttl(w.spec) for w in self.workers.values()}
        for model_id in policy.ttl_expired(views, ttls, time.monotonic()):
            self._begin_evict(self.workers[model_id], "drain", None, "ttl")
        victim = policy.pressure_victim(self._views(), level)
        if victim is not None:
            model_id, busy = victim
            self._begin_evict(self.workers[model_id], "now" if busy else "drain", None, f"pressure-{level}")

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
                now = time.monotonic()
                if record.failed_until > now:
                    raise errors.ModelLoadFailed(
                        f"the model '{spec.id}' is marked failed ({record.last_error}); it is tried again in "
                        f"{record.failed_until - now:.0f}s, or now with an explicit load")
                if record.backoff_until > now:
                    await asyncio.sleep(record.backoff_until - now)
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
            if worker.state is State.EVICTING:
                await worker.gone.wait()
                continue
            worker.leases += 1
            try:
                await asyncio.shield(worker.ready)
            finally:
                worker.leases -= 1

    async def _evictions_done(self) -> None:
        await asyncio.gather(*(w.gone.wait() for w in list(self.workers.values()) if w.state is State.EVICTING))

    @property
    def ceiling(self) -> int:
        return self.settings.ceiling(system_total())

    def _estimate(self, spec: ModelSpec) -> int:
        return spec.weights_bytes + self.settings.worker_overhead_bytes

    def _bytes(self, worker: Worker) -> int:
        measured = footprint(worker.pid) if worker.pid else None
        if worker.state is State.LOADING:
            return max(measured or 0, self._estimate(worker.spec))
        return measured if measured is not None else self._estimate(worker.spec)

    def _views(self) -> list[policy.WorkerView]:
        return [policy.WorkerView(w.spec.id, w.state.value, self._bytes(w), w.leases > 0, w.spec.pinned, w.last_used)
                for w in self.workers.values()]

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

    def _submit(self, worker: Worker, msg: Submit) -> Stream:
        stream = Stream(msg.rid)
        if worker.state is not State.READY:
            stream.fail(errors.ModelEvicted(f"the model '{worker.spec.id}' is being evicted"))
            return stream
        worker.streams[msg.rid] = stream
        if not self.transport.send(worker.identity, msg):
            del worker.streams[msg.rid]
            stream.fail(errors.WorkerDied(f"the worker of '{worker.spec.id}' is not reachable"))
        return stream

    def _abort(self, worker: Worker, rid: str) -> None:
        if worker.streams.pop(rid, None) is not None:
            self.transport.send(worker.identity, Abort(rid))

    # --- worker lifecycle --------------------------------------------------------------

    def _start(self, spec: ModelSpec) -> Worker:
        """A worker for `spec`: the spare on standby if there is one (its imports are paid), else a new process."""
        st = self.settings
        args = model_args(spec.path, spec.id, st.max_batch_size, st.prefill_step_size, spec.worker_args,
                          tuple(st.model_cache(spec).worker_args(st.state_dir)))
        log_path = st.worker_log(spec.id)
        spare = self.spare if self.spare is not None and self.spare.standing_by else None
        if spare is not None:
            self.spare = None
            identity, process = spare.identity, spare.process
            process.assign(spec.id, log_path)
        else:
            self._spawned += 1
            identity = f"{spec.id}#{self._spawned}".encode()
            argv = worker_argv(self.transport.endpoint, identity.decode(), st.heartbeat_s, args)
            process = WorkerProcess(spec.id, argv, log_path, pid_dir=self.runtime_dir)
        worker = Worker(spec, identity, asyncio.get_running_loop().create_future(), process=process)
        worker.ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved by design
        self.workers[spec.id] = worker
        self._by_identity[identity] = worker
        self.records.setdefault(spec.id, ModelRecord()).starts += 1
        if spare is not None:
            log.info("[load] model=%s on the spare pid=%s", spec.id, process.pid)
            self.transport.send(identity, Load(args=args))
        self._replenish_spare()  # at most one spawn per load: a spare that keeps dying cannot loop
        asyncio.create_task(self._run(worker), name=f"run[{spec.id}]")
        return worker

    async def _run(self, worker: Worker) -> None:
        assert worker.process is not None
        if worker.process.proc is None:
            try:
                await worker.process.start()
            except OSError as exc:
                self._on_exited(worker, f"could not start the worker: {exc}")
                return
        await worker.process.exited.wait()
        self._on_exited(worker)

    def _replenish_spare(self) -> None:
        if self.spare is not None or not self.settings.spare_workers or self.shutting_down or self._pressure:
            return
        self._spawned += 1
        identity = f"spare#{self._spawned}".encode()
        argv = worker_argv(self.transport.endpoint, identity.decode(), self.settings.heartbeat_s, ["--spare"])
        spare = Spare(identity, WorkerProcess("spare", argv, self.settings.worker_log("spare"), pid_dir=self.runtime_dir))
        self.spare = spare
        asyncio.create_task(self._run_spare(spare), name="run[spare]")

    async def _run_spare(self, spare: Spare) -> None:
        try:
            await spare.process.start()
        except OSError as exc:
            log.error("[spare] could not start: %s", exc)
        await spare.process.exited.wait()
        if self.spare is spare:  # it died on standby; the next load spawns a fresh worker and a new spare
            self.spare = None
            log.warning("[spare] exited on standby with code %s", spare.process.returncode)

    async def _stop_spare(self) -> None:
        spare, self.spare = self.spare, None
        if spare is not None:
            await spare.process.stop(0.0, self.settings.kill_timeout_s)  # SIGTERM: it leaves its standby

    def kill_all(self, why: str) -> None:
        """The forced exit (a second Ctrl-C): SIGKILL every worker process, the spare too."""
        for process in [w.process for w in self.workers.values()] + [self.spare.process if self.spare else None]:
            if process is not None:
                process.signal(signal.SIGKILL, why)

    def _on_exited(self, worker: Worker, reason: str | None = None) -> None:
        spec = worker.spec
        record = self.records[spec.id]
        rc = worker.process.returncode if worker.process else None
        tail = list(worker.process.stderr_tail) if worker.process else []
        evicted = worker.state is State.EVICTING
        if not evicted:
            meaning = exit_meaning(rc)
            record.last_error = (reason or worker.kill_reason or f"worker exited with code {rc}"
                                 + (f" ({meaning})" if meaning else "") + (f": {tail[-1]}" if tail else ""))
            record.last_stderr = tail[-10:]
            record.note_crash(time.monotonic(), self.settings, load_failed=rc == EXIT_LOAD_FAILED)
            log.error("[crash] model=%s pid=%s exit=%s: %s", spec.id, worker.pid, rc, record.last_error)
            self.metrics.crashes.labels(spec.id).inc()
            if worker.info is None:
                self.metrics.loads.labels(spec.id, "failed").inc()
        record.last_exit = rc
        if not worker.ready.done():
            worker.ready.set_exception(
                errors.ModelEvicted(f"the model '{spec.id}' was evicted while it was loading") if evicted
                else errors.ModelLoadFailed(f"the model '{spec.id}' failed to load: {record.last_error}"))
        error: errors.MlxsupError = (
            errors.ModelEvicted(f"the model '{spec.id}' was evicted") if evicted
            else errors.WorkerDied(f"the worker of '{spec.id}' exited unexpectedly (code {rc})"))
        for stream in worker.streams.values():
            stream.fail(error)
        worker.streams.clear()
        for pending in worker.clears.values():
            if not pending.done():
                pending.set_exception(error)
        worker.clears.clear()
        worker.state = State.STOPPED if evicted else State.FAILED
        if self.workers.get(spec.id) is worker:
            del self.workers[spec.id]
        self._by_identity.pop(worker.identity, None)
        worker.gone.set()

    async def evict(self, name: str, mode: str = "drain", timeout_s: float | None = None,
                    reason: str = "api") -> dict:
        """Run the eviction sequence and wait until the process is reaped. Joins one in progress."""
        spec = self.registry.resolve(name)
        worker = self.workers.get(spec.id)
        if worker is None:
            return {"model": spec.id, "evicted": False, "reason": "not loaded"}
        return await asyncio.shield(self._begin_evict(worker, mode, timeout_s, reason))

    def _begin_evict(self, worker: Worker, mode: str, timeout_s: float | None, reason: str) -> asyncio.Task:
        """Mark the worker evicting in this very turn and start the sequence; idempotent."""
        if worker.evicting is None:
            worker.state = State.EVICTING
            worker.evict_reason = reason
            timeout = self.settings.evict_timeout_s if timeout_s is None else timeout_s
            log.info("[evict] model=%s pid=%s reason=%s mode=%s", worker.spec.id, worker.pid, reason, mode)
            self.metrics.evictions.labels(worker.spec.id, reason).inc()
            worker.evicting = asyncio.create_task(self._evict(worker, mode, timeout), name=f"evict[{worker.spec.id}]")
        elif mode == "now" and worker.info is not None:
            self.transport.send(worker.identity, Evict(mode="now", deadline_s=0))  # tighten a drain
        return worker.evicting

    async def _evict(self, worker: Worker, mode: str, timeout_s: float) -> dict:
        t0 = time.monotonic()
        pid = worker.pid
        memory_before = footprint(pid) if pid else None
        if worker.info is not None:
            self.transport.send(worker.identity, Evict(mode=mode, deadline_s=timeout_s))
            grace = timeout_s + self.settings.settle_grace_s
        else:  # still loading: nothing to drain, the worker turns SIGTERM into its own orderly exit
            grace = 0.0
        assert worker.process is not None
        ladder = await worker.process.stop(grace, self.settings.kill_timeout_s)
        await worker.gone.wait()
        bye = worker.bye
        report = {
            "model": worker.spec.id,
            "evicted": True,
            "reason": worker.evict_reason,
            "pid": pid,
            "mode": mode,
            "memory_before_bytes": memory_before,
            "duration_s": round(time.monotonic() - t0, 4),
            "exit": ladder.get("exit"),
            "signals": ladder.get("signals", []),
            "aborted": bye.aborted if bye else None,
            "drained": bye.drained if bye else None,
            "phases_s": {k: round(v, 4) for k, v in bye.phases.items()} if bye else {},
            "memory_after_settle_bytes": bye.memory_bytes if bye else None,
        }
        log.info("[evict] model=%s pid=%s exit=%s signals=%s ms=%d", worker.spec.id, pid, report["exit"],
                 report["signals"], report["duration_s"] * 1000)
        self.records[worker.spec.id].last_eviction = {k: report[k] for k in ("reason", "mode", "duration_s", "exit")}
        return report

    async def shutdown(self) -> list[dict]:
        """Refuse new work, then evict every worker in parallel, draining up to the deadline."""
        self.shutting_down = True
        if self._housekeeping:
            self._housekeeping.cancel()
        reports = await asyncio.gather(
            self._stop_spare(),
            *(self._begin_evict(w, "drain", self.settings.shutdown_drain_s, "shutdown")
              for w in list(self.workers.values())),
            return_exceptions=True)
        await self.transport.close()
        return [r for r in reports if isinstance(r, dict)]

    def _watch_liveness(self, now: float) -> None:
        """Kill workers whose loop stopped turning (no message for hang_timeout_s) or whose load stalls."""
        s = self.settings
        for worker in list(self.workers.values()):
            if worker.kill_reason is not None:
                continue
            if worker.state is State.READY and now - worker.last_seen > s.hang_timeout_s:
                self._kill(worker, f"hung: no heartbeat from its generation loop for {now - worker.last_seen:.1f}s")
            elif worker.state is State.LOADING and now - worker.started_at > s.load_timeout_s:
                self._kill(worker, f"the load did not finish within {s.load_timeout_s:.0f}s")

    def _kill(self, worker: Worker, reason: str) -> None:
        worker.kill_reason = reason
        log.error("[kill] model=%s pid=%s: %s", worker.spec.id, worker.pid, reason)
        if worker.process is not None:
            worker.process.signal(signal.SIGKILL, reason)

    # --- messages from workers (never await) -------------------------------------------

    def _on_message(self, identity: bytes, msg: Message) -> None:
        if self.spare is not None and identity == self.spare.identity:
            self.spare.standing_by = isinstance(msg, Standby) or self.spare.standing_by
            return
        worker = self._by_identity.get(identity)
        if worker is None:
            log.warning("[transport] message kind=%s from unknown worker %r", msg.KIND, identity)
            return
        worker.last_seen = time.monotonic()
        if isinstance(msg, Tokens):
            self._on_tokens(worker, msg)
        elif isinstance(msg, Finished):
            stream = worker.streams.pop(msg.rid, None)
            if stream is not None:
                stream.queue.put_nowait(msg)
        elif isinstance(msg, Failed):
            stream = worker.streams.pop(msg.rid, None)
            if stream is not None:
                stream.fail(errors.from_worker(msg.code, msg.message))
        elif isinstance(msg, Heartbeat):
            worker.heartbeat = msg
        elif isinstance(msg, CacheStats):
            worker.cache = msg
        elif isinstance(msg, CacheCleared):
            pending = worker.clears.pop(msg.rid, None)
            if pending is not None and not pending.done():
                pending.set_result(msg)
        elif isinstance(msg, Ready):
            self._on_ready(worker, msg)
        elif isinstance(msg, Progress):
            worker.progress = msg
            worker.progressed.set()
            worker.progressed = asyncio.Event()
        elif isinstance(msg, Bye):
            worker.bye = msg
        else:
            log.warning("[transport] unexpected kind=%s from %r", msg.KIND, identity)

    def _on_tokens(self, worker: Worker, msg: Tokens) -> None:
        streams = worker.streams
        for chunk in msg.chunks:
            try:
                rid, text, n = chunk
            except (TypeError, ValueError):
                log.warning("[transport] malformed chunk from %r dropped", worker.identity)
                continue
            stream = streams.get(rid)
            if stream is not None:
                stream.queue.put_nowait((text, n))

    def _on_ready(self, worker: Worker, msg: Ready) -> None:
        worker.info = msg
        if worker.state is State.LOADING:
            worker.state = State.READY
            worker.last_used = time.monotonic()
            log.info("[load] model=%s pid=%d ready in %.2fs", worker.spec.id, msg.pid, msg.load_s)
            self.metrics.loads.labels(worker.spec.id, "ok").inc()
            self.metrics.load_seconds.labels(worker.spec.id).observe(time.monotonic() - worker.started_at)
            worker.progressed.set()
        if not worker.ready.done():
            worker.ready.set_result(msg)

    def _on_refused(self, identity: bytes, reason: str) -> None:
        worker = self._by_identity.get(identity)
        log.error("[protocol] refused worker %r: %s", identity, reason)
        if worker is not None:
            self.records[worker.spec.id].last_error = f"protocol mismatch: {reason}"
            if not worker.ready.done():
                worker.ready.set_exception(errors.ModelLoadFailed(f"the worker was refused: {reason}"))
            self._kill(worker, f"protocol mismatch: {reason}")

    # --- status ------------------------------------------------------------------------

    def model_status(self, model_id: str) -> dict:
        worker = self.workers.get(model_id)
        record = self.records.get(model_id, ModelRecord())
        spec = self.registry.specs[model_id]
        ttl = self.settings.model_ttl(spec)
        status = {"id": model_id, "state": State.STOPPED.value, "pid": None, "memory_bytes": None, "in_flight": 0,
                  "queued": 0, "leases": 0, "idle_s": None, "ttl_s": ttl, "ttl_remaining_s": None,
                  "pinned": spec.pinned, "restarts": max(0, record.starts - 1), "crashes": record.crashes,
                  "last_error": record.last_error, "stderr_tail": record.last_stderr,
                  "last_eviction": record.last_eviction, "worker_active": 0, "batch_size": 0, "peak_batch_size": 0,
                  "cache": None}
        if worker is None:
            if record.failed_until > time.monotonic():
                status["state"] = State.FAILED.value
                status["retry_in_s"] = round(record.failed_until - time.monotonic(), 1)
            return status
        hb = worker.heartbeat
        idle = time.monotonic() - worker.last_used if worker.leases == 0 and worker.state is State.READY else 0.0
        status.update(
            state=worker.state.value, pid=worker.pid, memory_bytes=footprint(worker.pid) if worker.pid else None,
            in_flight=len(worker.streams), leases=worker.leases, idle_s=round(idle, 1),
            ttl_remaining_s=round(max(0.0, ttl - idle), 1) if ttl and not spec.pinned else None,
            queued=hb.waiting if hb else 0, worker_active=hb.active if hb else 0, batch_size=hb.batch_size if hb else 0,
            peak_batch_size=hb.max_batch_size if hb else 0, generated_tokens=hb.generated_tokens if hb else 0,
            context_length=worker.info.context_length if worker.info else None,
            cache=cache_admin.stats_view(worker.cache),
        )
        if worker.state is State.LOADING:
            status["progress"] = {"stage": worker.progress.stage, "fraction": worker.progress.fraction}
        return status

    async def clear_cache(self, which: str, name: str | None = None) -> dict:
        """Empty one cache tier of one model (`name`) or of all; see supervisor/cache_admin.py."""
        return await cache_admin.clear(self, which, name)

    def status(self) -> dict:
        views = self._views()
        return {
            "ceiling_bytes": self.ceiling,
            "used_bytes": sum(v.bytes for v in views),
            "system_available_bytes": system_available(),
            "system_total_bytes": system_total(),
            "max_loaded_models": self.settings.max_loaded_models,
            "spare": {"pid": self.spare.process.pid, "standing_by": self.spare.standing_by} if self.spare else None,
            "models": [self.model_status(m) for m in self.registry.ids()],
        }
