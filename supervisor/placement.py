"""Where the daemon and its workers run: `[server] cpu_split` (protocol/placement.py says why).

"auto": where this process may run on at least AUTO_MIN_CPUS CPUs and can pin (Linux), a worker whose MLX computes on
a GPU runs on all of them but the last (two from 16 on), which are left to the daemon; the daemon itself stays free to
use every CPU, so under many streams its relay can spread out (pinned to one CPU of four, it held 32 streams back on
an H200: bench/results/gpu/itl-s15). A worker on the CPU backend keeps them all, since it computes on them. "on": the
daemon is pinned to its share as well, and every worker takes the rest whatever its device, from two CPUs on (tests,
hosts that want them strictly apart). "off": nothing is pinned.

With "on" the daemon is pinned before it starts a worker, which inherits that at its exec: so every worker is told
its share by `--cpus`. With "auto" only a worker on a GPU moves, by `--gpu-cpus`.
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
    workers = format_cpus(parts.workers)
    if mode == "on":
        pin_process(parts.daemon)
        log.info("[start] cpu_split=on: the daemon on CPU(s) %s, workers on %s", format_cpus(parts.daemon), workers)
        return ["--cpus", workers]
    log.info("[start] cpu_split=auto: GPU workers on CPU(s) %s, leaving %s to the daemon", workers,
             format_cpus(parts.daemon))
    return ["--gpu-cpus", workers]
