"""The narrow interfaces between the supervisor core's collaborators, all in one place.

The Router (router.py) owns three collaborators and wires them to each other through these
Protocols, never by inheritance and never by importing one another (tests/unit/test_layout.py
checks that lifecycle.py, resume.py and admission.py import none of the others):

    Lifecycle (lifecycle.py)  --LifecycleEvents-->  Resumption (resume.py)
    Resumption                --ResumeHost------->  Lifecycle (slots, pressure, shutting down)
    Admission (admission.py)  --AdmissionHost---->  Lifecycle (memory views, start, evict)
    Lease (lease.py)          --LeaseHost-------->  Router (submit, abort, the lease's end)

Invariant: every call named here is synchronous and never awaits, so a caller's check-then-act
decision stays within one loop turn whichever collaborator acts.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from supervisor import errors, policy
from supervisor.config import Settings
from supervisor.registry import ModelSpec
from supervisor.slot import ModelSlot
from supervisor.workers import Worker


class LifecycleEvents(Protocol):
    """What the lifecycle tells its listener (the Router's Resumption), in the turn it happens."""

    def streams_lost(self, worker: Worker, error: errors.MlxsupError, cause: str | None) -> None:
        """The worker ended under its requests. `cause` (crash | hang) names an end the clients did not
        ask for, None an eviction. The listener takes the streams it keeps out of `worker.streams`; the
        lifecycle then fails every one left there with `error`."""

    def evicting(self, worker: Worker, reason: str) -> None:
        """The worker is about to be marked evicting for `reason` (called once per worker, before the move)."""

    def shutting_down(self, why: str) -> None:
        """The daemon stops: nothing waits for a worker any more."""


class NoEvents:
    """The listener of a lifecycle nobody listens to (tests of the lifecycle alone): the streams fail."""

    def streams_lost(self, worker: Worker, error: errors.MlxsupError, cause: str | None) -> None:
        pass

    def evicting(self, worker: Worker, reason: str) -> None:
        pass

    def shutting_down(self, why: str) -> None:
        pass


class ResumeHost(Protocol):
    """What the Resumption may read of the lifecycle; of a model's slot it writes only its own counters
    (suspended, resumed, resume_failed)."""

    slots: dict[str, ModelSlot]

    @property
    def shutting_down(self) -> bool: ...

    @property
    def pressure(self) -> str | None:
        """The memory pressure level the last housekeeping saw (None | soft | hard)."""
        ...


class AdmissionHost(Protocol):
    """What admission may read and do of the lifecycle: the memory picture, a start, an eviction."""

    settings: Settings

    @property
    def workers(self) -> dict[str, Worker]: ...

    @property
    def ceiling(self) -> int: ...

    def estimate(self, spec: ModelSpec) -> int: ...

    def views(self) -> list[policy.WorkerView]: ...

    def start_worker(self, spec: ModelSpec) -> Worker: ...

    def begin_evict(self, worker: Worker, mode: str, timeout_s: float | None, reason: str) -> asyncio.Task: ...
