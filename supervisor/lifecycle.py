"""Worker lifecycle: start (fresh, or on the spare), watch, crash, evict, shut down; and the
memory accounting those decisions read. A collaborator the Router (router.py) owns and calls.

It owns the models' slots (slot.py: each model's worker and record), the workers by identity, the spare, the pressure
level and the shutdown flag; a worker's state moves only here. It tells its listener
(core_api.LifecycleEvents: the Router's Resumption) what happens to a worker's requests, and
calls nothing else of the core. All of it runs on the one asyncio loop, and acts on the world
only through the effects passed in (effects.py). Rules:
- A worker is marked evicting in the very turn that decides to evict it (`begin_evict`); a
  second evict of the same worker joins the first (a `now` one tightens a drain).
- A worker's route and accounting are dropped only after its process has been reaped
  (`_on_exited`, called once per worker when its process is gone).
- A crash or a failed load is written in the model's record: restarts back off, and a crash
  loop or a failed load marks the model failed until a cool-down (or an explicit load). A load
  that outgrows its memory (policy.load_overrun) is killed and counts as a failed load.
- Slow work (spawn, stop) runs as tasks; nothing here awaits between a check and its act.
- Every task is started by tasks.background: kept until done, its exception logged, never lost.
- A hang kill never blocks the loop: the stack dump and the SIGKILL run as a task.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import signal

from protocol.messages import EXIT_LOAD_FAILED, Evict, Load, Message, Ready, Standby
from protocol.modelconfig import kv_bytes_at, runtime_bytes_at
from supervisor import errors, policy
from supervisor.config import Settings
from supervisor.core_api import LifecycleEvents, NoEvents
from supervisor.effects import Clock, LifecycleMetrics, MemoryProbe, Messenger, Spawn
from supervisor.process import exit_meaning, model_args, worker_argv
from supervisor.registry import ModelSpec, Registry
from supervisor.reports import EvictReport
from supervisor.slot import Changes, ModelSlot
from supervisor.stranded import Stranded, tolerance_of
from supervisor.tasks import background
from supervisor.workers import Spare, State, Worker

log = logging.getLogger(__name__)

STACK_DUMP_WAIT_S = 1.0  # how long a hang kill waits for the worker's stacks before SIGKILL
RECENT_EVICTIONS = 20  # finished evictions the status lists (the dashboard's history)
LOAD_OVERRUN = "its load outgrew its memory"  # a kill's reason: the model is then marked failed, as a failed load is


class Lifecycle:
    def __init__(self, registry: Registry, settings: Settings, *, transport: Messenger, spawn: Spawn,
                 memory: MemoryProbe, clock: Clock, metrics: LifecycleMetrics) -> None:
        self.registry = registry
        self.settings = settings
        self.transport = transport
        self.spawn = spawn
        self.memory = memory
        self.clock = clock
        self.metrics = metrics
        self.slots: dict[str, ModelSlot] = {}  # by model id, each made once (slot) and never replaced
        self.changes = Changes()  # fired when a worker is ready, evicting or gone: queued requests decide again
        self.by_identity: dict[bytes, Worker] = {}  # never replaced: the router's message table holds it
        self.recent_evictions: collections.deque[tuple[float, EvictReport]] = collections.deque(
            maxlen=RECENT_EVICTIONS)  # (monotonic time it ended, report), oldest first
        self._spawned = 0
        self._housekeeping: asyncio.Task | None = None
        self.spare: Spare | None = None
        self.pressure: str | None = None  # the level the last housekeeping saw
        self.shutting_down = False
        self.events: LifecycleEvents = NoEvents()  # the Router sets its Resumption here
        # wired memory no live worker holds, above its lowest: what exits did not give back (stranded.py; macOS)
        self.stranded = Stranded(tolerance_of(memory.system_total()))
        self.stranded.measure(memory.system_wired(), 0)

    def slot(self, model_id: str) -> ModelSlot:
        """The model's slot, made on first use."""
        slot = self.slots.get(model_id)
        if slot is None:
            slot = self.slots[model_id] = ModelSlot()
        return slot

    @property
    def workers(self) -> dict[str, Worker]:
        """The models' current workers, by model id (a new dict: the slots own them)."""
        return {model_id: slot.worker for model_id, slot in self.slots.items() if slot.worker is not None}

    def boot(self) -> None:
        """Start the pinned models' workers, the spare and the housekeeping."""
        for spec in self.registry.specs.values():
            if spec.pinned:
                self.start_worker(spec)
        self._replenish_spare()
        self._housekeeping = background(self._keep_house(), name="housekeeping")

    # --- TTL and memory pressure -------------------------------------------------------

    async def _keep_house(self) -> None:
        while True:
            await self.clock.sleep(self.settings.housekeeping_s)
            try:
                self._housekeep()
            except Exception:
                log.exception("[housekeeping] failed; going on")

    def _housekeep(self) -> None:
        s = self.settings
        self.measure_stranded()
        level = policy.pressure_level(self.memory.system_available(), self.memory.system_total(),
                                      s.pressure_soft, s.pressure_hard)
        self.pressure = level
        if level is not None and self.spare is not None:  # the spare is pure overhead: it goes first
            background(self._stop_spare(), name="stop[spare]")
        if not self.workers:
            return
        self._watch_liveness(self.clock.monotonic())
        views = self.views()
        ttls = {w.spec.id: self.ttl(w) for w in self.workers.values()}
        for model_id in policy.ttl_expired(views, ttls, self.clock.monotonic()):
            self.begin_evict(self.workers[model_id], "drain", None, "ttl")
        victim = policy.pressure_victim(self.views(), level)
        if victim is not None:
            model_id, busy = victim
            self.begin_evict(self.workers[model_id], "now" if busy else "drain", None, f"pressure-{level}")

    def _watch_liveness(self, now: float) -> None:
        """Kill workers whose loop stopped turning (see policy.hang_reason), whose load stalls, or whose load outgrows
        its memory (policy.load_overrun: a hostile config's model being built grows without bound)."""
        s = self.settings
        for worker in list(self.workers.values()):
            if worker.kill_reason is not None:
                continue
            if worker.state is State.READY:
                why = policy.hang_reason(now, worker.last_seen, s.hang_timeout_s, worker.step_started,
                                         worker.step_predicted_s)
                if why is not None:
                    self._kill(worker, f"hung: {why}", dump_stacks=True)
            elif worker.state is State.LOADING and now - worker.started_at > s.load_timeout_s:
                self._kill(worker, f"the load did not finish within {s.load_timeout_s:.0f}s", dump_stacks=True)
            elif worker.state is State.LOADING and (
                    why := policy.load_overrun(self.measured(worker), self.estimate(worker.spec), self.ceiling)):
                self._kill(worker, f"{LOAD_OVERRUN}: {why}")  # at once: every moment it grows

    def _kill(self, worker: Worker, reason: str, dump_stacks: bool = False) -> None:
        """SIGKILL the worker, recording why; with `dump_stacks`, after it wrote its stacks to its log (a task)."""
        worker.kill_reason = reason
        log.error("[kill] model=%s pid=%s by=supervisor: %s", worker.spec.id, worker.pid, reason)
        if worker.process is None:
            return
        if dump_stacks:
            worker.killing = background(worker.process.kill_after_stack_dump(STACK_DUMP_WAIT_S, reason),
                                                 name=f"kill[{worker.spec.id}]")
        else:
            worker.process.signal(signal.SIGKILL, reason)

    # --- memory accounting -------------------------------------------------------------

    @property
    def ceiling(self) -> int:
        """Admission's ceiling, less what exits left stranded (it is not there to load into)."""
        return max(0, self.settings.ceiling(self.memory.system_total()) - self.stranded.bytes)

    def measure_stranded(self, gone: Worker | None = None) -> int:
        """Measure the wired memory no live worker holds (stranded.py; `gone`: one just reaped); how much it grew
        since the last measure."""
        processes = [*(pid for w in self.workers.values() if w is not gone for pid in self._local_pids(w)),
                     *([self.spare.process.pid] if self.spare is not None and self.spare.process.pid else [])]
        held = sum(self.memory.wired(pid) or 0 for pid in processes)
        return self.stranded.measure(self.memory.system_wired(), held)

    def estimate(self, spec: ModelSpec) -> int:
        """A loading worker's bytes on this machine: its weights, what a first request needs past them (its KV and
        logits, from the config: registry.memory_facts; the KV at the model's `[cache] kv_bits`, as its running cache
        holds it) and the overhead; a group's ranks here hold their share."""
        cache = self.settings.model_cache(spec)
        model = spec.weights_bytes + runtime_bytes_at(spec.runtime_bytes, spec.kv_bytes_per_token, spec.kv_tokens,
                                                      spec.kv_dtype_bytes, cache.kv_bits, cache.kv_group_size or 64)
        if spec.group is not None:
            local = spec.group.local_ranks
            return model * local // spec.group.ranks + self.settings.worker_overhead_bytes * local
        return model + self.settings.worker_overhead_bytes

    def context_cap(self, spec: ModelSpec) -> int | None:
        """The context a new worker of `spec` may publish for this machine's memory (policy.context_cap); a group's
        is not capped here (its KV is spread over its ranks' machines). Its K/V counted at the model's `[cache]
        kv_bits`, which quantizes the running cache: 8 bits fit about twice the tokens of 16."""
        if spec.group is not None:
            return None
        cache = self.settings.model_cache(spec)
        per_token = kv_bytes_at(spec.kv_bytes_per_token, spec.kv_dtype_bytes, cache.kv_bits, cache.kv_group_size or 64)
        return policy.context_cap(per_token, self.estimate(spec), self.ceiling)

    def _local_pids(self, worker: Worker) -> list[int]:
        """The worker's processes on this machine: its own, or a group's local ranks (remote ones count elsewhere)."""
        pids = getattr(worker.process, "local_pids", None)
        if pids is not None:
            return list(pids)
        return [worker.pid] if worker.pid else []

    def measured(self, worker: Worker) -> int | None:
        """The measured footprint of the worker's processes on this machine (None: none measured)."""
        found = [b for b in (self.memory.footprint(pid) for pid in self._local_pids(worker)) if b is not None]
        return sum(found) if found else None

    def ranks(self, worker: Worker) -> tuple[dict, ...]:
        """A group's ranks for status: rank, host, pid, and this machine's measured footprint of each."""
        describe = getattr(worker.process, "describe", None)
        if describe is None:
            return ()
        return tuple({**r, "memory_bytes": self.memory.footprint(r["pid"]) if r["local"] and r["pid"] else None}
                     for r in describe())

    def _bytes(self, worker: Worker) -> int:
        measured = self.measured(worker)
        if worker.state is State.LOADING:
            return max(measured or 0, self.estimate(worker.spec))
        return measured if measured is not None else self.estimate(worker.spec)

    def ttl(self, worker: Worker) -> float | None:
        """The worker's idle TTL: its keep_alive's, else its model's (None: never)."""
        if worker.keep_alive is not None:
            return None if worker.keep_alive < 0 else worker.keep_alive
        return self.settings.model_ttl(worker.spec)

    def pinned(self, worker: Worker) -> bool:
        """Pinned: only an explicit evict removes it (its model's `pinned`, or a negative keep_alive)."""
        return worker.spec.pinned or (worker.keep_alive is not None and worker.keep_alive < 0)

    def views(self) -> list[policy.WorkerView]:
        """The workers as policy sees them; busy: leased, or owed to a request queued for it (ModelSlot.owed)."""
        return [policy.WorkerView(w.spec.id, w.state.value, self._bytes(w), w.leases > 0 or slot.owed(),
                                  self.pinned(w), w.last_used)
                for slot in self.slots.values() if (w := slot.worker) is not None]

    # --- starting workers --------------------------------------------------------------

    def start_worker(self, spec: ModelSpec) -> Worker:
        """A worker for `spec`: the spare on standby if there is one (its imports are paid), else a new process."""
        self.measure_stranded()  # what is wired before it loads
        st = self.settings
        args = model_args(spec.path, spec.id, st.max_batch_size, st.prefill_step_size, spec.worker_args,
                          tuple(st.model_cache(spec).worker_args(st.state_dir)), step_target_s=st.step_target_s,
                          warm_batch_shapes=st.warm_batch_shapes, strict_context=st.strict_context,
                          max_context=self.context_cap(spec), speculative=st.speculative)
        log_path = st.worker_log(spec.id)
        spare = self.spare if self.spare is not None and self.spare.standing_by and spec.group is None else None
        if spec.group is not None:  # a group's ranks start together, never on the spare
            self._spawned += 1
            identity = f"{spec.id}#{self._spawned}".encode()
            argv = worker_argv(self.transport.endpoint, identity.decode(), st.heartbeat_s, args, st.log_level)
            process = self.spawn(spec.id, argv, log_path, group=spec.group)
        elif spare is not None:
            self.spare = None
            identity, process = spare.identity, spare.process
            process.assign(spec.id, log_path)
        else:
            self._spawned += 1
            identity = f"{spec.id}#{self._spawned}".encode()
            argv = worker_argv(self.transport.endpoint, identity.decode(), st.heartbeat_s, args, st.log_level)
            process = self.spawn(spec.id, argv, log_path)
        worker = Worker(spec, identity, process, asyncio.get_running_loop().create_future(), self.clock.monotonic())
        worker.ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved by design
        slot = self.slot(spec.id)
        slot.worker = worker
        slot.starts += 1
        self.by_identity[identity] = worker
        if spare is not None:
            log.info("[load] model=%s on the spare pid=%s", spec.id, process.pid)
            self.transport.send(identity, Load(args=args))
        self._replenish_spare()  # at most one spawn per load: a spare that keeps dying cannot loop
        background(self._run(worker, spawned=spare is None), name=f"run[{spec.id}]")
        return worker

    async def _run(self, worker: Worker, spawned: bool) -> None:
        """Start a freshly spawned worker's process (a spare's runs already), then wait for its end."""
        if spawned:
            try:
                await worker.process.start()
            except OSError as exc:
                self._on_exited(worker, f"could not start the worker: {exc}")
                return
        await worker.process.exited.wait()
        self._on_exited(worker)

    def _replenish_spare(self) -> None:
        if self.spare is not None or not self.settings.spare_workers or self.shutting_down or self.pressure:
            return
        self._spawned += 1
        identity = f"spare#{self._spawned}".encode()
        argv = worker_argv(self.transport.endpoint, identity.decode(), self.settings.heartbeat_s, ["--spare"],
                           self.settings.log_level)
        spare = Spare(identity, self.spawn("spare", argv, self.settings.worker_log("spare")))
        self.spare = spare
        background(self._run_spare(spare), name="run[spare]")

    async def _run_spare(self, spare: Spare) -> None:
        try:
            await spare.process.start()
        except OSError as exc:
            log.error("[spare] could not start: %s", exc)
        await spare.process.exited.wait()
        if self.spare is spare:  # it died on standby; the next load spawns a fresh worker and a new spare
            self.spare = None
            log.warning("[spare] exited on standby with code %s", spare.process.returncode)

    def on_spare_message(self, identity: bytes, msg: Message) -> bool:
        """A message from the spare on standby (True); anything else is not the spare's (False)."""
        spare = self.spare
        if spare is None or identity != spare.identity:
            return False
        spare.standing_by = isinstance(msg, Standby) or spare.standing_by
        return True

    async def _stop_spare(self) -> None:
        spare, self.spare = self.spare, None
        if spare is not None:
            await spare.process.stop(0.0, self.settings.kill_timeout_s)  # SIGTERM: it leaves its standby

    def kill_all(self, why: str) -> None:
        """The forced exit (a second Ctrl-C): SIGKILL every worker process, the spare too."""
        for process in [w.process for w in self.workers.values()] + [self.spare.process if self.spare else None]:
            if process is not None:
                process.signal(signal.SIGKILL, why)

    # --- a worker's end ----------------------------------------------------------------

    def _on_exited(self, worker: Worker, reason: str | None = None) -> None:
        spec = worker.spec
        record = self.slots[spec.id]
        rc = worker.process.returncode
        record.stranded_bytes = self.measure_stranded(gone=worker)
        if record.stranded_bytes:
            log.warning("[memory] model=%s pid=%s its exit left %d MiB of wired memory no process holds (%d MiB "
                        "stranded in all): admission counts it, crash restarts back off; a reboot returns it",
                        spec.id, worker.pid, record.stranded_bytes >> 20, self.stranded.bytes >> 20)
        tail = list(worker.process.stderr_tail)
        evicted = worker.state is State.EVICTING
        refused = worker.state is State.FAILED  # failed before its exit (refused)
        if not evicted:
            meaning = exit_meaning(rc)
            record.last_error = (reason or worker.kill_reason or f"worker exited with code {rc}"
                                 + (f" ({meaning})" if meaning else "") + (f": {tail[-1]}" if tail else ""))
            record.last_stderr = tail[-10:]
            # a refused worker speaks another protocol version: its next one would be refused too; a load that outgrew
            # its memory would outgrow it again
            outgrew = (worker.kill_reason or "").startswith(LOAD_OVERRUN)
            record.note_crash(self.clock.monotonic(), self.settings,
                              load_failed=rc == EXIT_LOAD_FAILED or refused or outgrew)
            if self.stranded.bytes:  # while memory is stranded, a restart loop would only strand more
                record.backoff_until = max(record.backoff_until,
                                           self.clock.monotonic() + self.settings.restart_backoff_max_s)
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
        cause = None if evicted else "hang" if (worker.kill_reason or "").startswith("hung") else "crash"
        self.events.streams_lost(worker, error, cause)  # the listener takes what may resume ...
        for stream in worker.streams.values():  # ... the rest fails
            stream.fail(error)
        worker.streams.clear()
        for pending in worker.replies.values():  # requests it will never answer now
            if not pending.done():
                pending.set_exception(error)
        worker.replies.clear()
        if not refused:
            worker.move(State.STOPPED if evicted else State.FAILED)
        if record.worker is worker:
            record.worker = None
        self.by_identity.pop(worker.identity, None)
        worker.gone.set()
        self.changes.fire()

    def refused(self, identity: bytes, reason: str) -> None:
        """A worker of another protocol version: it fails in this very turn (every wait on it ends and none
        starts) and is killed; its exit then marks the model failed, since its next worker would be refused too."""
        worker = self.by_identity.get(identity)
        log.error("[protocol] refused worker %r: %s", identity, reason)
        if worker is None or worker.state is State.FAILED:  # one of its later frames: refused already
            return
        why = f"protocol mismatch: {reason}"
        self.slots[worker.spec.id].last_error = why
        if worker.state is not State.EVICTING:  # an evicting one ends as evicted
            worker.move(State.FAILED)
        if not worker.ready.done():
            worker.ready.set_exception(errors.ModelLoadFailed(f"the worker was refused: {reason}"))
        for pending in worker.replies.values():
            if not pending.done():
                pending.set_exception(errors.WorkerDied(f"the worker of '{worker.spec.id}' was refused: {reason}"))
        worker.replies.clear()
        self._kill(worker, why)

    def loaded(self, worker: Worker, msg: Ready) -> None:
        """The worker said Ready: a loading one is ready from this turn on, and its load's waiters wake."""
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
        self.changes.fire()

    # --- eviction and shutdown ---------------------------------------------------------

    async def evict(self, name: str, mode: str = "drain", timeout_s: float | None = None,
                    reason: str = "api") -> EvictReport:
        """Run the eviction sequence and wait until the process is reaped. Joins one in progress."""
        spec = self.registry.resolve(name)
        worker = self.workers.get(spec.id)
        if worker is None:
            return EvictReport.not_loaded(spec.id)
        return await asyncio.shield(self.begin_evict(worker, mode, timeout_s, reason))

    def begin_evict(self, worker: Worker, mode: str, timeout_s: float | None, reason: str) -> asyncio.Task:
        """Mark the worker evicting in this very turn and start the sequence; idempotent."""
        if worker.evicting is None:
            self.events.evicting(worker, reason)
            if worker.state is not State.FAILED:  # a refused worker is killed already: only its end is waited for
                worker.move(State.EVICTING)
            worker.evict_reason = reason
            timeout = self.settings.evict_timeout_s if timeout_s is None else timeout_s
            log.info("[evict] model=%s pid=%s reason=%s mode=%s", worker.spec.id, worker.pid, reason, mode)
            self.metrics.evictions.labels(worker.spec.id, reason).inc()
            worker.evicting = background(self._evict(worker, mode, timeout), name=f"evict[{worker.spec.id}]")
            self.changes.fire()
        elif mode == "now" and worker.info is not None:
            self.transport.send(worker.identity, Evict(mode="now", deadline_s=0))  # tighten a drain
        return worker.evicting

    async def _evict(self, worker: Worker, mode: str, timeout_s: float) -> EvictReport:
        t0 = self.clock.monotonic()
        pid = worker.pid
        memory_before = self.measured(worker)
        if worker.info is not None:
            self.transport.send(worker.identity, Evict(mode=mode, deadline_s=timeout_s))
            grace = timeout_s + self.settings.settle_grace_s
        else:  # still loading: nothing to drain, the worker turns SIGTERM into its own orderly exit
            grace = 0.0
        ladder = await worker.process.stop(grace, policy.kill_timeout(self.settings.kill_timeout_s,
                                                                      self.estimate(worker.spec)))
        await worker.gone.wait()
        bye = worker.bye
        report = EvictReport(
            model=worker.spec.id, evicted=True, reason=worker.evict_reason, pid=pid, mode=mode,
            memory_before_bytes=memory_before, duration_s=round(self.clock.monotonic() - t0, 4),
            exit=ladder.get("exit"), signals=tuple(ladder.get("signals", [])),
            aborted=bye.aborted if bye else None, drained=bye.drained if bye else None,
            phases_s={k: round(v, 4) for k, v in bye.phases.items()} if bye else {},
            memory_after_settle_bytes=bye.memory_bytes if bye else None,
            stranded_bytes=self.slots[worker.spec.id].stranded_bytes,
        )
        log.info("[evict] model=%s pid=%s exit=%s signals=%s ms=%d", worker.spec.id, pid, report.exit,
                 list(report.signals), (report.duration_s or 0.0) * 1000)
        self.slots[worker.spec.id].last_eviction = report
        self.recent_evictions.append((self.clock.monotonic(), report))
        return report

    async def shutdown(self) -> list[EvictReport]:
        """Refuse new work, then evict every worker in parallel, draining up to the deadline."""
        self.shutting_down = True
        self.events.shutting_down("the server is shutting down")
        if self._housekeeping:
            self._housekeeping.cancel()
        reports = await asyncio.gather(
            self._stop_spare(),
            *(self.begin_evict(w, "drain", self.settings.shutdown_drain_s, "shutdown")
              for w in list(self.workers.values())),
            return_exceptions=True)
        await self.transport.close()
        return [r for r in reports if isinstance(r, EvictReport)]
