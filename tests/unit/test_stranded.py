"""Item 9 of issue 48: what a worker's exit did not give back. The worker releases in order before it exits
(mlx_engine/release.py, with a fake MLX and the real Engine); the supervisor measures the wired memory no live worker
holds after every exit (stranded.py) through the platform seam's fake (tests/unit/test_router.py's FakeMemory): a fake
that strands memory is reported (evict's report, status, /metrics) and counted (the ceiling, crash restarts backed
off); one that does not is not."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from protocol.messages import Bye
from supervisor.reports import EvictReport
from supervisor.stranded import MIN_TOLERANCE, Stranded
from tests.unit.test_router import MIB, World, now, scenario, settle
from worker.mlx_engine.release import STEPS, release

GIB = 1024 * MIB
HELD = 800 * MIB  # what the worker wires (Metal's buffers): past the tolerance, below the test's ceiling


def test_release_synchronizes_then_drops_then_clears_in_that_order() -> None:
    calls: list[str] = []

    class FakeMx:
        def synchronize(self) -> None:
            calls.append("synchronize")

        def clear_cache(self) -> None:
            calls.append("clear_cache")

    done = release(lambda: calls.append("drop"), FakeMx())
    assert calls == ["synchronize", "drop", "clear_cache"] and done == list(STEPS)


def test_an_engine_settles_with_every_reference_dropped(model_dir: Path) -> None:
    from worker.mlx_engine.engine import Engine

    engine = Engine(model_dir / "tiny")
    engine.settle()
    assert engine.released == list(STEPS)
    assert engine.model is None and engine.gen is None and engine.caches is None  # nothing keeps MLX buffers alive


def test_wired_memory_above_its_lowest_by_more_than_the_tolerance_is_stranded() -> None:
    s = Stranded(tolerance=MIN_TOLERANCE)
    assert s.measure(None, 0) == 0 and s.bytes == 0  # no figure on this platform: nothing measured
    assert s.measure(10 * GIB, 0) == 0 and s.baseline == 10 * GIB
    assert s.measure(30 * GIB, 20 * GIB) == 0  # a worker holds what is above the baseline
    assert s.measure(30 * GIB, 0) == 20 * GIB and s.bytes == 20 * GIB  # it is gone, its memory is not
    assert s.measure(10 * GIB + MIN_TOLERANCE // 2, 0) == 0 and s.bytes == 0  # given back (within the noise)
    assert s.measure(8 * GIB, 0) == 0 and s.baseline == 8 * GIB  # the system wires less now: the new baseline


async def _evicted(tmp_path: Path, strands: bool) -> tuple[World, tuple[EvictReport, int]]:
    w = World(tmp_path, restart_backoff_s=0.5, restart_backoff_max_s=60.0)
    w.memory.total = 16 * GIB  # the tolerance: 512 MiB
    w.memory.available = 15 * GIB
    w.memory.host_wired = 2 * GIB
    lease = await w.load("m")
    lease.release()
    worker, process = w.worker("m"), w.process("m")
    w.memory.wired_sizes[process.pid or 0] = HELD
    w.memory.host_wired = 2 * GIB + HELD
    ceiling = w.router.lifecycle.ceiling
    evicting = await_later(w.router.evict("m", "drain", 1.0))
    await settle()
    w.transport.deliver(worker.identity, Bye("evict", aborted=0, drained=0, phases={}, memory_bytes=1))
    if not strands:
        w.memory.host_wired = 2 * GIB
    del w.memory.wired_sizes[process.pid or 0]
    process.exit(0)
    await settle()
    report = await now(evicting)
    return w, (report, ceiling)


def await_later(coro: Coroutine[Any, Any, EvictReport]) -> asyncio.Future:
    return asyncio.ensure_future(coro)


@scenario
async def test_an_exit_that_strands_wired_memory_is_reported_and_counted(tmp_path: Path) -> None:
    w, (report, ceiling) = await _evicted(tmp_path, strands=True)
    assert report.stranded_bytes == HELD
    status = w.router.status()
    assert status.stranded_bytes == HELD and status.to_dict()["stranded_bytes"] == HELD
    assert w.router.lifecycle.ceiling == ceiling - HELD  # admission does not count on it
    # a crash while it persists: the restart waits out the longest back-off, not the first
    lease = await w.load("m")
    lease.release()
    w.process("m").exit(1)
    await settle()
    record = w.router.lifecycle.slots["m"]
    assert record.backoff_until - w.clock.monotonic() >= w.settings.restart_backoff_max_s - 1e-9


@scenario
async def test_an_exit_that_gives_everything_back_strands_nothing(tmp_path: Path) -> None:
    w, (report, ceiling) = await _evicted(tmp_path, strands=False)
    assert report.stranded_bytes == 0
    assert w.router.status().stranded_bytes == 0 and w.router.lifecycle.ceiling == ceiling
    lease = await w.load("m")
    lease.release()
    w.process("m").exit(1)
    await settle()
    record = w.router.lifecycle.slots["m"]
    assert record.backoff_until - w.clock.monotonic() <= w.settings.restart_backoff_s + 1e-9
