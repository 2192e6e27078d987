"""A batch's text, made on a thread of its own while the main thread launches the next step's kernels. Pure: no MLX.

On a GPU the worker's main thread bounds a batch's step: it builds and launches MLX's kernels, then does the
worker's own work for every row (the detokenizer, stop strings, the output parser: ~10 us a row a step on the GPU
host, a third of the worker's own time at 32 streams, `python -m bench.worker_cpu`). MLX's launch (`async_eval`)
releases the GIL for more than half of the step, and only then can a second Python thread run beside it. So the
engine hands the rows' tokens of one step to this thread just before it launches the next step, and collects
their chunks after that launch: each chunk goes out one step later, and the launch hides its making.

`start(job)` hands over [(RequestOutput, [token, ...]), ...]; `collect()` waits for one result per entry, in order:
(chunk or None, how many tokens were pushed, whether a stop string ended the text). A row's tokens are pushed in
order until a stop string ends its text (the rest are not pushed; `pushed` says how many were), and a row that did
not stop has its chunk taken (RequestOutput.take). An exception from a push is raised by `collect()`, on the caller's
thread. Invariants: at most one job is in flight; between `start` and `collect` the caller touches none of the job's
outputs; outputs with logprobs are never handed over (their entries read MLX arrays, on the main thread only).
"""

from __future__ import annotations

import queue
import threading

from worker.request_output import RequestOutput

Job = list[tuple[RequestOutput, list[int]]]
Result = tuple[list | None, int, bool]  # (chunk, tokens pushed, stopped)


def make_text(job: Job) -> list[Result]:
    """What a job's rows say: its work, on whichever thread runs it."""
    results: list[Result] = []
    for out, tokens in job:
        pushed = 0
        for token in tokens:
            out.push(token)
            pushed += 1
            if out.stopped:
                break
        results.append((None if out.stopped else out.take(), pushed, out.stopped))
    return results


class TextThread:
    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[list[Result] | Exception] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.pending = False  # a job was started and not collected

    def start(self, job: Job) -> None:
        assert not self.pending, "one job at a time"
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mlxsup-text", daemon=True)
            self._thread.start()
        self.pending = True
        self._jobs.put(job)

    def collect(self) -> list[Result]:
        assert self.pending, "no job started"
        self.pending = False
        result = self._results.get()
        if isinstance(result, Exception):
            raise result
        return result

    def close(self, timeout_s: float = 5.0) -> None:
        """End the thread (a job in flight is finished first, its result dropped); a job that does not end within
        timeout_s is left to the process's exit (the thread is a daemon)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout_s)
        self._results = queue.SimpleQueue()  # a dropped result is not the next job's
        self.pending = False

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._results.put(make_text(job))
            except Exception as exc:  # the main thread raises it, where the step would have
                self._results.put(exc)
