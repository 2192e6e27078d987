"""Background tasks of the supervisor core that are never lost.

asyncio holds only a weak reference to a task, so one nobody keeps may be collected before it ends,
and an exception in one nobody awaits surfaces late or never ("Task exception was never retrieved",
at collection). Invariant: every task the core starts goes through `background`: it is kept in a set
until it is done, and its exception, if any, is logged with the task's name. A caller that awaits
the task still gets the exception too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

_running: set[asyncio.Task] = set()


def background(coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
    """Run `coro` as a task named `name`, kept until done, its exception logged."""
    task = asyncio.create_task(coro, name=name)
    _running.add(task)
    task.add_done_callback(_done)
    return task


def _done(task: asyncio.Task) -> None:
    _running.discard(task)
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.error("[task] %s failed: %r", task.get_name(), exc, exc_info=exc)
