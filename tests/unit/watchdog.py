"""A watchdog for async tests: a test whose event loop stops turning fails, instead of hanging the suite.

`asyncio.wait_for` cannot fire on a blocked loop (a coroutine that keeps awaiting a finished future
never yields, so no timer ever runs). Here a callback on the loop stamps the time every BEAT_S; a
thread that sees no stamp for `limit_s` interrupts the main thread with WATCHDOG_SIGNAL, whose
handler raises LoopBlocked right where the loop is stuck. That unblocks the loop (the spinning task
ends with the error), and `run_watched` fails the test with the stack it was stuck in, even when
the code under test swallowed the error.
"""

from __future__ import annotations

import _thread
import asyncio
import signal
import threading
import time
import traceback
from collections.abc import Coroutine
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")

BEAT_S = 0.05
LIMIT_S = 3.0  # far above any turn of a unit test, well below its own timeout
WATCHDOG_SIGNAL = signal.SIGUSR1


class LoopBlocked(AssertionError):
    """The event loop ran no callback for the watchdog's limit: something spins without yielding."""


def run_watched(main: Coroutine[Any, Any, T], limit_s: float = LIMIT_S) -> T:
    """asyncio.run(main), failing with LoopBlocked if the loop runs no callback for `limit_s`."""
    last = [time.monotonic()]
    stuck: list[str] = []  # the stacks the loop was found stuck in
    stop = threading.Event()

    async def beating() -> T:
        loop = asyncio.get_running_loop()
        handle: list[asyncio.TimerHandle] = []

        def beat() -> None:
            last[0] = time.monotonic()
            handle[:] = [loop.call_later(BEAT_S, beat)]

        beat()
        try:
            return await main
        finally:
            handle[0].cancel()
            stop.set()  # the loop's teardown beats no more: nothing to watch

    def interrupted(signum: int, frame: FrameType | None) -> None:
        stack = "".join(traceback.format_stack(frame)[-12:])  # its innermost frames: where it spins
        stuck.append(stack)
        raise LoopBlocked(f"the event loop ran no callback for {limit_s:.0f}s; it was stuck in:\n{stack}")

    def watch() -> None:
        while not stop.wait(BEAT_S):
            if time.monotonic() - last[0] > limit_s:
                last[0] = time.monotonic()  # once per `limit_s` while it stays blocked
                _thread.interrupt_main(WATCHDOG_SIGNAL)

    previous = signal.signal(WATCHDOG_SIGNAL, interrupted)
    watcher = threading.Thread(target=watch, name="loop-watchdog", daemon=True)
    watcher.start()
    try:
        result = asyncio.run(beating())
    except BaseException as exc:
        if stuck and not isinstance(exc, LoopBlocked):
            raise LoopBlocked(f"the event loop stopped yielding; it was stuck in:\n{stuck[0]}") from exc
        raise
    finally:
        stop.set()
        watcher.join()
        signal.signal(WATCHDOG_SIGNAL, previous)
    if stuck:
        raise LoopBlocked(f"the event loop stopped yielding; it was stuck in:\n{stuck[0]}")
    return result
