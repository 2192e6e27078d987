"""The supervisor's view of worker processes: states, handles, request streams, leases, and the
per-model record that outlives one process. Plain data with small invariants; the router
(router.py) is the only code that mutates them, on its one event loop.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protocol.messages import Bye, CacheStats, Finished, Heartbeat, Progress, Ready, Submit
from supervisor import errors
from supervisor.config import Settings
from supervisor.process import WorkerProcess
from supervisor.registry import ModelSpec

if TYPE_CHECKING:
    from supervisor.router import Router


class State(enum.StrEnum):
    LOADING = "loading"
    READY = "ready"
    EVICTING = "evicting"
    STOPPED = "stopped"
    FAILED = "failed"


class Stream:
    """One request's events, in order: (text, n_tokens) tuples, then a Finished or an error."""

    __slots__ = ("rid", "queue")

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.queue: asyncio.Queue = asyncio.Queue()

    def fail(self, error: errors.MlxsupError) -> None:
        self.queue.put_nowait(error)

    async def events(self) -> AsyncIterator[tuple[str, int] | Finished]:
        while True:
            item = await self.queue.get()
            if isinstance(item, errors.MlxsupError):
                raise item
            yield item
            if isinstance(item, Finished):
                return


@dataclass(eq=False)
class Worker:
    spec: ModelSpec
    identity: bytes
    ready: asyncio.Future
    process: WorkerProcess | None = None
    state: State = State.LOADING
    info: Ready | None = None
    streams: dict[str, Stream] = field(default_factory=dict)
    leases: int = 0
    started_at: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    heartbeat: Heartbeat | None = None
    bye: Bye | None = None
    cache: CacheStats | None = None
    clears: dict[str, asyncio.Future] = field(default_factory=dict)  # ClearCache rid -> its CacheCleared
    evicting: asyncio.Task | None = None
    evict_reason: str | None = None
    kill_reason: str | None = None  # why the supervisor killed it (hang, load timeout)
    last_seen: float = field(default_factory=time.monotonic)  # any message: the loop is turning
    step_started: float | None = None  # when it last announced a long step (StepStarted) ...
    step_predicted_s: float = 0.0  # ... and that step's predicted duration
    killing: asyncio.Task | None = None  # the hang kill: stacks dumped, then SIGKILL
    progress: Progress = field(default_factory=lambda: Progress("starting", 0.0))
    progressed: asyncio.Event = field(default_factory=asyncio.Event)  # replaced after each set
    gone: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None


@dataclass
class ModelRecord:
    """What outlives one worker process of a model: counts and the last error, for status."""

    starts: int = 0
    crashes: int = 0
    last_error: str | None = None
    last_exit: int | None = None
    last_stderr: list[str] = field(default_factory=list)
    last_eviction: dict | None = None
    recent_crashes: collections.deque = field(default_factory=collections.deque)  # monotonic times
    failed_until: float = 0.0  # crash loop or failed load: refuse to start before this
    backoff_until: float = 0.0  # after a crash: wait before the next start

    def note_crash(self, now: float, settings: Settings, load_failed: bool) -> None:
        self.crashes += 1
        self.recent_crashes.append(now)
        while self.recent_crashes and now - self.recent_crashes[0] > settings.crash_window_s:
            self.recent_crashes.popleft()
        n = len(self.recent_crashes)
        self.backoff_until = now + min(settings.restart_backoff_s * 2 ** (n - 1), settings.restart_backoff_max_s)
        if load_failed or n >= settings.crash_limit:
            self.failed_until = now + settings.crash_cooldown_s
            why = "the model failed to load" if load_failed else f"{n} crashes within {settings.crash_window_s:.0f}s"
            self.last_error = f"{why}; marked failed: {self.last_error}"

    def clear(self) -> None:
        self.failed_until = self.backoff_until = 0.0
        self.recent_crashes.clear()


@dataclass(eq=False)
class Spare:
    """A worker process with its imports paid, on standby until a model is handed to it."""

    identity: bytes
    process: WorkerProcess
    standing_by: bool = False  # it said Standby: a Load now is served at once


class Lease:
    """A request's claim on a worker, taken when routed and released when its response ends."""

    def __init__(self, router: "Router", worker: Worker) -> None:
        self._router = router
        self.worker = worker
        self.released = False

    def submit(self, msg: Submit) -> Stream:
        return self._router._submit(self.worker, msg)

    def abort(self, rid: str) -> None:
        self._router._abort(self.worker, rid)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.worker.leases -= 1
            self.worker.last_used = time.monotonic()


