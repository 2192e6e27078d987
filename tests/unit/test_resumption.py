"""The Resumption (supervisor/resume.py) alone: the lifecycle's events delivered by hand, a fake
core_api.ResumeHost, an `acquire` the test answers, and test_router.py's fake transport and clock; no
Lifecycle, no Router. Each test names, in its docstring, the handling it would catch missing."""

from __future__ import annotations

import asyncio
from pathlib import Path

from protocol.messages import Submit
from supervisor import errors
from supervisor.config import Settings
from supervisor.gateway.metrics import Metrics
from supervisor.lease import Lease
from supervisor.registry import ModelSpec
from supervisor.resume import Resumption
from supervisor.slot import ModelSlot
from supervisor.workers import State, Stream, Worker
from tests.unit.test_router import (  # noqa: F401 - strict_states: its autouse fixture
    FakeClock,
    FakeProcess,
    FakeTransport,
    next_event,
    scenario,
    settle,
    strict_states,
)


class Host:
    """The lifecycle as the Resumption reads it, and the leases' accounting (lease.LeaseHost)."""

    def __init__(self) -> None:
        self.slots = {"m": ModelSlot()}
        self.shutting_down = False
        self.pressure: str | None = None

    def submit(self, lease: Lease, msg: Submit) -> Stream:
        raise AssertionError("a resume sends through Resumption.send, never through a lease")

    def abort(self, lease: Lease, rid: str) -> None:
        raise AssertionError("not used here")

    def lease_ended(self, worker: Worker) -> None:
        worker.leases -= 1


class Alone:
    def __init__(self, tmp_path: Path, max_resumes: int = 2) -> None:
        self.tmp_path = tmp_path
        self.host, self.clock, self.transport = Host(), FakeClock(), FakeTransport()
        self.asked: list[str] = []
        self.next_lease: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        self.resumption = Resumption(Settings(state_dir=tmp_path, max_resumes=max_resumes), host=self.host,
                                     acquire=self._acquire, transport=self.transport, clock=self.clock,
                                     metrics=Metrics())

    async def _acquire(self, model_id: str) -> Lease:
        self.asked.append(model_id)
        return await self.next_lease

    def worker(self, n: int) -> Worker:
        worker = Worker(ModelSpec("m", self.tmp_path), f"m#{n}".encode(), FakeProcess("m", [], None, n),
                        asyncio.get_running_loop().create_future(), 0.0)
        worker.move(State.READY)
        return worker

    def running(self, worker: Worker, rid: str, ids: list[int], resumable: bool = True) -> Stream:
        """A request on `worker` that has streamed the tokens `ids` (with a lease counted there)."""
        worker.leases += 1
        submit = Submit(rid, max_tokens=10, prompt="hi")
        stream = Stream(rid, submit if resumable else None, Lease(self.host, worker))
        self.resumption.send(worker, stream, submit)
        stream.put("x" * len(ids), ids)
        stream.queue.get_nowait()
        return stream


@scenario
async def test_a_crash_suspends_what_may_resume_and_the_next_lease_gets_the_continuation(tmp_path: Path) -> None:
    """Catches: a resumable stream left on the dead worker (it would be failed); a new lease asked for before
    the dead worker is gone; a continuation without its tokens or with the full max_tokens; the dead worker's
    lease still counted."""
    w = Alone(tmp_path)
    dead = w.worker(1)
    stream = w.running(dead, "r1", [5, 6, 7])
    plain = w.running(dead, "r2", [1], resumable=False)
    w.resumption.streams_lost(dead, errors.WorkerDied("gone"), "crash")
    assert dead.streams == {"r2": plain}, "the lifecycle fails what is left: the non-resumable one"
    assert w.resumption.suspension("r1") is not None and dead.leases == 1 and stream.queue.empty()
    await settle()
    assert w.asked == [], "a new worker asked for before the dead one is gone"
    dead.gone.set()
    await settle()
    assert w.asked == ["m"]
    fresh = w.worker(2)
    fresh.leases += 1
    w.next_lease.set_result(Lease(w.host, fresh))
    await settle()
    (continuation,) = w.transport.to(fresh, Submit)
    assert continuation.resume_tokens == [5, 6, 7] and continuation.max_tokens == 7
    assert fresh.streams == {"r1": stream} and stream.lease.worker is fresh and stream.resumes == 1
    assert w.resumption.suspended == {} and w.host.slots["m"].resumed == 1


@scenario
async def test_an_eviction_suspends_nothing_unless_hard_pressure_takes_the_worker(tmp_path: Path) -> None:
    """Catches: an explicit evict or a drain that resumes requests the operator asked to end; a hard-pressure
    eviction that fails resumable requests instead of suspending them."""
    w = Alone(tmp_path)
    worker = w.worker(1)
    stream = w.running(worker, "r1", [5])
    w.resumption.streams_lost(worker, errors.ModelEvicted("evicted"), None)
    w.resumption.evicting(worker, "api")
    assert worker.streams == {"r1": stream} and w.resumption.suspended == {}
    w.resumption.evicting(worker, "pressure-hard")
    assert worker.streams == {} and w.resumption.suspended["r1"].cause == "pressure"


@scenario
async def test_shutdown_and_the_clients_leaving_end_a_suspension_at_once(tmp_path: Path) -> None:
    """Catches: a suspended request that outlives the daemon's shutdown, or keeps waiting (and loads a model)
    for a client that left."""
    w = Alone(tmp_path)
    dead = w.worker(1)
    first, second = w.running(dead, "r1", [5]), w.running(dead, "r2", [6])
    w.resumption.streams_lost(dead, errors.WorkerDied("gone"), "crash")
    assert w.resumption.abandon("r1") and not w.resumption.abandon("r1") and first.queue.empty()
    w.host.shutting_down = True
    w.resumption.shutting_down("the server is shutting down")
    error = next_event(second)
    assert isinstance(error, errors.WorkerDied) and "not resumed: the server is shutting down" in error.message
    dead.gone.set()
    await settle()
    assert w.resumption.suspended == {} and w.asked == [], "a worker acquired for requests that ended"


@scenario
async def test_a_send_to_a_worker_on_its_way_out_fails_or_suspends(tmp_path: Path) -> None:
    """Catches: a request registered on a worker that is being evicted (never answered); an unreachable
    worker's request failed although it may resume on the next one."""
    w = Alone(tmp_path)
    leaving = w.worker(1)
    leaving.move(State.EVICTING)
    stream = Stream("r1", None, Lease(w.host, leaving))
    w.resumption.send(leaving, stream, Submit("r1", max_tokens=4, prompt="hi"))
    assert isinstance(next_event(stream), errors.ModelEvicted) and leaving.streams == {}
    unreachable = w.worker(2)
    w.transport.unreachable.add(unreachable.identity)
    resumable = w.running(unreachable, "r2", [])
    assert unreachable.streams == {} and w.resumption.suspension("r2") is not None and resumable.queue.empty()
    w.resumption.shutting_down("done")
