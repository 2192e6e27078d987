"""The kill ladder (supervisor/ladder.py) against real short-lived child processes, alone and as a group's ranks.

Each child tells on stderr once its SIGTERM handling is in place; the test waits for that line, never a
fixed time. Every test proves its children gone.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import psutil

from supervisor.group import GroupHost, GroupProcess, GroupSpec
from supervisor.ladder import kill_ladder
from supervisor.process import WorkerProcess

# exits on its own a moment after it is ready: while the ladder is already waiting for it
EXITS_SOON = "import sys, time; print('ready', file=sys.stderr, flush=True); time.sleep(0.5); sys.exit(0)"
# stdin is the lifeline the supervisor never writes: reading it blocks for as long as the test runs
WAITS = "import sys; print('ready', file=sys.stderr, flush=True); sys.stdin.read()"
DEAF_TO_SIGTERM = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + WAITS
HANG_GUARD_S = 60.0  # only so that a broken ladder fails the test instead of hanging it


async def _until(ready: Callable[[], bool]) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not ready():
        assert time.monotonic() < deadline, "the child never said it was ready"
        await asyncio.sleep(0.01)


def _gone(pid: int | None) -> bool:
    return pid is not None and (not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)


@asynccontextmanager
async def _child(code: str) -> AsyncIterator[WorkerProcess]:
    proc = WorkerProcess("ladder-test", [sys.executable, "-c", code])
    await proc.start()
    try:
        await _until(lambda: "ready" in proc.stderr_tail)
        yield proc
    finally:
        proc.signal(signal.SIGKILL, "test cleanup")
        await proc.exited.wait()
        assert _gone(proc.pid)


@asynccontextmanager
async def _group(code: str) -> AsyncIterator[GroupProcess]:
    here = GroupHost("", "127.0.0.1")
    group = GroupProcess("ladder-group", GroupSpec(ranks=2, hosts=(here, here)), [sys.executable, "-c", code])
    await group.start()
    try:
        await _until(lambda: all("ready" in r.stderr_tail for r in group.ranks))
        yield group
    finally:
        group.signal(signal.SIGKILL, "test cleanup")
        await group.exited.wait()
        assert all(_gone(r.pid) for r in group.ranks)


def test_a_child_that_exits_on_its_own_gets_no_signal() -> None:
    asyncio.run(_a_child_that_exits_on_its_own_gets_no_signal())


async def _a_child_that_exits_on_its_own_gets_no_signal() -> None:
    async with _child(EXITS_SOON) as proc:
        await asyncio.wait_for(kill_ladder(proc, HANG_GUARD_S, HANG_GUARD_S, "test"), HANG_GUARD_S * 3)
        assert proc.signals_sent == []
        assert proc.returncode == 0
        assert proc.exited.is_set()


def test_a_child_that_obeys_sigterm_gets_no_sigkill() -> None:
    asyncio.run(_a_child_that_obeys_sigterm_gets_no_sigkill())


async def _a_child_that_obeys_sigterm_gets_no_sigkill() -> None:
    async with _child(WAITS) as proc:
        await asyncio.wait_for(kill_ladder(proc, 0.05, HANG_GUARD_S, "test"), HANG_GUARD_S * 3)
        assert proc.signals_sent == ["SIGTERM"]
        assert proc.returncode == -signal.SIGTERM
        assert proc.exited.is_set()


def test_a_child_deaf_to_sigterm_gets_sigkill_with_the_ladder_as_its_reason() -> None:
    asyncio.run(_a_child_deaf_to_sigterm_gets_sigkill_with_the_ladder_as_its_reason())


async def _a_child_deaf_to_sigterm_gets_sigkill_with_the_ladder_as_its_reason() -> None:
    async with _child(DEAF_TO_SIGTERM) as proc:
        await asyncio.wait_for(kill_ladder(proc, 0.05, 0.2, "test"), HANG_GUARD_S)
        assert proc.signals_sent == ["SIGTERM", "SIGKILL"]
        assert proc.returncode == -signal.SIGKILL
        assert proc.kill_reason is not None and proc.kill_reason.startswith("the kill ladder")
        assert proc.exited.is_set()


def test_a_worker_process_stop_is_the_ladder_and_reports_it() -> None:
    asyncio.run(_a_worker_process_stop_is_the_ladder_and_reports_it())


async def _a_worker_process_stop_is_the_ladder_and_reports_it() -> None:
    async with _child(DEAF_TO_SIGTERM) as proc:
        res = await asyncio.wait_for(proc.stop(0.05, 0.2), HANG_GUARD_S)
        assert res["signals"] == ["SIGTERM", "SIGKILL"] and res["exit"] == -signal.SIGKILL


def test_a_group_whose_ranks_exit_on_their_own_gets_no_signal() -> None:
    asyncio.run(_a_group_whose_ranks_exit_on_their_own_gets_no_signal())


async def _a_group_whose_ranks_exit_on_their_own_gets_no_signal() -> None:
    async with _group(EXITS_SOON) as group:
        res = await asyncio.wait_for(group.stop(HANG_GUARD_S, HANG_GUARD_S), HANG_GUARD_S * 3)
        assert res["signals"] == [] and res["ranks"] == [0, 0] and res["exit"] == 0


def test_a_group_deaf_to_sigterm_gets_sigterm_at_rank_0_then_sigkill_everywhere() -> None:
    asyncio.run(_a_group_deaf_to_sigterm_gets_sigterm_at_rank_0_then_sigkill_everywhere())


async def _a_group_deaf_to_sigterm_gets_sigterm_at_rank_0_then_sigkill_everywhere() -> None:
    async with _group(DEAF_TO_SIGTERM) as group:
        res = await asyncio.wait_for(group.stop(0.05, 0.2), HANG_GUARD_S)
        # the group's own watch may SIGKILL a rank again once the other's SIGKILL is reaped: only the order counts
        assert group.ranks[0].signals_sent[:2] == ["SIGTERM", "SIGKILL"]
        assert set(group.ranks[1].signals_sent) == {"SIGKILL"}
        assert res["signals"] == ["SIGKILL", "SIGTERM"]
        # not each rank's exit: a second SIGKILL to a rank already dead but not yet reaped is reaped by Popen's
        # poll in send_signal, and asyncio then reports that rank's exit as 255 (a race of process.py, not the ladder)
        assert res["exit"] == -signal.SIGKILL and all(rc is not None for rc in res["ranks"])
