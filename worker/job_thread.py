"""One job at a time on a thread of its own, its result collected by the thread that started it. Pure: no MLX.

The worker's main thread bounds a GPU step: it builds MLX's graph in Python, then launches its kernels in
`mx.async_eval`, which releases the GIL for more than half of the step. Only then can a second Python thread run
beside it. Two kinds of work use that window: a batch's text (text_thread.py) and a lone request's next decode graph
(mlx_engine/solo.py). Each has its own JobThread.

`start(fn, *args)` hands over one call; `collect()` waits for its result, or raises on the caller's thread what the
call raised. Invariants: at most one job is in flight (`pending`); `close` ends the thread, dropping a result not
collected, and waits at most its timeout for a job that hangs (the thread is a daemon: the process's exit ends it).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

Job = tuple[Callable[..., Any], tuple[Any, ...]]


class JobThread:
    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.pending = False  # a job was started and not collected

    def start(self, fn: Callable[..., Any], *args: Any) -> None:
        assert not self.pending, "one job at a time"
        if self._thread is None:  # each thread has queues of its own: one left to a hung job keeps its own
            self._jobs, self._results = queue.SimpleQueue(), queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, args=(self._jobs, self._results), name=self.name,
                                            daemon=True)
            self._thread.start()
        self.pending = True
        self._jobs.put((fn, args))

    def collect(self) -> Any:
        assert self.pending, "no job started"
        self.pending = False
        ok, result = self._results.get()
        if not ok:
            raise result
        return result

    def close(self, timeout_s: float = 5.0) -> None:
        """End the thread (a job in flight is finished first, its result dropped); a job that does not end within
        timeout_s is left to the process's exit."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout_s)
        self.pending = False

    @staticmethod
    def _run(jobs: queue.SimpleQueue[Job | None], results: queue.SimpleQueue[tuple[bool, Any]]) -> None:
        while (job := jobs.get()) is not None:
            fn, args = job
            try:
                results.put((True, fn(*args)))
            except BaseException as exc:  # the collector raises it, where the work would have; it never waits forever
                results.put((False, exc))
