"""Test-only fault injection: every way a worker can be told to misbehave on purpose, in one place.

Integration tests start workers with `worker_args = ["--fault", NAME, ...]`; the argument parser
offers exactly the names in FAULTS (with their descriptions as help), and `Faults` is the set a
worker was given. Production code never tests a fault name itself: it calls one of the hooks
below at the point where that fault strikes, and a hook does nothing unless its fault was
injected. Invariants: with no fault given (`NO_FAULTS`) every hook is a no-op that costs a set
lookup; an unknown name is refused when the set is built, so a typo cannot disable a test.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from typing import BinaryIO

import msgpack

log = logging.getLogger(__name__)

FAULTS: dict[str, str] = {
    "ignore-sigterm": "ignore SIGTERM",
    "hang-on-evict": "never finish the exit sequence",
    "slow-steps": "sleep 0.4 s in every engine step (a slow but live worker)",
    "foreign-protocol": "announce itself in another protocol version",
    "ssd-enospc": "the SSD cache's disk is full",
    "ssd-stall": "the SSD writer stops halfway through a block (to be killed mid-write)",
    "ssd-slow": "the SSD writer is slow",
    "crash-in-loop": "raise an unexpected exception in the loop while a request runs",
    "step-raises": "the engine's step raises (as MLX or mlx-lm may), leaving its generator unusable",
    "megabyte-lines": "write a 1 MiB line to stderr at the first engine step and every LOUD_EVERY-th after it",
    "slowed": "from the STRIKE_STEP-th engine step on, run 1/SLOW_FACTOR of the time: a helper process stops and continues "
              "the worker (SIGSTOP/SIGCONT every SLOW_PERIOD_S), as a machine too busy or too small would",
    "spin-in-step": "at the STRIKE_STEP-th engine step, spin in Python for ever (a loop stuck outside MLX)",
    "block-in-step": "at the STRIKE_STEP-th engine step, wait for ever on a lock (a deadlocked loop)",
    "grow-while-loading": "before the model loads, take GROW_STEP_BYTES more every GROW_EVERY_S up to GROW_MAX_BYTES "
                          "(then load): a load that outgrows its memory, as building a hostile config's model did",
}

SLOW_STEP_S = 0.4  # slow-steps: added to every engine step
SLOW_WRITE_S = 0.25  # ssd-slow: added to every block the SSD writer writes
LOUD_EVERY = 100  # megabyte-lines: steps between two 1 MiB lines
SLOW_FACTOR = 20  # slowed: the worker runs SLOW_PERIOD_S / SLOW_FACTOR of every SLOW_PERIOD_S
SLOW_PERIOD_S = 0.5
SLOW_FACTOR_ENV = "MLXSUP_TEST_SLOW_FACTOR"
STRIKE_STEP = 4  # slowed, spin-in-step, block-in-step: the engine step they strike at (a request is under way, its
# steps' cost learnt at full speed)
GROW_STEP_BYTES = 64 * 2**20  # grow-while-loading: this much more ...
GROW_EVERY_S = 0.05  # ... this often ...
GROW_MAX_BYTES = 3 * 2**30  # ... up to this much, then the load goes on (holding it)
STALL_DEPTH = 4  # ssd-stall: the writer stops forever halfway through the block at this depth of its chain


class Faults(frozenset[str]):
    """The faults injected into this worker (a set of FAULTS names) and the hooks where they strike."""

    def __new__(cls, names: Iterable[str] = ()) -> Faults:
        chosen = frozenset(names)
        unknown = chosen - FAULTS.keys()
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {sorted(FAULTS)}")
        faults = super().__new__(cls, chosen)
        faults._steps = 0
        faults._cycler = None
        return faults

    _steps: int
    _cycler: subprocess.Popen | None
    _held: list[bytes]  # grow-while-loading: what it took

    # --- process start ------------------------------------------------------------------

    def apply_to_signals(self) -> None:
        """ignore-sigterm: a worker deaf to SIGTERM (the supervisor's kill ladder must go on to SIGKILL)."""
        if "ignore-sigterm" in self:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def foreign_ready_frame(self, frame: bytes) -> bytes | None:
        """foreign-protocol: the Ready frame as a worker of the next protocol version would send it
        (and nothing after it); None when the fault is not injected."""
        if "foreign-protocol" not in self:
            return None
        body = msgpack.unpackb(frame)
        return bytes(msgpack.packb({**body, "v": body["v"] + 1}))

    def while_loading(self) -> None:
        """grow-while-loading: the worker's footprint grows while it loads, GROW_STEP_BYTES at a time (each page
        written, so it is resident), until the supervisor stops it or GROW_MAX_BYTES is held."""
        if "grow-while-loading" not in self:
            return
        self._held = [b"\1" * GROW_STEP_BYTES]
        while len(self._held) * GROW_STEP_BYTES < GROW_MAX_BYTES:
            time.sleep(GROW_EVERY_S)
            self._held.append(b"\1" * GROW_STEP_BYTES)

    # --- the loop -----------------------------------------------------------------------

    def before_step(self) -> None:
        """slow-steps: a slow but live step. crash-in-loop: an exception no handler in the loop expects."""
        if "slow-steps" in self:
            time.sleep(SLOW_STEP_S)
        if "crash-in-loop" in self:
            raise RuntimeError("fault: crash-in-loop")
        if "megabyte-lines" in self and self._steps % LOUD_EVERY == 0:
            sys.stderr.write("[fault] " + "x" * 2**20 + "\n")  # one line, no newline inside: a pipe reader survives it
            sys.stderr.flush()
        if "slowed" in self and self._cycler is None and self._steps >= STRIKE_STEP:
            self._cycler = slow_down(os.getpid())
        if self._steps == STRIKE_STEP and "spin-in-step" in self:
            log.warning("[fault] spinning in Python for ever")
            spin()
        if self._steps == STRIKE_STEP and "block-in-step" in self:
            log.warning("[fault] blocking on a lock for ever")
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()
        self._steps += 1

    def after_step(self) -> None:
        """step-raises: the engine's step failing as MLX or mlx-lm may (inside the step's error handling)."""
        if "step-raises" in self:
            raise RuntimeError("fault: step-raises")

    def before_exit(self) -> None:
        """hang-on-evict: stuck in the exit sequence forever (the supervisor's kill ladder must end it). slowed: the
        helper process goes (continuing the worker first), so the exit runs at full speed."""
        if self._cycler is not None:
            self._cycler.terminate()
            self._cycler.wait(10)
            self._cycler = None
        if "hang-on-evict" in self:
            log.warning("[fault] hanging instead of exiting")
            threading.Event().wait()

    # --- the SSD writer thread ----------------------------------------------------------

    def before_ssd_write(self) -> None:
        """ssd-enospc: every write fails as on a full disk. ssd-slow: every block takes SLOW_WRITE_S."""
        if "ssd-enospc" in self:
            raise OSError(errno.ENOSPC, "No space left on device (injected fault ssd-enospc)")
        if "ssd-slow" in self:
            time.sleep(SLOW_WRITE_S)

    def during_ssd_write(self, f: BinaryIO, nbytes: int, depth: int, name: str) -> None:
        """ssd-stall: half of the block at STALL_DEPTH written, then the writer stops forever."""
        if "ssd-stall" in self and depth == STALL_DEPTH:
            f.write(b"\0" * (nbytes // 2))
            f.flush()
            log.warning("[fault] ssd=writer stalls halfway file=%s", name)
            threading.Event().wait()


def spin() -> None:
    n = 0
    while True:
        n = (n + 1) % 1000


# slowed's helper: stops and continues its parent until told to go (SIGTERM) or the parent is gone; a stop never
# outlives it (it continues the parent before it goes)
_CYCLER = """
import os, signal, sys, time
pid, run_s, stop_s = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
going = []
signal.signal(signal.SIGTERM, lambda *_: going.append(1))
try:
    while not going and os.getppid() == pid:
        os.kill(pid, signal.SIGSTOP)
        time.sleep(stop_s)
        os.kill(pid, signal.SIGCONT)
        time.sleep(run_s)
except ProcessLookupError:
    pass
finally:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
"""


def slow_down(pid: int) -> subprocess.Popen:
    """Start slowed's helper on `pid` (the worker itself); $MLXSUP_TEST_SLOW_FACTOR sets another factor than
    SLOW_FACTOR (a test whose timeouts need less)."""
    factor = float(os.environ.get(SLOW_FACTOR_ENV) or SLOW_FACTOR)
    run_s = SLOW_PERIOD_S / factor
    cycler = subprocess.Popen([sys.executable, "-c", _CYCLER, str(pid), str(run_s), str(SLOW_PERIOD_S - run_s)],
                              stdin=subprocess.DEVNULL, close_fds=True)
    log.warning("[fault] slowed %gx: stopped and continued by pid=%d", factor, cycler.pid)
    return cycler


NO_FAULTS = Faults()
