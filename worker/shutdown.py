"""The worker's shutdown, owned in one place: who may ask for it, what it does, how the process ends.

Three things ask for an exit, from three places: an Evict message (the loop calls `on_evict`),
SIGTERM (its handler calls `on_sigterm`) and the supervisor gone (the lifeline thread calls
`on_parent_gone` when stdin reaches EOF). The signal handler and the lifeline only set an event.
Everything else runs on the loop's thread: the loop asks `keep_running()` at every turn (vLLM's
`while self._handle_shutdown()` in `vllm/v1/engine/core.py`), and when it says no, calls `finish()`.

The sequence: stop admitting -> abort every request (`now`), or let them finish until the
deadline and then abort the rest (`drain`) -> close caches -> settle -> Bye -> the exit code.

Invariants:
- Once an exit is requested no request is admitted (`admitting` is False); it is never withdrawn.
- Every request still in the engine when aborting is due gets Failed(model_evicted), so its
  client sees an error, never a cut stream.
- Which request wins: a lost parent overrides anything before it (in `now` mode; nobody is left
  to hear a Bye, so none is sent and the exit code is EXIT_PARENT_GONE); SIGTERM starts a `now`
  exit unless one is under way; a second Evict in `now` mode tightens a drain; any other later
  request is ignored.
- Each phase is timed; a failing closing phase is logged and the next one still runs, and the
  Bye still goes out (best-effort teardown).
- If the loop has not got the process out PARENT_GONE_GRACE_S after a lost parent, the
  lifeline ends it hard: a worker never outlives its supervisor for long.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from protocol.messages import EXIT_OK, EXIT_PARENT_GONE, MODEL_EVICTED, Bye, Message
from worker.engine_api import EngineApi

log = logging.getLogger(__name__)

PARENT_GONE_GRACE_S = 5.0
EVICT, SIGTERM, PARENT_GONE = "evict", "sigterm", "parent_gone"  # an exit's reason, as Bye carries it

Send = Callable[[Message], None]
T = TypeVar("T")


@dataclass
class ExitRecord:
    """One requested exit: what asked for it, how, until when, and what it has done so far."""

    reason: str
    mode: str  # "now" or "drain"
    deadline: float  # clock time by which draining gives way to aborting
    started: float
    aborted: int = 0
    drained: int = 0
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    drain_started: float | None = None


class Shutdown:
    """The worker's exit: requested from any thread, carried out on the loop's."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.exit: ExitRecord | None = None
        self._sigterm = threading.Event()
        self._parent_gone = threading.Event()

    # --- from a signal handler or the lifeline thread: set an event, nothing else --------

    def on_sigterm(self) -> None:
        self._sigterm.set()

    def on_parent_gone(self) -> None:
        self._parent_gone.set()

    def signalled(self) -> bool:
        """SIGTERM or a lost parent (a spare on standby asks this; a serving loop asks keep_running)."""
        return self._sigterm.is_set() or self._parent_gone.is_set()

    # --- on the loop's thread ------------------------------------------------------------

    @property
    def admitting(self) -> bool:
        return self.exit is None

    def on_evict(self, mode: str, deadline_s: float) -> None:
        if self.exit is None:
            self._begin(EVICT, mode, deadline_s)
        elif mode == "now":
            self.exit.mode = "now"  # a second, harder evict tightens the first

    def keep_running(self, engine: EngineApi, send: Send) -> bool:
        """Asked at every turn: act on the signals, abort what is due; False once the exit can run."""
        self._take_signals()
        if self.exit is None:
            return True
        if len(engine) and (self.exit.mode == "now" or self.clock() >= self.exit.deadline):
            self._abort_all(engine, send)
        return len(engine) > 0

    def note_finished(self, n: int) -> None:
        """Requests that finished by themselves; during an exit, they count as drained."""
        if self.exit is None or not n:
            return
        if self.exit.drain_started is None:
            self.exit.drain_started = self.clock()
        self.exit.drained += n

    def finish(self, engine: EngineApi, send: Send, model_id: str) -> int:
        """Once the engine is empty: close the caches, settle, say Bye (unless the parent is gone); the exit code."""
        record = self.exit
        assert record is not None and not len(engine), "finish() runs once keep_running() said no"
        if record.drain_started is not None:
            record.phases["drain"] = self.clock() - record.drain_started
        self._run_phase("close_caches", engine.close_caches, model_id)
        memory = self._run_phase("settle", engine.settle, model_id) or 0
        record.phases["total"] = self.clock() - record.started
        bye = Bye(reason=record.reason, aborted=record.aborted, drained=record.drained,
                  phases=record.phases, memory_bytes=memory)
        log.info("[evict] model=%s phase=bye reason=%s aborted=%d drained=%d phases=%s", model_id,
                 bye.reason, bye.aborted, bye.drained, {k: round(v, 4) for k, v in bye.phases.items()})
        if record.reason == PARENT_GONE:
            return EXIT_PARENT_GONE
        send(bye)
        return EXIT_OK

    def _run_phase(self, name: str, phase: Callable[[], T], model_id: str) -> T | None:
        """One closing phase, timed; a failure is logged and yields None, and the sequence goes on."""
        assert self.exit is not None
        t0 = self.clock()
        try:
            return phase()
        except Exception:
            log.exception("[evict] model=%s phase=%s failed; going on", model_id, name)
            return None
        finally:
            self.exit.phases[name] = self.clock() - t0

    def _begin(self, reason: str, mode: str, deadline_s: float) -> None:
        now = self.clock()
        self.exit = ExitRecord(reason=reason, mode=mode, deadline=now + max(0.0, deadline_s), started=now)

    def _take_signals(self) -> None:
        if self._parent_gone.is_set():
            if self.exit is None:
                self._begin(PARENT_GONE, "now", 0)
            elif self.exit.reason != PARENT_GONE:
                self.exit.reason, self.exit.mode = PARENT_GONE, "now"  # nobody is left to drain for
        elif self._sigterm.is_set() and self.exit is None:
            self._begin(SIGTERM, "now", 0)

    def _abort_all(self, engine: EngineApi, send: Send) -> None:
        assert self.exit is not None
        t0 = self.clock()
        failed = engine.fail_all(MODEL_EVICTED,
                                 f"the model was evicted ({self.exit.reason}) before the request finished")
        for f in failed:
            send(f)
        self.exit.aborted += len(failed)
        self.exit.phases["abort"] = self.exit.phases.get("abort", 0.0) + self.clock() - t0


