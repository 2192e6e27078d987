"""The acquire-vs-evict race, decided deterministically on one event loop.

A request waiting on a model's load must hold that worker against idle eviction from the
moment it chose it. Here a second model's admission decides, in the very turn the first
worker becomes ready and before its request resumes, what to evict to make room. Remove the
waiter's lease in Router.acquire and this test fails: the admission takes the worker.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from protocol.messages import Ready
from supervisor.config import Settings
from supervisor.errors import InsufficientMemory
from supervisor.registry import ModelSpec, Registry
from supervisor.router import Router, State


def test_admission_decided_while_a_request_is_routed_does_not_take_its_worker(tmp_path: Path) -> None:
    async def scenario() -> None:
        # room for exactly one worker: each is estimated at 100 bytes, the ceiling is 150
        settings = Settings(state_dir=tmp_path, memory_ceiling_bytes=150, worker_overhead_bytes=100, spare_workers=0,
                            pressure_soft=1.0, pressure_hard=1.0)
        specs = {"m": ModelSpec("m", tmp_path), "n": ModelSpec("n", tmp_path)}
        router = Router(Registry(specs), settings, tmp_path)
        router._run = lambda worker: asyncio.sleep(0)  # no process: this test drives the worker by hand
        try:
            await drive(router)
        finally:
            await router.transport.close()

    async def drive(router: Router) -> None:
        first = asyncio.create_task(router.acquire("m"))
        await asyncio.sleep(0)  # the request picks m and starts its load
        worker = router.workers["m"]
        assert worker.state is State.LOADING
        second = asyncio.create_task(router.acquire("n"))  # scheduled ahead of the first request's wake-up
        router._on_ready(worker, Ready("m", 1, 8192, 10, 1, 1, 0.1))
        await asyncio.sleep(0)  # n decides its admission before m's request resumes
        assert worker.state is State.READY, "admission evicted a worker a request was routed to"
        with pytest.raises(InsufficientMemory):
            await second  # m is busy: no room for n
        lease = await first
        assert lease.worker is worker and worker.leases == 1
        lease.release()
        third = asyncio.create_task(router.acquire("n"))
        await asyncio.sleep(0)
        assert worker.state is State.EVICTING  # idle now: admission may take it
        third.cancel()
        worker.evicting.cancel()

    asyncio.run(scenario())
