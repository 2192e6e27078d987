"""The router's lifecycle logic against fake effects: no processes, no sockets, no MLX, no real time.

A fake transport records what the router sends and lets a test deliver workers' messages; fake
processes exit when the test says (SIGKILL ends them at once, as it would); a fake clock moves
only when the test advances it, waking the router's sleeps (back-off, housekeeping, reply
timeouts) that are due. Everything runs on one event loop, turn by turn, so each interleaving
is the one written here. Each test names, in its docstring, the handling it would catch missing.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest

from protocol.codec import encode
from protocol.messages import (
    ALL_MESSAGES,
    EXIT_LOAD_FAILED,
    Abort,
    Bye,
    CacheCleared,
    ClearCache,
    Evict,
    Finished,
    Heartbeat,
    Load,
    Message,
    Ready,
    Standby,
    Submit,
    Tokens,
)
from supervisor import errors, policy
from supervisor.config import Settings
from supervisor.effects import Handler, Refusal
from supervisor.gateway.metrics import Metrics
from supervisor.registry import ModelSpec, Registry
from supervisor.router import Lease, Router
from supervisor.workers import IllegalTransition, State, Stream, Worker
from tests.unit.watchdog import run_watched

MIB = 2**20
M = TypeVar("M", bound=Message)


@pytest.fixture(autouse=True)
def strict_states(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker state move that workers.TRANSITIONS does not allow raises (in a daemon: logged loudly)."""
    monkeypatch.setenv("MLXSUP_STRICT_STATES", "1")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self._sleepers: list[tuple[float, asyncio.Future]] = []

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        wake: asyncio.Future = asyncio.get_running_loop().create_future()
        self._sleepers.append((self.now + seconds, wake))
        await wake

    def advance(self, seconds: float) -> None:
        self.now += seconds
        for due, wake in list(self._sleepers):
            if due <= self.now:
                self._sleepers.remove((due, wake))
                if not wake.done():
                    wake.set_result(None)


class FakeProcess:
    def __init__(self, model_id: str, argv: list[str], log_path: Path | None, pid: int) -> None:
        self.model_id, self.argv, self.log_path = model_id, argv, log_path
        self._pid = pid
        self.started = False
        self.start_error: OSError | None = None
        self.returncode: int | None = None
        self.exited = asyncio.Event()
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=40)
        self.signals: list[str] = []
        self.stops: list[tuple[float, float]] = []  # (grace_s, kill_timeout_s) of each stop()
        self.reap_later = False  # True: SIGKILL does not end it at once; the test's exit() is its reaping

    @property
    def pid(self) -> int | None:
        return self._pid if self.started else None

    async def start(self) -> None:
        if self.start_error is not None:
            self.exited.set()
            raise self.start_error
        self.started = True

    def assign(self, model_id: str, log_path: Path | None) -> None:
        self.model_id, self.log_path = model_id, log_path

    def signal(self, sig: signal.Signals, why: str | None = None) -> None:
        self.signals.append(sig.name)
        if sig == signal.SIGKILL and not self.reap_later:
            self.exit(-signal.SIGKILL)

    async def stop(self, grace_s: float, kill_timeout_s: float) -> dict:
        self.stops.append((grace_s, kill_timeout_s))
        await self.exited.wait()
        return {"exit": self.returncode, "signals": list(self.signals), "wait_s": 0.0}

    def exit(self, returncode: int, last_words: str | None = None) -> None:
        if last_words:
            self.stderr_tail.append(last_words)
        if self.returncode is None:
            self.returncode = returncode
            self.exited.set()


class FakeTransport:
    endpoint = "ipc:///fake/router.sock"

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Message]] = []
        self.unreachable: set[bytes] = set()
        self.closed = False
        self.deliver: Handler = lambda identity, msg: None
        self.refuse: Refusal = lambda identity, why: None

    def start(self, on_message: Handler, on_refused: Refusal) -> None:
        self.deliver, self.refuse = on_message, on_refused

    def send(self, identity: bytes, msg: Message) -> bool:
        encode(msg)  # what the real transport does first: a value the wire cannot carry raises ProtocolError
        if identity in self.unreachable:
            return False
        self.sent.append((identity, msg))
        return True

    async def close(self) -> None:
        self.closed = True

    def to(self, worker: Worker, kind: type[M]) -> list[M]:
        """The messages of one kind sent to the worker, in order."""
        return [m for i, m in self.sent if i == worker.identity and isinstance(m, kind)]


class FakeMemory:
    def __init__(self) -> None:
        self.total = 1000 * MIB
        self.available = 1000 * MIB
        self.sizes: dict[int, int] = {}
        self.host_wired: int | None = None  # None: a platform that reports no wired memory (Linux)
        self.wired_sizes: dict[int, int] = {}

    def footprint(self, pid: int) -> int | None:
        return self.sizes.get(pid)

    def system_available(self) -> int:
        return self.available

    def system_total(self) -> int:
        return self.total

    def wired(self, pid: int) -> int | None:
        return self.wired_sizes.get(pid) if self.host_wired is not None else None

    def system_wired(self) -> int | None:
        return self.host_wired


