"""The router's effects on the world, as interfaces: messages, worker processes, memory, time, metrics.

The router and the collaborators it owns (lifecycle.py, resume.py, admission.py) touch the world
only through these, all passed to the Router's constructor, which hands each collaborator the ones
it needs: daemon.py wires the real ones (the ZeroMQ transport, `python -m worker` subprocesses,
psutil, the system clock, the gateway's Prometheus metrics); tests/unit/test_router.py wires fakes
and drives crashes, loads, evictions and time by hand, in milliseconds (test_lifecycle.py,
test_resumption.py and test_admission.py drive each collaborator alone). How the collaborators
call each other is core_api.py's.

Invariant: nothing here decides anything. These are the verbs; the decisions are the router's
and policy.py's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from signal import Signals
from typing import Protocol

from protocol.messages import Message

Handler = Callable[[bytes, Message], None]  # (worker identity, message): must not await
Refusal = Callable[[bytes, str], None]  # (worker identity, why): a frame of another protocol version


class Messenger(Protocol):
    """Messages to and from workers by identity (transport.Transport: a ZeroMQ ROUTER socket)."""

    endpoint: str  # what a worker connects to

    def start(self, on_message: Handler, on_refused: Refusal) -> None: ...

    def send(self, identity: bytes, msg: Message) -> bool:
        """Send without waiting; False when the worker is not reachable."""
        ...

    async def close(self) -> None: ...


class WorkerHandle(Protocol):
    """One worker OS process as the router drives it (process.WorkerProcess is the real one)."""

    returncode: int | None
    exited: asyncio.Event  # set once the process has been reaped (never before) and its output read

    @property
    def pid(self) -> int | None: ...

    @property
    def stderr_tail(self) -> Sequence[str]: ...

    async def start(self) -> None:
        """Spawn it; OSError when that fails (then `exited` is set)."""
        ...

    def assign(self, model_id: str, log_path: Path | None) -> None:
        """A spare became this model's worker: label and log it as that model's from now on."""
        ...

    def signal(self, sig: Signals, why: str | None = None) -> None: ...

    async def kill_after_stack_dump(self, timeout_s: float, why: str) -> None:
        """SIGKILL once the worker's Python stacks are in its log, or after `timeout_s`."""

    async def stop(self, grace_s: float, kill_timeout_s: float) -> dict:
        """The kill ladder (wait for its own exit, SIGTERM, SIGKILL), reaped: {"exit", "signals", ...}."""
        ...


Spawn = Callable[..., WorkerHandle]
"""(model id, argv, log path[, group=GroupSpec]) -> a handle on a worker process (or on every rank of a
worker group, supervisor/group.py), not started yet."""


class MemoryProbe(Protocol):
    """This machine's memory (memory.py, the module itself, is the real one)."""

    def footprint(self, pid: int) -> int | None: ...

    def system_available(self) -> int: ...

    def system_total(self) -> int: ...

    def wired(self, pid: int) -> int | None: ...  # macOS: the process's wired memory; None elsewhere

    def system_wired(self) -> int | None: ...  # macOS: the host's wired memory; None elsewhere


class Clock(Protocol):
    """Time as the router reads and waits on it: TTLs, back-offs, hang detection, housekeeping."""

    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class _Count(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class _Observe(Protocol):
    def observe(self, amount: float) -> None: ...


class _Counter(Protocol):
    def labels(self, *values: str) -> _Count: ...


class _Histogram(Protocol):
    def labels(self, *values: str) -> _Observe: ...


class LifecycleMetrics(Protocol):
    """What the router counts (gateway/metrics.py's Metrics is the real one; the gateway owns the rest)."""

    @property
    def loads(self) -> _Counter: ...  # labels: model, outcome ("ok" | "failed")

    @property
    def load_seconds(self) -> _Histogram: ...  # labels: model

    @property
    def evictions(self) -> _Counter: ...  # labels: model, reason

    @property
    def crashes(self) -> _Counter: ...  # labels: model

    @property
    def suspensions(self) -> _Counter: ...  # labels: model, cause (crash | hang | pressure)

    @property
    def resumes(self) -> _Counter: ...  # labels: model, outcome (resumed | failed)

    @property
    def resume_pause(self) -> _Histogram: ...  # labels: model

    @property
    def queue_wait(self) -> _Histogram: ...  # labels: model

    @property
    def queue_refused(self) -> _Counter: ...  # labels: model, why (full | timeout)
