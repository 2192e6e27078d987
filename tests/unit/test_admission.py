"""Admission (supervisor/admission.py) alone, against a fake core_api.AdmissionHost and test_router.py's fake
clock: no Lifecycle, no Router. Each test names, in its docstring, the handling it would catch missing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from supervisor import errors, policy
from supervisor.admission import Admission, Busy
from supervisor.config import Settings
from supervisor.registry import ModelSpec
from supervisor.slot import ModelSlot
from supervisor.workers import State, Worker
from tests.unit.test_router import MIB, FakeClock, FakeProcess, scenario, settle, strict_states  # noqa: F401


class FakeHost:
    """The lifecycle as admission sees it: workers of a given size, and the starts and evictions asked for."""

    def __init__(self, tmp_path: Path, ceiling: int = 1000 * MIB, max_loaded: int | None = None) -> None:
        self.settings = Settings(state_dir=tmp_path, max_loaded_models=max_loaded)
        self.workers: dict[str, Worker] = {}
        self.ceiling = ceiling
        self.started: list[str] = []
        self.evicted: list[tuple[str, str, str]] = []
        self.tmp_path = tmp_path

    def estimate(self, spec: ModelSpec) -> int:
        return spec.weights_bytes

    def views(self) -> list[policy.WorkerView]:
        return [policy.WorkerView(w.spec.id, w.state.value, w.spec.weights_bytes, w.leases > 0, w.spec.pinned,
                                  w.last_used) for w in self.workers.values()]

    def start_worker(self, spec: ModelSpec) -> Worker:
        self.started.append(spec.id)
        return self.add(spec.id, spec.weights_bytes)

    def begin_evict(self, worker: Worker, mode: str, timeout_s: float | None, reason: str) -> asyncio.Task:
        self.evicted.append((worker.spec.id, mode, reason))
        worker.move(State.EVICTING)
        return asyncio.ensure_future(worker.gone.wait())

    def add(self, model_id: str, size: int, state: State = State.READY, pinned: bool = False) -> Worker:
        spec = ModelSpec(model_id, self.tmp_path, weights_bytes=size, pinned=pinned)
        worker = Worker(spec, model_id.encode(), FakeProcess(model_id, [], None, 1),
                        asyncio.get_running_loop().create_future(), 0.0)
        if state is not State.LOADING:
            worker.move(state)
        self.workers[model_id] = worker
        return worker


def spec(tmp_path: Path, size: int) -> ModelSpec:
    return ModelSpec("new", tmp_path, weights_bytes=size)


@scenario
async def test_a_model_that_fits_starts_in_the_deciding_turn(tmp_path: Path) -> None:
    """Catches: an await between the decision and the start (another request could take the room meanwhile)."""
    host = FakeHost(tmp_path)
    host.add("old", 500 * MIB)
    starting = Admission(host, FakeClock()).start(spec(tmp_path, 400 * MIB), ModelSlot())
    with pytest.raises(StopIteration) as done:  # it finished in its first step: no await on the way
        starting.send(None)
    assert isinstance(done.value.value, Worker) and host.started == ["new"] and host.evicted == []


@scenario
async def test_a_failed_model_is_refused_at_once_and_a_backoff_is_waited_out(tmp_path: Path) -> None:
    """Catches: a model marked failed started again; a restart that does not wait out its back-off."""
    host, clock = FakeHost(tmp_path), FakeClock()
    admission = Admission(host, clock)
    failed = ModelSlot(failed_until=clock.now + 30, last_error="boom")
    with pytest.raises(errors.ModelLoadFailed, match="marked failed"):
        await admission.start(spec(tmp_path, 1), failed)
    waiting = asyncio.ensure_future(admission.start(spec(tmp_path, 1), ModelSlot(backoff_until=clock.now + 2)))
    await settle()
    assert not waiting.done()
    clock.advance(2)
    await settle()
    assert waiting.result() is None and host.started == [], "after a wait the caller decides again"


@scenario
async def test_room_is_made_by_evicting_the_idle_lru_and_waiting_for_its_end(tmp_path: Path) -> None:
    """Catches: a start before the evicted worker's memory is back; a busy worker evicted; a second eviction
    while one is already on its way out."""
    host = FakeHost(tmp_path)
    older, newer, busy = host.add("older", 300 * MIB), host.add("newer", 300 * MIB), host.add("busy", 300 * MIB)
    older.last_used, newer.last_used, busy.leases = 1.0, 2.0, 1
    admission = Admission(host, FakeClock())
    making_room = asyncio.ensure_future(admission.start(spec(tmp_path, 300 * MIB), ModelSlot()))
    await settle()
    assert host.evicted == [("older", "drain", "admission")] and not making_room.done()
    again = asyncio.ensure_future(admission.start(spec(tmp_path, 300 * MIB), ModelSlot()))
    await settle()
    assert len(host.evicted) == 1 and not again.done(), "evicted more while memory was on its way back"
    older.gone.set()
    del host.workers["older"]
    await settle()
    assert making_room.result() is None and again.result() is None and host.started == []


@scenario
async def test_what_cannot_fit_is_refused_with_what_is_missing(tmp_path: Path) -> None:
    """Catches: a load that can never fit (a pinned model holds the room) left waiting, or refused without saying what
    is loaded and missing."""
    host = FakeHost(tmp_path)
    host.add("kept", 600 * MIB, pinned=True).leases = 1
    with pytest.raises(errors.InsufficientMemory) as refused:
        await Admission(host, FakeClock()).start(spec(tmp_path, 500 * MIB), ModelSlot())
    assert refused.value.extra["missing_bytes"] == 100 * MIB
    assert "kept (ready, busy, pinned, 600 MiB)" in refused.value.message
    assert host.started == [] and host.evicted == []


@scenario
async def test_what_fits_once_busy_workers_idle_is_told_whom_to_wait_for(tmp_path: Path) -> None:
    """Catches: a load refused (507) while the room it needs is held by requests that will end, or a busy worker
    evicted under its requests to make that room."""
    host = FakeHost(tmp_path)
    host.add("busy", 600 * MIB).leases = 1
    assert await Admission(host, FakeClock()).start(spec(tmp_path, 500 * MIB), ModelSlot()) == Busy(("busy",))
    assert host.started == [] and host.evicted == []