class World:
    """A router wired to fakes, with the steps a test takes in a worker's name."""

    def __init__(self, tmp_path: Path, models: list[ModelSpec] | None = None, **settings: Any) -> None:
        defaults = dict(state_dir=tmp_path, spare_workers=0, memory_ceiling_bytes=1000 * MIB, worker_overhead_bytes=0,
                        pressure_soft=0.90, pressure_hard=0.97, max_resumes=0,  # test_resume.py turns them on
                        hang_timeout_s=1e6)  # these workers send no heartbeats while the clock jumps ahead
        self.settings = Settings(**{**defaults, **settings})
        specs = models or [ModelSpec("m", tmp_path, weights_bytes=100 * MIB),
                           ModelSpec("n", tmp_path, weights_bytes=100 * MIB)]
        self.clock, self.memory, self.transport, self.metrics = FakeClock(), FakeMemory(), FakeTransport(), Metrics()
        self.processes: list[FakeProcess] = []
        self.router = Router(Registry({s.id: s for s in specs}), self.settings, transport=self.transport,
                             spawn=self._spawn, memory=self.memory, clock=self.clock, metrics=self.metrics)
        self.router.start()

    def _spawn(self, model_id: str, argv: list[str], log_path: Path) -> FakeProcess:
        process = FakeProcess(model_id, argv, log_path, pid=100 + len(self.processes))
        self.processes.append(process)
        return process

    def worker(self, model_id: str) -> Worker:
        return self.router.workers[model_id]

    def process(self, model_id: str) -> FakeProcess:
        return fake(self.worker(model_id))

    def ready(self, model_id: str) -> Worker:
        worker = self.worker(model_id)
        self.transport.deliver(worker.identity, Ready(model_id, worker.pid or 0, 8192, 1000, 1, 1, 0.1))
        return worker

    def stand_by(self) -> None:
        """The spare has paid its imports."""
        assert self.router.spare is not None
        self.transport.deliver(self.router.spare.identity, Standby(self.router.spare.process.pid or 0))

    async def load(self, model_id: str) -> Lease:
        """A request for the model that starts its worker, which then says Ready: the request's lease."""
        acquiring = asyncio.ensure_future(self.router.acquire(model_id))
        await settle()
        self.ready(model_id)
        return await now(acquiring)

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


def fake(worker: Worker) -> FakeProcess:
    return cast(FakeProcess, worker.process)


async def settle(turns: int = 20) -> None:
    """Let every task that can run, run (a handful of loop turns; nothing here waits on real time)."""
    for _ in range(turns):
        await asyncio.sleep(0)