def install_signal_handlers(shutdown: Shutdown) -> None:
    """SIGTERM asks for the exit; SIGINT is ignored (the supervisor owns Ctrl-C and orders our exit)."""
    signal.signal(signal.SIGTERM, lambda *_: shutdown.on_sigterm())
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def watch_lifeline(shutdown: Shutdown) -> None:
    """Watch stdin, a pipe the supervisor never writes: at EOF the supervisor is gone, even by SIGKILL."""

    def run() -> None:
        try:  # the raw fd, not sys.stdin: a buffered reader's lock would block interpreter exit
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        shutdown.on_parent_gone()
        timer = threading.Timer(PARENT_GONE_GRACE_S, os._exit, args=(EXIT_PARENT_GONE,))
        timer.daemon = True
        timer.name = "lifeline-grace"
        timer.start()

    threading.Thread(target=run, name="lifeline", daemon=True).start()


def leave(code: int) -> None:
    """Exit without interpreter and GPU teardown: the orderly part is done (Bye sent, caches closed),
    and process exit is the hard unload. Tearing down MLX's CUDA context alone took 1.3-1.5 s."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_best_effort(what: str, steps: list[tuple[str, Callable[[], object]]]) -> list[str]:
    """Run every step even when one fails (logged with `what`); return the names of the failed ones."""
    failed = []
    for name, step in steps:
        try:
            step()
        except Exception:
            log.exception("[close] %s step=%s failed; going on", what, name)
            failed.append(name)
    return failed
