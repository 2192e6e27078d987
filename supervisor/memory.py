"""Per-process memory footprint, measured from outside the process.

The platform seam: on macOS the physical footprint (what Activity Monitor shows and what
jetsam acts on) via `proc_pid_rusage`; elsewhere psutil's RSS. On macOS also wired memory, the host's and each
process's (supervisor/stranded.py: what an exit did not give back); elsewhere None. (USS was tried: it depends on
how many other workers share the same libraries at that moment, so the same worker measured
differently from one minute to the next; RSS is stable and errs on the safe side.)
Never a process-wide MLX gauge: each worker is measured as its own process.
The module itself is the router's MemoryProbe (effects.py).

Testing only: with $MLXSUP_TEST_MEMORY_IN_USE naming a file, the system's memory in use is the
fraction that file holds while it exists (so a test can raise memory pressure and end it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

import psutil

_RUSAGE_INFO_V2 = 2
TEST_IN_USE_ENV = "MLXSUP_TEST_MEMORY_IN_USE"


def _test_in_use() -> float | None:
    path = os.environ.get(TEST_IN_USE_ENV)
    if not path:
        return None
    try:
        with open(path) as f:
            return float(f.read())
    except (OSError, ValueError):
        return None


class _RUsageInfoV2(ctypes.Structure):
    _fields_ = [
        ("ri_uuid", ctypes.c_uint8 * 16),
        *[(name, ctypes.c_uint64) for name in (
            "ri_user_time", "ri_system_time", "ri_pkg_idle_wkups", "ri_interrupt_wkups", "ri_pageins",
            "ri_wired_size", "ri_resident_size", "ri_phys_footprint", "ri_proc_start_abstime",
            "ri_proc_exit_abstime", "ri_child_user_time", "ri_child_system_time",
            "ri_child_pkg_idle_wkups", "ri_child_interrupt_wkups", "ri_child_pageins",
            "ri_child_elapsed_abstime", "ri_diskio_bytesread", "ri_diskio_byteswritten",
        )],
    ]


def _darwin_rusage(pid: int) -> _RUsageInfoV2 | None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    info = _RUsageInfoV2()
    if libc.proc_pid_rusage(pid, _RUSAGE_INFO_V2, ctypes.byref(info)) != 0:
        return None
    return info


def _darwin_footprint(pid: int) -> int | None:
    info = _darwin_rusage(pid)
    return None if info is None else int(info.ri_phys_footprint)


def wired(pid: int) -> int | None:
    """Bytes of wired (unpageable) memory the process holds: macOS only (Metal's buffers); None elsewhere."""
    if sys.platform != "darwin":
        return None
    info = _darwin_rusage(pid)
    return None if info is None else int(info.ri_wired_size)


def system_wired() -> int | None:
    """The host's wired memory: macOS only (psutil's `wired`); None where the platform has no such figure."""
    value = getattr(psutil.virtual_memory(), "wired", None)
    return int(value) if value is not None and sys.platform == "darwin" else None


def footprint(pid: int) -> int | None:
    """Bytes the process holds, or None if it is gone or unreadable."""
    if sys.platform == "darwin":
        value = _darwin_footprint(pid)
        if value is not None:
            return value
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return None


def system_available() -> int:
    in_use = _test_in_use()
    if in_use is not None:
        return int(system_total() * (1.0 - in_use))
    return int(psutil.virtual_memory().available)


def system_total() -> int:
    return int(psutil.virtual_memory().total)
