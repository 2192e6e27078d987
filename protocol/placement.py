"""CPU lists and pinning a whole process to them: the supervisor pins itself and tells its workers where to run.

On a host whose GPU does the model's work, a worker's main thread launches every step's kernels and is on its CPU the
whole time; the daemon's relay (ZeroMQ's I/O thread, the event loop, the HTTP writes) wakes once per token per
stream, and when the scheduler puts it on the worker's CPUs, that CPU's caches are cold for the next launch. The
supervisor (supervisor/placement.py) keeps its threads on a CPU of their own and hands its workers the rest through
their command line; both sides read the lists with `parse_cpus` and pin with `pin_process`. Linux only (where
`os.sched_setaffinity` exists): macOS has no CPU affinity, and there every call here is a no-op.
"""

from __future__ import annotations

import os

CAN_PIN = hasattr(os, "sched_setaffinity")


def parse_cpus(spec: str) -> set[int]:
    """'0-2,5' -> {0, 1, 2, 5}; ValueError for anything else, or an empty list."""
    cpus: set[int] = set()
    for part in spec.split(","):
        a, sep, b = part.strip().partition("-")
        lo, hi = int(a), int(b) if sep else int(a)
        if lo < 0 or hi < lo:
            raise ValueError(f"not a CPU range: {part!r}")
        cpus.update(range(lo, hi + 1))
    if not cpus:
        raise ValueError("no CPUs")
    return cpus


def format_cpus(cpus: set[int]) -> str:
    """{0, 1, 2, 5} -> '0-2,5'."""
    runs: list[str] = []
    for cpu in sorted(cpus):
        if runs and int(runs[-1].rpartition("-")[2]) == cpu - 1:
            runs[-1] = f"{runs[-1].partition('-')[0]}-{cpu}"
        else:
            runs.append(str(cpu))
    return ",".join(runs)


def allowed_cpus() -> set[int] | None:
    """The CPUs this process may run on, or None where that cannot be set."""
    return set(os.sched_getaffinity(0)) if CAN_PIN else None


def pin_process(cpus: set[int]) -> int:
    """Every thread of this process onto `cpus` (threads it starts later inherit it from their starter); how many
    threads were pinned (0 where pinning is not possible, or `cpus` are not this process's to use). A thread that
    ends meanwhile is skipped."""
    if not CAN_PIN:
        return 0
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    pinned = 0
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            pinned += 1
        except OSError:  # it ended (ProcessLookupError), or a CPU is outside this process's cgroup (EINVAL)
            pass
    return pinned
