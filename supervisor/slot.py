"""One model's state in the supervisor: its worker, what outlives a worker, and the requests waiting for it.

A ModelSlot is made once per model id (Lifecycle.slot) and never replaced; the Router and its collaborators
(router.py, lifecycle.py, resume.py, admission.py) are the only code that mutates it, on the one event loop.
- `worker`: the model's current worker process (None: none runs). A worker's own state is workers.Worker's.
- the record: starts, crashes, the last error and exit, the crash rules' back-off and failed mark, resume counts,
  stranded memory: what status shows of the model whatever its worker.
- the wait queue: the requests waiting for the model (Router.acquire) in arrival order: for a load, for room to
  load (admission waiting for busy workers to idle), for a swap, for a place on its worker (`running_limit`).
  Bounded in count (`max_queued_requests`: one more is refused, 429) and in time (`queue_timeout_s`: 503), both
  with a Retry-After from the waits it saw.
- `yield_to`: the waiters of other models that wait for this model's worker to idle (admission chose it): from the
  first of them on, a request for this model that arrived later waits too instead of taking a lease, so a model
  that keeps getting requests cannot starve another's; those that came before it are served.
- owed (`owed`): while a request queued for the model came before every waiter in `yield_to`, its worker is not idle
  (Lifecycle.views): a Ready, or a place freed, reaches the model's own waiters before another model's waiter may
  evict it, however the loop orders their wake-ups.
"""

from __future__ import annotations

import asyncio
import collections
import math
from dataclasses import dataclass, field

from supervisor.config import Settings
from supervisor.reports import EvictReport
from supervisor.workers import Worker

WAIT_EWMA = 0.2  # the weight of a new wait in the slot's mean wait (Retry-After)


@dataclass(eq=False)
class Waiter:
    """A request waiting in a slot's queue: its arrival order (over all models) and time (the router's clock), and
    the slots of other models it waits for to idle (it is in their `yield_to`)."""

    seq: int
    since: float
    waits_for: list[ModelSlot] = field(default_factory=list)
    what: str = "its turn"  # what it waits for now (a timeout says it)
    count: int = 1  # the places it takes on the worker (a request's choices, taken together)


class Changes:
    """What a queued request waits for between its decisions: something that may let it on happened (a lease
    ended, a worker became ready or is gone, a waiter left a queue). Each `fire` wakes every waiter once."""

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None

    def fire(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self) -> None:
        if self._event is None:
            self._event = asyncio.Event()
        await self._event.wait()


@dataclass(eq=False)
class ModelSlot:
    worker: Worker | None = None
    # the record: what outlives one worker process
    starts: int = 0
    crashes: int = 0
    last_error: str | None = None
    last_exit: int | None = None
    last_stderr: list[str] = field(default_factory=list)
    last_eviction: EvictReport | None = None
    recent_crashes: collections.deque = field(default_factory=collections.deque)  # monotonic times
    failed_until: float = 0.0  # crash loop or failed load: refuse to start before this
    backoff_until: float = 0.0  # after a crash: wait before the next start
    suspended: int = 0  # requests suspended when a worker ended under them (supervisor/resume.py), in all
    resumed: int = 0  # ... resumed on a later worker
    resume_failed: int = 0  # ... failed after all (the bounds, a crash loop, the deadline, shutdown)
    stranded_bytes: int = 0  # wired memory its last worker's exit did not give back (stranded.py; macOS)
    # the wait queue
    queue: list[Waiter] = field(default_factory=list)  # arrival order
    yield_to: set[Waiter] = field(default_factory=set)  # other models' waiters waiting for this worker to idle
    mean_wait_s: float = 0.0  # of the waits that ended with a lease (an exponential mean)
    refused: int = 0  # requests refused by the queue's bounds (full, or waited too long), in all

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

    # --- the wait queue -----------------------------------------------------------------

    def may_take(self, seq: int, waiter: Waiter | None) -> bool:
        """May the request of arrival `seq` (queued as `waiter`, or not queued) take a lease on the ready worker now:
        no request queued before it still waits, and no other model's waiter came before it to wait for this worker."""
        if self.yield_to and seq > min(w.seq for w in self.yield_to):
            return False
        return not any(queued.seq < seq for queued in self.queue if queued is not waiter)

    def owed(self) -> bool:
        """A request queued for the model goes before every other model's waiter for its worker (may_take's turn):
        the worker is theirs to take, not idle, until they have their leases."""
        first_other = min((w.seq for w in self.yield_to), default=math.inf)
        return any(queued.seq < first_other for queued in self.queue)

    def waited(self, seconds: float) -> None:
        self.mean_wait_s += WAIT_EWMA * (seconds - self.mean_wait_s) if self.mean_wait_s else seconds

    def retry_after_s(self) -> int:
        """A client refused by the queue may try again after about one mean wait (at least a second)."""
        return max(1, math.ceil(self.mean_wait_s))

    def oldest_wait_s(self, now: float) -> float:
        return max((now - w.since for w in self.queue), default=0.0)
