"""The worker's orderly exit: stop admitting -> abort or drain -> close caches -> settle -> bye.

A small state machine driven by the worker loop; it never blocks. Invariants: once a shutdown
is requested no new request is admitted; every request still in the engine when the drain
deadline passes (at once in `now` mode) gets Failed(model_evicted); each phase is timed, and a
failing phase is logged and does not stop the next one (best-effort teardown).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol.messages import MODEL_EVICTED, Bye, Failed

log = logging.getLogger(__name__)


@dataclass
class Shutdown:
    reason: str
    mode: str
    deadline: float  # time.monotonic() by which draining gives way to aborting
    started: float = field(default_factory=time.monotonic)
    aborted: int = 0
    drained: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    _drain_started: float | None = None

    @classmethod
    def request(cls, reason: str, mode: str, deadline_s: float) -> "Shutdown":
        return cls(reason=reason, mode=mode, deadline=time.monotonic() + max(0.0, deadline_s))

    def must_abort(self) -> bool:
        return self.mode == "now" or time.monotonic() >= self.deadline

    def abort_all(self, fail_all: Callable[[str, str], list[Failed]]) -> list[Failed]:
        t0 = time.monotonic()
        failed = fail_all(MODEL_EVICTED, f"the model was evicted ({self.reason}) before the request finished")
        self.aborted += len(failed)
        self.phases["abort"] = self.phases.get("abort", 0.0) + time.monotonic() - t0
        return failed

    def note_drained(self, n: int) -> None:
        if self._drain_started is None:
            self._drain_started = time.monotonic()
        self.drained += n

    def finish(self, close_caches: Callable[[], None], settle: Callable[[], int]) -> Bye:
        """Run the closing phases once the engine is empty; return the Bye to send."""
        if self._drain_started is not None:
            self.phases["drain"] = time.monotonic() - self._drain_started
        memory = 0
        for name, step in (("close_caches", close_caches), ("settle", settle)):
            t0 = time.monotonic()
            try:
                result = step()
                if name == "settle":
                    memory = int(result)
            except Exception:
                log.exception("[evict] phase=%s failed; going on", name)
            self.phases[name] = time.monotonic() - t0
        self.phases["total"] = time.monotonic() - self.started
        return Bye(reason=self.reason, aborted=self.aborted, drained=self.drained,
                   phases=self.phases, memory_bytes=memory)


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
