"""The supervisor's view of worker processes: states, handles, request streams (the model's state that outlives
one process is its slot: slot.py). Plain data with small invariants; the router and the
collaborators it owns (router.py, lifecycle.py, resume.py) are the only code that mutates them, on
its one event loop.

A worker's state changes only through `Worker.move`, called only by lifecycle.py, along TRANSITIONS (written down below).
Any other move is a bug: it is logged as an error and, with MLXSUP_STRICT_STATES=1 (the test
suite sets it), raises IllegalTransition.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol.messages import Bye, CacheStats, Heartbeat, Progress, Pulse, Ready, Submit
from supervisor import errors
from supervisor.effects import WorkerHandle
from supervisor.registry import ModelSpec

log = logging.getLogger(__name__)


class State(enum.StrEnum):
    LOADING = "loading"
    READY = "ready"
    EVICTING = "evicting"
    STOPPED = "stopped"
    FAILED = "failed"


TRANSITIONS: dict[State, frozenset[State]] = {
    State.LOADING: frozenset({State.READY, State.EVICTING, State.FAILED}),  # Ready; an evict; it died, or was refused
    State.READY: frozenset({State.EVICTING, State.FAILED}),  # an evict; a crash, or refused
    State.EVICTING: frozenset({State.STOPPED}),  # reaped (however it ended: an evicted worker is not failed)
    State.STOPPED: frozenset(),  # a stopped or failed worker is done; the model's next one is a new Worker
    State.FAILED: frozenset(),  # a refused worker is FAILED from its refusal on; it is reaped in that state
}


class IllegalTransition(RuntimeError):
    """A worker asked to move where TRANSITIONS does not allow: a bug in the router."""


class EventQueue(asyncio.Queue):
    """A stream's queue that can also wake one shared waiter (a request of several choices reads all of its
    streams with one Event instead of a task per stream and token)."""

    waker: asyncio.Event | None = None

    def put_nowait(self, item: Any) -> None:
        super().put_nowait(item)
        if self.waker is not None:
            self.waker.set()


class Stream:
    """One request's events, in order: (text, n_tokens, extras) tuples, then a Finished or an error.

    It outlives the worker it started on when the request is resumed (supervisor/resume.py): it
    keeps what a continuation needs, the Submit as the client sent it and the ids of every token
    whose text went into the queue, and how often it was resumed already.
    """

    __slots__ = ("rid", "queue", "submit", "lease", "token_ids", "resumes", "paused_at")

    def __init__(self, rid: str, submit: Submit | None = None, lease: Any = None) -> None:
        self.rid = rid
        self.queue: EventQueue = EventQueue()
        self.submit = submit  # None: not resumable
        self.lease = lease  # the lease.Lease its request holds (moved to the next worker on a resume)
        self.token_ids: list[int] = []
        self.resumes = 0
        self.paused_at: float | None = None  # set while suspended and until the first event after its resume

    def put(self, text: str, ids: list[int], extra: dict | None = None) -> None:
        """Output for the client (answer text, typed extras) and the ids of the tokens behind it (kept for a resume)."""
        if self.submit is not None:
            self.token_ids.extend(ids)
        self.queue.put_nowait((text, len(ids), extra))

    def fail(self, error: errors.MlxsupError) -> None:
        self.queue.put_nowait(error)



@dataclass(eq=False)
class Worker:
    spec: ModelSpec
    identity: bytes
    process: WorkerHandle
    ready: asyncio.Future  # Ready, or the error that ended the load
    started_at: float  # the router's clock, as are last_used and last_seen
    _state: State = field(default=State.LOADING, init=False)
    info: Ready | None = None
    streams: dict[str, Stream] = field(default_factory=dict)
    replies: dict[str, asyncio.Future] = field(default_factory=dict)  # request rid -> its reply (router.ask)
    parts: dict[str, Callable[[Any], None]] = field(default_factory=dict)  # rid -> its asker's parts (router.ask)
    leases: int = 0
    last_used: float = field(init=False)  # the end of its last lease, or its start
    last_seen: float = field(init=False)  # any message: the loop is turning
    heartbeat: Heartbeat | None = None
    heartbeat_at: float | None = None  # when the last Heartbeat came (the router's clock): its loop turned
    bye: Bye | None = None
    cache: CacheStats | None = None
    evicting: asyncio.Task | None = None
    evict_reason: str | None = None
    kill_reason: str | None = None  # why the supervisor killed it (hang, load timeout)
    step_started: float | None = None  # when it last announced a long step (StepStarted) ...
    step_predicted_s: float = 0.0  # ... and that step's predicted duration
    pulse: Pulse | None = None  # its watchdog's last word: a long loop turn, computing (worker/watchdog.py)
    killing: asyncio.Task | None = None  # the hang kill: stacks dumped, then SIGKILL
    progress: Progress = field(default_factory=lambda: Progress("starting", 0.0))
    # an API's keep_alive for this worker (Ollama's): its idle TTL in seconds, < 0 kept loaded as if pinned until an
    # explicit evict; None: the model's own (Lifecycle.ttl, Lifecycle.pinned). It ends with the worker.
    keep_alive: float | None = None
    drafted: int = 0  # speculative decoding over its life: tokens drafted, and kept (its Finished messages)
    accepted: int = 0
    progressed: asyncio.Event = field(default_factory=asyncio.Event)  # replaced after each set
    gone: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.last_used = self.last_seen = self.started_at

    @property
    def state(self) -> State:
        return self._state

    def move(self, to: State) -> None:
        """The one place a worker's state changes; a move TRANSITIONS does not allow is a bug."""
        if to not in TRANSITIONS[self._state]:
            log.error("[state] model=%s pid=%s illegal transition %s -> %s: a bug, please report it",
                      self.spec.id, self.pid, self._state.value, to.value)
            if os.environ.get("MLXSUP_STRICT_STATES") == "1":
                raise IllegalTransition(f"{self.spec.id}: {self._state.value} -> {to.value}")
        self._state = to

    @property
    def pid(self) -> int | None:
        return self.process.pid


@dataclass(eq=False)
class Spare:
    """A worker process with its imports paid, on standby until a model is handed to it."""

    identity: bytes
    process: WorkerHandle
    standing_by: bool = False  # it said Standby: a Load now is served at once