def scenario(test: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """Run an async test on a fresh loop; the timeout turns a hang into a failure, the watchdog a spin
    (a loop that stops yielding, which no timeout on that loop can see)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        run_watched(asyncio.wait_for(test(*args, **kwargs), 10))

    return run


def pending(task: asyncio.Future) -> bool:
    return not task.done()


async def now(awaitable: Awaitable[Any]) -> Any:
    """The outcome of something that must finish with no one else acting: its result, or its error
    raised; a failure (not a hang) if it still waits."""
    task = asyncio.ensure_future(awaitable)
    await settle()
    assert task.done(), "still waiting"
    return task.result()


def next_event(stream: Stream) -> Any:
    """The stream's next event, which must be there already (an error is returned, not raised)."""
    assert not stream.queue.empty(), "the stream has no event"
    return stream.queue.get_nowait()


# --- crashes, back-off and the failed state ----------------------------------------------


@scenario
async def test_a_crash_fails_the_streams_and_the_next_start_waits_out_a_doubling_backoff(tmp_path: Path) -> None:
    """Catches: streams left hanging on a dead worker; a restart without back-off, or one that does not grow."""
    w = World(tmp_path, restart_backoff_s=0.5, restart_backoff_max_s=10.0)
    lease = await w.load("m")
    stream = lease.submit(Submit("r1", max_tokens=8, prompt="hi"))
    w.process("m").exit(1, last_words="RuntimeError: boom")
    await settle()
    assert isinstance(next_event(stream), errors.WorkerDied)
    assert "m" not in w.router.workers
    status = w.router.model_status("m")
    assert status.crashes == 1 and "boom" in (status.last_error or "") and status.state == "stopped"
    assert w.sample("mlxsup_crashes_total", model="m") == 1
    lease.release()

    restarting = asyncio.ensure_future(w.router.acquire("m"))
    await settle()
    assert len(w.processes) == 1, "restarted without waiting out the back-off"
    w.clock.advance(0.49)
    await settle()
    assert len(w.processes) == 1
    w.clock.advance(0.01)
    await settle()
    assert len(w.processes) == 2, "not restarted once the back-off was over"
    w.process("m").exit(1)  # it dies again while loading: the second crash in the window
    await settle()
    with pytest.raises(errors.ModelLoadFailed):
        await now(restarting)

    again = asyncio.ensure_future(w.router.acquire("m"))
    w.clock.advance(0.99)
    await settle()
    assert len(w.processes) == 2, "the second back-off did not double"
    w.clock.advance(0.01)
    await settle()
    assert len(w.processes) == 3
    again.cancel()


@scenario
async def test_a_crash_loop_marks_the_model_failed_until_the_cool_down(tmp_path: Path) -> None:
    """Catches: a crash loop that keeps respawning; a failed mark that never lifts."""
    w = World(tmp_path, crash_limit=3, crash_window_s=60.0, crash_cooldown_s=30.0, restart_backoff_s=0.5)
    for _ in range(3):
        lease = await w.load("m")
        lease.release()
        w.process("m").exit(-signal.SIGSEGV)
        await settle()
        w.clock.advance(5.0)  # past any back-off, well within the crash window
    with pytest.raises(errors.ModelLoadFailed, match="marked failed"):
        await now(w.router.acquire("m"))
    assert len(w.processes) == 3
    status = w.router.model_status("m")
    assert status.state == "failed" and status.retry_in_s == pytest.approx(30.0 - 5.0, abs=0.1)
    assert status.to_dict()["retry_in_s"] == status.retry_in_s

    w.clock.advance(25.0)
    acquiring = asyncio.ensure_future(w.router.acquire("m"))
    await settle()
    assert len(w.processes) == 4, "the cool-down passed but the model was not tried again"
    acquiring.cancel()


@scenario
async def test_a_failed_load_marks_the_model_failed_at_once_and_an_explicit_load_clears_it(tmp_path: Path) -> None:
    """Catches: a load failure treated as an ordinary crash (respawned); an explicit load that stays refused."""
    w = World(tmp_path, crash_limit=3)
    waiting = asyncio.ensure_future(w.router.acquire("m"))
    await settle()
    w.process("m").exit(EXIT_LOAD_FAILED, last_words="ValueError: no weights")
    await settle()
    with pytest.raises(errors.ModelLoadFailed, match="failed to load"):
        await now(waiting)
    assert w.sample("mlxsup_loads_total", model="m", outcome="failed") == 1
    w.clock.advance(5.0)
    with pytest.raises(errors.ModelLoadFailed, match="marked failed"):
        await now(w.router.acquire("m"))
    assert w.router.model_status("m").state == "failed"

    explicit = asyncio.ensure_future(w.router.acquire("m", explicit=True))
    await settle()
    assert len(w.processes) == 2, "an explicit load did not clear the failed state"
    w.ready("m")
    (await now(explicit)).release()
    assert w.router.model_status("m").state == "ready"


@scenario
async def test_a_worker_that_cannot_be_spawned_fails_its_load(tmp_path: Path) -> None:
    """Catches: a spawn error (OSError) that leaves the request waiting on a worker that never runs."""
    w = World(tmp_path)

    def broken(model_id: str, argv: list[str], log_path: Path) -> FakeProcess:
        process = World._spawn(w, model_id, argv, log_path)
        process.start_error = OSError("no such file: python")
        return process

    w.router.spawn = broken
    with pytest.raises(errors.ModelLoadFailed, match="could not start the worker"):
        await now(w.router.acquire("m"))
    assert "m" not in w.router.workers


# --- TTL and memory pressure ---------------------------------------------------------------


@scenario
async def test_ttl_evicts_an_idle_worker_but_never_a_leased_or_pinned_one(tmp_path: Path) -> None:
    """Catches: TTL counted from load instead of from the last lease's end; TTL evicting busy or pinned workers."""
    specs = [ModelSpec("m", tmp_path), ModelSpec("p", tmp_path, pinned=True)]
    w = World(tmp_path, models=specs, default_ttl_s=10.0, housekeeping_s=0.5)
    w.ready("p")  # pinned: started by the router itself
    lease = await w.load("m")
    w.clock.advance(60.0)  # far past the TTL, while leased
    await settle()
    assert w.worker("m").state is State.READY, "TTL evicted a leased worker"
    lease.release()
    w.clock.advance(9.5)
    await settle()
    assert w.worker("m").state is State.READY, "TTL counted from before the lease ended"
    w.clock.advance(1.0)
    await settle()
    worker = w.worker("m")
    assert worker.state is State.EVICTING and worker.evict_reason == "ttl"
    assert w.transport.to(worker, Evict) == [Evict(mode="drain", deadline_s=w.settings.evict_timeout_s)]
    assert w.worker("p").state is State.READY, "TTL evicted a pinned worker"
    assert w.router.model_status("p").ttl_remaining_s is None


@scenario
async def test_soft_pressure_stops_the_spare_and_evicts_an_idle_worker_not_a_busy_one(tmp_path: Path) -> None:
    """Catches: soft pressure that spares the spare, or takes a worker a request holds."""
    w = World(tmp_path, spare_workers=1)
    w.stand_by()
    busy = await w.load("m")  # handed to the spare; a new spare is spawned behind it
    idle = await w.load("n")
    idle.release()
    w.clock.advance(1.0)
    await settle()
    assert w.worker("m").state is State.READY and w.worker("n").state is State.READY  # no pressure yet
    standing = w.router.spare
    assert standing is not None
    w.memory.available = 80 * MIB  # 92% in use: soft
    w.clock.advance(w.settings.housekeeping_s)
    await settle()
    assert w.router.spare is None and cast(FakeProcess, standing.process).stops == [(0.0, w.settings.kill_timeout_s)], \
        "the spare was not stopped first"
    assert w.worker("n").state is State.EVICTING and w.worker("n").evict_reason == "pressure-soft"
    assert w.transport.to(w.worker("n"), Evict)[0].mode == "drain"
    assert w.worker("m").state is State.READY, "soft pressure took a busy worker"
    busy.release()


@scenario
async def test_hard_pressure_aborts_the_least_recently_used_busy_worker(tmp_path: Path) -> None:
    """Catches: hard pressure that waits on busy workers, drains instead of aborting, or picks the wrong one."""
    w = World(tmp_path)
    older = await w.load("m")
    w.clock.advance(1.0)
    newer = await w.load("n")
    w.memory.available = 20 * MIB  # 98% in use: hard
    w.clock.advance(w.settings.housekeeping_s)
    await settle()
    assert w.worker("m").state is State.EVICTING and w.worker("m").evict_reason == "pressure-hard"
    assert w.transport.to(w.worker("m"), Evict) == [Evict(mode="now", deadline_s=w.settings.evict_timeout_s)]
    assert w.worker("n").state is State.READY
    older.release()
    newer.release()


# --- admission under concurrent acquires ---------------------------------------------------


@scenario
async def test_admission_decided_while_a_request_is_routed_does_not_take_its_worker(tmp_path: Path) -> None:
    """The acquire-vs-evict race: a second model's admission decides, in the very turn the first
    worker becomes ready and before its request resumes, what to evict to make room.
    Catches: the waiter's lease on a loading worker (Router.acquire) removed."""
    w = World(tmp_path, memory_ceiling_bytes=150 * MIB)  # room for exactly one 100 MiB worker
    first = asyncio.ensure_future(w.router.acquire("m"))
    await asyncio.sleep(0)  # the request picks m and starts its load
    worker = w.worker("m")
    assert worker.state is State.LOADING
    second = asyncio.ensure_future(w.router.acquire("n"))  # scheduled ahead of the first request's wake-up
    w.ready("m")
    await asyncio.sleep(0)  # n decides its admission before m's request resumes
    assert worker.state is State.READY, "admission evicted a worker a request was routed to"
    lease = await now(first)
    assert lease.worker is worker and worker.leases == 1
    assert pending(second) and worker.state is State.READY  # m is busy: n waits for it, m's request goes on
    lease.release()
    await settle()
    assert worker.state is State.EVICTING  # idle now: admission takes it for the waiting request
    second.cancel()


@scenario
async def test_concurrent_requests_for_a_cold_model_share_one_worker(tmp_path: Path) -> None:
    """Catches: a second worker started for a model whose first is still loading."""
    w = World(tmp_path)
    waiting = [asyncio.ensure_future(w.router.acquire("m")) for _ in range(3)]
    await settle()
    assert len(w.processes) == 1
    assert w.worker("m").leases == 3  # each waiter holds the loading worker
    w.ready("m")
    leases = await now(asyncio.gather(*waiting))
    assert {lease.worker for lease in leases} == {w.worker("m")} and w.worker("m").leases == 3
    for lease in leases:
        lease.release()
    assert w.worker("m").leases == 0


@scenario
async def test_admission_evicts_the_idle_lru_worker_and_starts_only_once_it_is_gone(tmp_path: Path) -> None:
    """Catches: a load started before the evicted worker's memory is back (two models over the ceiling)."""
    w = World(tmp_path, memory_ceiling_bytes=150 * MIB)
    (await w.load("m")).release()
    acquiring = asyncio.ensure_future(w.router.acquire("n"))
    await settle()
    evicted = w.worker("m")
    assert evicted.state is State.EVICTING and evicted.evict_reason == "admission"
    assert "n" not in w.router.workers, "started before the evicted worker was gone"
    fake(evicted).exit(0)
    await settle()
    assert "m" not in w.router.workers and w.worker("n").state is State.LOADING
    w.ready("n")
    (await now(acquiring)).release()


@scenario
async def test_a_load_that_cannot_fit_is_refused_with_what_is_loaded(tmp_path: Path) -> None:
    """Catches: a refusal that evicts busy workers, or gives no reason."""
    w = World(tmp_path, [ModelSpec("m", tmp_path, weights_bytes=100 * MIB, pinned=True),
                         ModelSpec("n", tmp_path, weights_bytes=100 * MIB)], memory_ceiling_bytes=150 * MIB)
    await settle()
    w.ready("m")
    lease = await now(w.router.acquire("m"))
    with pytest.raises(errors.InsufficientMemory, match=r"Loaded: m \(ready, busy, pinned"):
        await now(w.router.acquire("n"))
    assert w.worker("m").state is State.READY
    lease.release()


@scenario
async def test_admission_counts_what_a_models_config_says_a_first_request_needs(tmp_path: Path) -> None:
    """Catches: an estimate of the weights alone, which let a model whose KV and logits cannot fit start anyway."""
    w = World(tmp_path, [ModelSpec("m", tmp_path, weights_bytes=100 * MIB, runtime_bytes=950 * MIB)])
    with pytest.raises(errors.InsufficientMemory, match="needs about 1050 MiB, ceiling 1000 MiB"):
        await now(w.router.acquire("m"))
    assert w.processes == []


@scenario
async def test_a_loading_worker_that_outgrows_its_memory_is_killed_and_its_waiters_told_why(tmp_path: Path) -> None:
    """Catches: a load measured but never stopped (issue 48: a hostile config's worker at 6 GB under a 2 GiB ceiling,
    its client waiting with no answer); a kill that feeds a respawn loop instead of marking the model failed."""
    w = World(tmp_path, crash_limit=3)  # ceiling 1000 MiB; m: 100 MiB of weights, no overhead
    acquiring = asyncio.ensure_future(w.router.acquire("m"))
    await settle()
    process = w.process("m")
    w.memory.sizes[process.pid or 0] = 900 * MIB  # far past its estimate, but under the ceiling and the margin
    w.clock.advance(w.settings.housekeeping_s)
    await settle()
    assert process.signals == [] and pending(acquiring)
    w.memory.sizes[process.pid or 0] = 1001 * MIB
    w.clock.advance(w.settings.housekeeping_s)
    await settle()
    assert process.signals == ["SIGKILL"]
    why = "its load outgrew its memory: it measures 1001 MiB while loading, past the memory ceiling of 1000 MiB"
    with pytest.raises(errors.ModelLoadFailed, match=why):
        acquiring.result()
    status = w.router.model_status("m")
    assert status.state == "failed" and why in (status.last_error or ""), status
    with pytest.raises(errors.ModelLoadFailed, match="marked failed"):
        await now(w.router.acquire("m"))
    assert len(w.processes) == 1


@scenario
async def test_a_ready_worker_over_its_estimate_is_not_a_loads_overrun(tmp_path: Path) -> None:
    """Catches: the load rule applied to a worker that finished loading (what it holds then is admission's and
    pressure's to weigh)."""
    w = World(tmp_path)
    (await w.load("m")).release()
    w.memory.sizes[w.process("m").pid or 0] = 1001 * MIB
    w.clock.advance(w.settings.housekeeping_s)
    await settle()
    assert w.process("m").signals == [] and w.worker("m").state is State.READY


@scenario
async def test_a_worker_is_told_the_context_its_kv_can_have_of_the_ceiling(tmp_path: Path) -> None:
    """Catches: a context published from the config alone (max_position_embeddings 2**62 was), with no regard for
    what the model's KV can have of the memory ceiling."""
    specs = [ModelSpec("m", tmp_path, weights_bytes=100 * MIB, kv_bytes_per_token=MIB),
             ModelSpec("n", tmp_path, weights_bytes=100 * MIB)]
    w = World(tmp_path, specs)
    (await w.load("m")).release()
    argv = w.process("m").argv
    assert argv[argv.index("--max-context") + 1] == "900"  # (1000 - 100) MiB of KV at 1 MiB a token
    (await w.load("n")).release()
    assert "--max-context" not in w.process("n").argv  # no KV known: the worker's own cap (MAX_CONTEXT) only


# --- evictions -------------------------------------------------------------------------------


@scenario
async def test_a_second_evict_joins_the_first_and_now_tightens_a_drain(tmp_path: Path) -> None:
    """Catches: a second evict starting a second sequence (two stops, two reports), or a `now` ignored mid-drain."""
    w = World(tmp_path)
    lease = await w.load("m")
    stream = lease.submit(Submit("r1", max_tokens=8, prompt="hi"))
    worker, process = w.worker("m"), w.process("m")
    w.memory.sizes[process.pid or 0] = 123 * MIB
    draining = asyncio.ensure_future(w.router.evict("m", "drain", 10.0))
    await settle()
    tightening = asyncio.ensure_future(w.router.evict("m", "now"))
    await settle()
    assert w.transport.to(worker, Evict) == [Evict(mode="drain", deadline_s=10.0), Evict(mode="now", deadline_s=0)]
    assert process.stops == [(10.0 + w.settings.settle_grace_s,
                              policy.kill_timeout(w.settings.kill_timeout_s, w.router.lifecycle.estimate(worker.spec)))]
    assert pending(draining) and pending(tightening)
    w.transport.deliver(worker.identity, Bye("evict", aborted=1, drained=0, phases={"abort": 0.01}, memory_bytes=5))
    process.exit(0)
    await settle()
    first, second = await now(draining), await now(tightening)
    assert first is second
    assert first.evicted and first.mode == "drain" and first.reason == "api" and first.exit == 0
    assert first.memory_before_bytes == 123 * MIB and first.aborted == 1 and first.phases_s == {"abort": 0.01}
    assert w.sample("mlxsup_evictions_total", model="m", reason="api") == 1
    assert isinstance(next_event(stream), errors.ModelEvicted)
    assert w.router.model_status("m").last_eviction is first
    assert (await now(w.router.evict("m"))).to_dict() == {"model": "m", "evicted": False, "reason": "not loaded"}
    lease.release()


@scenario
async def test_evicting_a_loading_worker_skips_the_drain_and_fails_its_waiters(tmp_path: Path) -> None:
    """Catches: an Evict sent to a worker that cannot read it yet (no grace: SIGTERM at once), waiters left hanging."""
    w = World(tmp_path)
    waiting = asyncio.ensure_future(w.router.acquire("m"))
    await settle()
    worker = w.worker("m")
    evicting = asyncio.ensure_future(w.router.evict("m"))
    await settle()
    assert w.transport.to(worker, Evict) == [] and fake(worker).stops == [
        (0.0, policy.kill_timeout(w.settings.kill_timeout_s, w.router.lifecycle.estimate(worker.spec)))]
    fake(worker).exit(0)
    await settle()
    with pytest.raises(errors.ModelEvicted, match="while it was loading"):
        await now(waiting)
    assert (await now(evicting)).evicted
    assert w.sample("mlxsup_crashes_total", model="m") == 0  # an eviction is no crash


# --- shutdown ----------------------------------------------------------------------------------


@scenario
async def test_shutdown_evicts_every_worker_in_parallel_and_refuses_new_work(tmp_path: Path) -> None:
    """Catches: workers or the spare left running at shutdown, new requests admitted meanwhile, the socket left open."""
    w = World(tmp_path, spare_workers=1, shutdown_drain_s=3.0)
    spare = w.router.spare
    assert spare is not None
    lease = await w.load("m")  # the spare has not said Standby: m gets a fresh process
    stream = lease.submit(Submit("r1", max_tokens=8, prompt="hi"))
    asyncio.ensure_future(w.router.acquire("n"))  # n is still loading at shutdown
    await settle()
    shutting = asyncio.ensure_future(w.router.shutdown())
    await settle()
    with pytest.raises(errors.ShuttingDown):
        await now(w.router.acquire("m"))
    assert w.transport.to(w.worker("m"), Evict) == [Evict(mode="drain", deadline_s=3.0)]
    assert w.process("n").stops == [
        (0.0, policy.kill_timeout(w.settings.kill_timeout_s, w.router.lifecycle.estimate(w.worker("n").spec)))]
    assert cast(FakeProcess, spare.process).stops == [(0.0, w.settings.kill_timeout_s)]
    assert pending(shutting)
    for process in w.processes:
        process.exit(0)
    reports = await now(shutting)
    assert sorted(r.model for r in reports) == ["m", "n"] and all(r.reason == "shutdown" for r in reports)
    assert w.router.workers == {} and w.transport.closed
    assert isinstance(next_event(stream), errors.ModelEvicted)
    lease.release()


@scenario
async def test_kill_all_sigkills_every_worker_and_the_spare(tmp_path: Path) -> None:
    """Catches: the forced exit (a second signal) missing a worker or the spare."""
    w = World(tmp_path, spare_workers=1)
    (await w.load("m")).release()
    await settle()
    w.router.kill_all("forced")
    assert all(p.signals == ["SIGKILL"] for p in w.processes) and len(w.processes) == 2


# --- the spare -------------------------------------------------------------------------------


@scenario
async def test_a_load_goes_to_the_spare_on_standby_and_a_new_spare_follows(tmp_path: Path) -> None:
    """Catches: a spawn where a spare stood ready; a spare not replaced; a spare used before it said Standby."""
    w = World(tmp_path, spare_workers=1)
    spare = w.router.spare
    assert spare is not None and w.processes[0].argv[-1] == "--spare"
    w.stand_by()
    acquiring = asyncio.ensure_future(w.router.acquire("m"))
    await settle()
    worker = w.worker("m")
    assert worker.process is spare.process and worker.identity == spare.identity
    loads = w.transport.to(worker, Load)
    args = loads[0].args
    assert len(loads) == 1 and "--model-id" in args and args[args.index("--model-id") + 1] == "m"
    assert w.router.spare is not None and w.router.spare is not spare and len(w.processes) == 2
    w.ready("m")
    (await now(acquiring)).release()


# --- requests with a reply ---------------------------------------------------------------------


@scenario
async def test_a_request_is_answered_through_the_reply_table(tmp_path: Path) -> None:
    """Catches: a reply not routed back to its request; the table keeping answered entries."""
    w = World(tmp_path)
    (await w.load("m")).release()
    clearing = asyncio.ensure_future(w.router.clear_cache("hot", "m"))
    await settle()
    worker = w.worker("m")
    (request,) = w.transport.to(worker, ClearCache)
    assert request.which == "hot" and list(worker.replies) == [request.rid]
    w.transport.deliver(worker.identity, CacheCleared(request.rid, "hot", entries=3, reclaimed_bytes=4096))
    result = await now(clearing)
    assert result["reclaimed_bytes"] == 4096 and result["models"][0] == {
        "model": "m", "loaded": True, "entries": 3, "reclaimed_bytes": 4096}
    assert worker.replies == {}


@scenario
async def test_a_pending_request_fails_when_the_worker_exits_and_is_asked_again(tmp_path: Path) -> None:
    """Catches: a request waiting forever on a worker that exited (the reply table not failed at exit)."""
    w = World(tmp_path)
    (await w.load("m")).release()
    clearing = asyncio.ensure_future(w.router.clear_cache("hot", "m"))
    await settle()
    worker = w.worker("m")
    assert len(worker.replies) == 1
    fake(worker).exit(-signal.SIGKILL)
    await settle()
    assert not pending(clearing), "the request still waits on a worker that is gone"
    assert clearing.result()["models"][0] == {"model": "m", "loaded": False, "entries": 0, "reclaimed_bytes": 0}
    assert worker.replies == {}


@scenario
async def test_a_request_waits_out_a_load_and_times_out_on_the_routers_clock(tmp_path: Path) -> None:
    """Catches: a request sent to a worker still loading; a reply wait without a deadline."""
    w = World(tmp_path)
    acquiring = asyncio.ensure_future(w.router.acquire("m"))
    await settle()
    # the hot tier: an SSD clear first finds the model's directory on a thread (cache_admin), in real time, which
    # a handful of loop turns may not see end (on a loaded machine, never)
    clearing = asyncio.ensure_future(w.router.clear_cache("hot", "m"))
    await settle()
    assert w.transport.to(w.worker("m"), ClearCache) == [], "asked a worker that cannot answer yet"
    w.ready("m")
    await settle()
    assert len(w.transport.to(w.worker("m"), ClearCache)) == 1
    w.clock.advance(60.0)
    await settle()
    assert clearing.result()["models"][0]["error"] == "no answer from the worker in 60s"
    assert w.worker("m").replies == {}
    (await now(acquiring)).release()


@scenario
async def test_an_unreachable_worker_is_reported_not_waited_on(tmp_path: Path) -> None:
    """Catches: a request registered and awaited although it was never sent."""
    w = World(tmp_path)
    (await w.load("m")).release()
    w.transport.unreachable.add(w.worker("m").identity)
    result = await now(w.router.clear_cache("hot", "m"))
    assert result["models"][0]["error"] == "the worker is not reachable" and w.worker("m").replies == {}


# --- a refused worker (another protocol version) -----------------------------------------------

REFUSAL = "protocol version 2, this supervisor speaks 1"


async def refused_while_loading(w: World, model_id: str) -> tuple[Worker, asyncio.Future]:
    """A request starts the model's worker, which is refused; it is reaped only when the test says (as a real
    process is, a moment after its SIGKILL). Returns the worker and the request, which failed."""
    acquiring = asyncio.ensure_future(w.router.acquire(model_id))
    await settle()
    worker = w.worker(model_id)
    fake(worker).reap_later = True
    w.transport.refuse(worker.identity, REFUSAL)
    assert worker.state is State.FAILED, "a refused worker leaves LOADING in the very turn"
    await settle()
    assert "SIGKILL" in fake(worker).signals
    with pytest.raises(errors.ModelLoadFailed, match="refused"):
        acquiring.result()
    return worker, acquiring


@scenario
async def test_a_refused_worker_fails_its_load_at_once_and_the_model_once_it_is_reaped(tmp_path: Path) -> None:
    """Catches: a refused worker left LOADING (its load failed) until it is reaped, so a request in between
    fails on a stale error instead of waiting for its end; a refused model restarted into the same refusal."""
    w = World(tmp_path)
    worker, _ = await refused_while_loading(w, "m")
    assert w.router.model_status("m").state == "failed"
    second = asyncio.ensure_future(w.router.acquire("m"))
    await settle()
    assert pending(second), "a request must wait for the refused worker's end"
    fake(worker).exit(-signal.SIGKILL)
    with pytest.raises(errors.ModelLoadFailed, match="marked failed.*protocol"):
        await now(second)
    assert len(w.processes) == 1, "a worker of another protocol version is refused again: no restart"


@scenario
async def test_a_request_waiting_on_a_refused_load_waits_for_the_workers_end(tmp_path: Path) -> None:
    """Catches: `ask` looping on the refused worker's failed load without ever yielding (the daemon stops
    answering HTTP and signals; the watchdog fails the test)."""
    w = World(tmp_path)
    acquiring = asyncio.ensure_future(w.router.acquire("m"))
    await settle()
    worker = w.worker("m")
    fake(worker).reap_later = True
    clearing = asyncio.ensure_future(w.router.clear_cache("hot", "m"))
    await settle()
    w.transport.refuse(worker.identity, REFUSAL)
    await settle()
    with pytest.raises(errors.ModelLoadFailed, match="refused"):
        acquiring.result()
    assert pending(clearing) and w.transport.to(worker, ClearCache) == []
    fake(worker).exit(-signal.SIGKILL)
    result = await now(clearing)
    assert result["models"][0] == {"model": "m", "loaded": False, "entries": 0, "reclaimed_bytes": 0}


@scenario
async def test_a_load_that_needs_a_refused_workers_memory_waits_until_it_is_reaped(tmp_path: Path) -> None:
    """Catches: a refused worker's memory counted as staying (the load refused for want of memory), or as
    leaving without the load waiting for it (admission deciding "wait" again and again without yielding)."""
    w = World(tmp_path, memory_ceiling_bytes=150 * MIB)
    worker, _ = await refused_while_loading(w, "m")
    loading = asyncio.ensure_future(w.router.acquire("n"))
    await settle()
    assert pending(loading) and "n" not in w.router.workers
    fake(worker).exit(-signal.SIGKILL)
    await settle()
    w.ready("n")
    (await now(loading)).release()
    assert set(w.router.workers) == {"n"}


@scenario
async def test_an_exception_in_a_background_task_is_logged_with_the_tasks_name(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches: a task the router starts and nobody awaits (here the one that starts and watches a worker)
    whose exception is lost."""

    async def broken_start(self: FakeProcess) -> None:
        raise RuntimeError("a bug in start")

    monkeypatch.setattr(FakeProcess, "start", broken_start)
    w = World(tmp_path)
    acquiring = asyncio.ensure_future(w.router.acquire("m"))
    await settle()
    (record,) = [r for r in caplog.records if r.getMessage().startswith("[task] run[m] failed")]
    assert record.levelname == "ERROR" and record.exc_info and isinstance(record.exc_info[1], RuntimeError)
    acquiring.cancel()


# --- messages and states -----------------------------------------------------------------------


def test_every_kind_a_worker_sends_has_a_handler() -> None:
    """Catches: a new worker -> supervisor message that the router would drop as unexpected."""
    to_worker = {"submit", "load", "abort", "evict", "clear_cache", "tokenize", "embed", "rerank", "transcribe",
                 "speak"}
    from_worker = {m.KIND for m in ALL_MESSAGES} - to_worker - {"standby"}  # Standby: the spare's, handled apart
    assert set(Router.HANDLERS) == from_worker


@scenario
async def test_messages_reach_their_streams_and_the_worker_record(tmp_path: Path) -> None:
    """Catches: a handler missing from the table (tokens, finish, heartbeat), or last_seen not kept."""
    w = World(tmp_path, max_resumes=2)  # the token ids are kept for a resume only
    lease = await w.load("m")
    worker = w.worker("m")
    stream = lease.submit(Submit("r1", max_tokens=8, prompt="hi"))
    w.clock.advance(3.0)
    deliver = functools.partial(w.transport.deliver, worker.identity)
    deliver(Tokens([["r1", "Hel", 1, [7]], ["other", "x", 1, [8]], "garbage", ["r1", "", 1, [9], {"reasoning": "hm"}]]))
    deliver(Heartbeat(active=1, waiting=2, batch_size=1, max_batch_size=4, generated_tokens=7, memory_bytes=1))
    deliver(Finished("r1", "lo", "stop", 3, 2))
    assert [next_event(stream), next_event(stream), next_event(stream)] == [
        ("Hel", 1, None), ("", 1, {"reasoning": "hm"}), Finished("r1", "lo", "stop", 3, 2)]
    assert stream.queue.empty() and stream.token_ids == [7, 9]  # what a resume would continue from
    assert worker.last_seen == w.clock.now and worker.streams == {}
    status = w.router.model_status("m").to_dict()
    assert status["queued"] == 2 and status["generated_tokens"] == 7 and status["context_length"] == 8192
    lease.abort("r1")  # finished already: nothing to abort
    assert w.transport.to(worker, Abort) == []
    lease.release()


def test_worker_states_move_only_along_the_written_transitions(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches: an illegal move (a stopped worker made ready again) going unnoticed."""
    async def make() -> Worker:
        return Worker(ModelSpec("m", tmp_path), b"m#1", FakeProcess("m", [], tmp_path, 1),
                      asyncio.get_running_loop().create_future(), 0.0)

    worker = asyncio.run(make())
    worker.move(State.READY)
    worker.move(State.EVICTING)
    worker.move(State.STOPPED)
    with pytest.raises(IllegalTransition):
        worker.move(State.READY)
    monkeypatch.setenv("MLXSUP_STRICT_STATES", "0")
    worker.move(State.LOADING)  # outside the tests: logged loudly, and done
    assert worker.state is State.LOADING and "illegal transition stopped -> loading" in caplog.text
    with pytest.raises(AttributeError):
        worker.state = State.READY  # type: ignore[misc]


@scenario
async def test_a_submit_the_wire_cannot_carry_fails_its_request_with_400(tmp_path: Path) -> None:
    """Behind the gateway's decode checks, the router's one place that sends a request: an unencodable
    value there is the request's fault (400), not a crash of the gateway (500)."""
    w = World(tmp_path)
    lease = await w.load("m")
    stream = lease.submit(Submit(rid="r1", max_tokens=1, prompt="a\udc00b"))
    error = next_event(stream)
    assert isinstance(error, errors.InvalidRequest) and "cannot be sent to the worker" in str(error)
    assert not lease.worker.streams  # nothing waits for an answer that cannot come
    lease.release()


@scenario
async def test_a_question_the_wire_cannot_carry_leaves_no_reply_waiting(tmp_path: Path) -> None:
    """Catches: a reply slot left in the worker's table when sending the question raised (ProtocolError)."""
    from protocol.codec import ProtocolError
    from protocol.messages import Tokenize

    w = World(tmp_path)
    (await w.load("m")).release()
    with pytest.raises(ProtocolError):
        await w.router.ask("m", lambda rid: Tokenize(rid, prompt="x", template_kwargs={"n": 2**70}), 5.0)
    assert w.worker("m").replies == {}


@scenario
async def test_a_question_with_a_silence_limit_waits_while_its_worker_heartbeats(tmp_path: Path) -> None:
    """Catches: an embedding or rerank request's limit was absolute (600 s), so a rerank within the documented
    limits (1,000 documents of 512 tokens) never finished on a slow host: a 504 while the worker worked. With
    `silence`, the limit counts from the worker's last heartbeat (its loop heartbeats between batches), so it ends
    only a question whose worker went quiet; without it, the limit stays absolute (a cache clear)."""
    from protocol.messages import Rerank, Reranked

    w = World(tmp_path)
    (await w.load("m")).release()
    worker = w.worker("m")

    def beat() -> None:
        w.transport.deliver(worker.identity, Heartbeat(1, 0, 0, 0, 0, 1))

    asking = asyncio.ensure_future(w.router.ask("m", lambda rid: Rerank(rid, "q", ["a"]), 10.0, silence=True))
    await settle()
    (request,) = w.transport.to(worker, Rerank)
    for _ in range(12):  # a minute of batches, a heartbeat every 6 s: six times the limit, never 10 s silent
        w.clock.advance(6.0)
        beat()
        await settle()
        assert pending(asking), "timed out while its worker heartbeated"
    w.transport.deliver(worker.identity, Reranked(request.rid, [0.5], 3))
    assert (await now(asking)).scores == [0.5]

    asking = asyncio.ensure_future(w.router.ask("m", lambda rid: Rerank(rid, "q", ["a"]), 10.0, silence=True))
    await settle()
    w.clock.advance(4.0)
    beat()
    w.clock.advance(9.5)  # 13.5 s since it was asked, 9.5 s since the last heartbeat
    await settle()
    assert pending(asking)
    w.clock.advance(0.6)  # 10.1 s of silence
    await settle()
    with pytest.raises(TimeoutError):
        await now(asking)
    assert len(w.transport.to(worker, Abort)) == 1 and worker.replies == {}  # withdrawn from the worker

    absolute = asyncio.ensure_future(w.router.ask("m", lambda rid: Rerank(rid, "q", ["a"]), 10.0))
    await settle()
    for _ in range(2):
        w.clock.advance(6.0)
        beat()
        await settle()
    with pytest.raises(TimeoutError):
        await now(absolute)


@scenario
async def test_a_questions_parts_reach_its_asker_in_order_before_its_reply(tmp_path: Path) -> None:
    """Catches: a SpokenPart dropped (no handler, or no listener), or one for another question delivered here; and a
    listener left in the worker's table once its question is over."""
    from protocol.messages import Speak, Spoken, SpokenPart

    w = World(tmp_path)
    (await w.load("m")).release()
    worker = w.worker("m")
    got: list = []
    asking = asyncio.ensure_future(w.router.ask("m", lambda rid: Speak(rid, "Hi. Yo."), 10.0, silence=True,
                                                on_part=got.append))
    await settle()
    (request,) = w.transport.to(worker, Speak)
    for audio in (b"one", b"two"):
        w.transport.deliver(worker.identity, SpokenPart(request.rid, audio, 24000))
    w.transport.deliver(worker.identity, SpokenPart("someone-else", b"x", 24000))
    await settle()
    assert [p.audio for p in got] == [b"one", b"two"] and pending(asking)
    w.transport.deliver(worker.identity, Spoken(request.rid, b"end", 24000, 3))
    assert (await now(asking)).audio == b"end" and worker.parts == {} and worker.replies == {}
