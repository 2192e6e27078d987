"""The kill ladder: let a worker exit on its own, then SIGTERM, then SIGKILL; return once it is reaped.

One ladder for a single worker (process.WorkerProcess) and for every rank of a group at once
(group.GroupProcess): each decides where a signal goes and what "reaped" means, the ladder decides when.
Invariants: a process that exits within `grace_s` gets no signal; SIGKILL is sent only after SIGTERM was
ignored for `kill_timeout_s`, with that reason for the reap log; the ladder returns only once `exited` is set.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Protocol

log = logging.getLogger(__name__)


class Killable(Protocol):
    exited: asyncio.Event  # set only once the process (every rank) has been reaped

    def signal(self, sig: signal.Signals, why: str | None = None) -> None: ...

    async def wait(self, timeout: float | None) -> bool: ...


async def kill_ladder(proc: Killable, grace_s: float, kill_timeout_s: float, who: str) -> None:
    """Wait `grace_s` for `proc`'s own exit, then SIGTERM, `kill_timeout_s` later SIGKILL; `who` names it in logs."""
    if await proc.wait(grace_s):
        return
    log.warning("[evict] %s no exit after %.1fs: SIGTERM", who, grace_s)
    proc.signal(signal.SIGTERM)
    if await proc.wait(kill_timeout_s):
        return
    log.error("[evict] %s ignored SIGTERM for %.1fs: SIGKILL", who, kill_timeout_s)
    proc.signal(signal.SIGKILL, f"the kill ladder: no exit {kill_timeout_s:.1f}s after SIGTERM")
    await proc.exited.wait()
