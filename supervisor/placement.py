"""Where the daemon and its workers run: `[server] cpu_split` (protocol/placement.py says why).

"auto": where this process may run on at least AUTO_MIN_CPUS CPUs and can pin (Linux), the daemon keeps the last one
(two from 16 on) and a worker whose MLX computes on a GPU gets the others; a worker on the CPU backend keeps them
all, since it computes on them. "on": split wherever there are two CPUs, and every worker takes its share whatever
its device (tests, CPU hosts that want the daemon apart). "off": nothing is pinned.

A worker inherits the daemon's affinity at its exec, so it is always told where to go: `--cpus` (all the daemon may
use, or the workers' share with "on") and `--gpu-cpus` (the workers' share, where it differs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from protocol.placement import allowed_cpus, format_cpus, pin_process

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
AUTO_MIN_CPUS = 4  # fewer, and a GPU worker would lose too large a share to the daemon's rare wake-ups


@dataclass(frozen=True)
class Split:
    daemon: set[int]
    workers: set[int]


def split(allowed: set[int], mode: str) -> Split | None:
    """The daemon's CPUs and its workers', from those allowed; None: no split."""
    if mode == "off" or len(allowed) < (AUTO_MIN_CPUS if mode == "auto" else 2):
        return None
    keep = 2 if len(allowed) >= 16 else 1
    ordered = sorted(allowed)
    return Split(set(ordered[-keep:]), set(ordered[:-keep]))


def place_daemon(mode: str) -> list[str]:
    """Pin this process by `mode`; the worker arguments that place its workers ([] where nothing is pinned)."""
    allowed = allowed_cpus()
    parts = split(allowed, mode) if allowed else None
    if allowed is None or parts is None:
        return []
    pin_process(parts.daemon)
    log.info("[start] cpu_split=%s: the daemon on CPU(s) %s, workers on %s%s", mode, format_cpus(parts.daemon),
             format_cpus(parts.workers), " (on a GPU; a CPU-backend worker on all)" if mode == "auto" else "")
    workers = format_cpus(parts.workers)
    return ["--cpus", workers] if mode == "on" else ["--cpus", format_cpus(allowed), "--gpu-cpus", workers]
