"""A batch's text, made on a thread of its own while the main thread launches the next step's kernels. Pure: no MLX.

On a GPU the worker's main thread bounds a batch's step: it builds and launches MLX's kernels, then does the
worker's own work for every row (the detokenizer, stop strings, the output parser: ~10 us a row a step on the GPU
host, a third of the worker's own time at 32 streams, `python -m bench.worker_cpu`). MLX's launch (`async_eval`)
releases the GIL for more than half of the step, and only then can a second Python thread run beside it
(job_thread.py). So the engine hands the rows' tokens of one step to this thread just before it launches the next
step, and collects their chunks after that launch: each chunk goes out one step later, and the launch hides its
making.

`start(job)` hands over [(RequestOutput, [token, ...]), ...]; `collect()` waits for one result per entry, in order:
(chunk or None, how many tokens were pushed, whether a stop string ended the text). A row's tokens are pushed in
order until a stop string ends its text (the rest are not pushed; `pushed` says how many were), and a row that did
not stop has its chunk taken (RequestOutput.take). An exception from a push is raised by `collect()`, on the caller's
thread. Invariants: at most one job is in flight; between `start` and `collect` the caller touches none of the job's
outputs; outputs with logprobs are never handed over (their entries read MLX arrays, on the main thread only).
"""

from __future__ import annotations

from typing import cast

from worker.job_thread import JobThread
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


class TextThread(JobThread):
    def __init__(self) -> None:
        super().__init__("mlxsup-text")

    def start(self, job: Job) -> None:  # type: ignore[override]
        super().start(make_text, job)

    def collect(self) -> list[Result]:
        return cast(list[Result], super().collect())
