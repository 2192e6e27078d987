"""The worker's watchdog: while one turn of the generation loop runs long, it tells the supervisor whether that turn
is slow (computing) or stuck.

The supervisor counts a worker as hung when nothing came from its loop for `hang_timeout_s`. A loop turn can
honestly run longer than that: one prefill chunk of a big model on a small or busy machine, a first request's draft
pricing, a warm-up step. Predictions (StepStarted) cannot cover it, since the speed they were fitted at is not the
speed now. So a thread of its own (MLX-free) looks at the main thread from outside, every `sample_s`:
- where its innermost Python frame is (`sys._current_frames`): a thread inside one native call, an MLX evaluation,
  stays at the same frame and instruction, a call; Python code running moves, or (a tight loop) is always seen where
  the interpreter lets another thread take the GIL: a RESUME or a backward jump, never inside a call;
- how much CPU the process used, less this thread's own (MLX computes on its own threads on the CPU).
Once a turn has run `after_s`, it sends a Pulse every `after_s` (and MIN_SAMPLES samples) for as long as `computing()` holds over the samples
of that window: the main thread held one call in most samples (HELD_FRACTION) and the process used CPU for it, or
it is held in MLX's or the engine's own code (on a GPU the CPU may wait while the device computes; not in a worker
group's rank 0, where an MLX call may be a collective waiting for a stopped rank). So:
- stopped (SIGSTOP): this thread stops with the process, nothing is sent, the supervisor's timeout runs;
- deadlocked on a lock, in a sleep, in a poll: held, but no CPU and not in MLX: nothing sent;
- spinning in Python (a loop that never returns to the generation loop): the frame moves: nothing sent;
- holding the GIL in C for good: this thread cannot run: nothing sent.
Its Pulses leave from a DEALER socket of its own (ZeroMQ sockets are not shared between threads), under the
worker's identity plus protocol WATCH_SUFFIX; the router counts a Pulse as a message of the worker.
"""

from __future__ import annotations

import dis
import logging
import sys
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

HELD_FRACTION = 0.5  # a window's samples that must find the main thread in the same native call as the one before
CPU_MIN_S = 0.005  # the least CPU a window must show for a held call that is not MLX's to count as computing
MIN_SAMPLES = 3  # a window is judged once it holds this many (a slowed process takes fewer a second)
MLX_CODE = ("/mlx/", "/mlx_lm/", "/mlx_vlm/", "/mlx_engine/")  # a held call from these files is an MLX evaluation


# where the interpreter hands the GIL over (its "eval breaker"): a thread running Python is seen at these when sampled
SWITCH_POINTS = frozenset({"RESUME", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT", "POP_JUMP_BACKWARD_IF_FALSE",
                           "POP_JUMP_BACKWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_NONE", "POP_JUMP_BACKWARD_IF_NOT_NONE",
                           "JUMP_ABSOLUTE"})


@dataclass(frozen=True, slots=True)
class Sample:
    """Where the main thread was: its innermost frame's identity, code and instruction, whether that instruction is
    a call in progress (not a switch point); and the file and line."""

    frame: int
    code: int
    lasti: int
    where: str
    in_call: bool = True


def held_fraction(samples: list[Sample]) -> float:
    """The part of consecutive pairs of samples in which the main thread sat in the same call (0 with fewer than
    two)."""
    pairs = list(zip(samples, samples[1:]))
    if not pairs:
        return 0.0
    same = sum(b.in_call and (a.frame, a.code, a.lasti) == (b.frame, b.code, b.lasti) for a, b in pairs)
    return same / len(pairs)


def computing(samples: list[Sample], cpu_s: float, trust_mlx: bool = True) -> bool:
    """Does a window of samples show a main thread computing in a native call, rather than stopped, waiting, or
    spinning in Python? Pure: see the module's docstring. Without `trust_mlx` (a group's rank 0, whose MLX calls
    include collectives that wait for the other ranks) a held MLX call counts only with CPU, like any other."""
    if len(samples) < 2 or held_fraction(samples) < HELD_FRACTION:
        return False
    in_mlx = trust_mlx and any(part in samples[-1].where for part in MLX_CODE)
    return cpu_s >= CPU_MIN_S or in_mlx


_OPS: dict[int, tuple[object, dict[int, str]]] = {}  # code id -> (the code, its instructions' names by offset)


def opname_at(code: types.CodeType, offset: int) -> str:
    kept = _OPS.get(id(code))
    if kept is None or kept[0] is not code:
        if len(_OPS) > 4096:
            _OPS.clear()
        kept = _OPS[id(code)] = (code, {i.offset: i.opname for i in dis.get_instructions(code)})
    return kept[1].get(offset, "")


def sample_of(frame: types.FrameType) -> Sample:
    code = frame.f_code
    return Sample(id(frame), id(code), frame.f_lasti, f"{code.co_filename}:{frame.f_lineno} {code.co_name}",
                  opname_at(code, frame.f_lasti) not in SWITCH_POINTS)


class Watchdog:
    """The thread. `turn_started()` is the loop's clock reading at the start of its current turn; `send(turn_s,
    window_s, cpu_s, where)` sends a Pulse (from this thread: its own socket)."""

    def __init__(self, turn_started: Callable[[], float], send: Callable[[float, float, float, str], None],
                 after_s: float, sample_s: float, main_ident: int | None = None,
                 clock: Callable[[], float] = time.monotonic, on_close: Callable[[], None] = lambda: None,
                 trust_mlx: bool = True) -> None:
        self.turn_started = turn_started
        self.send = send
        self.after_s = after_s
        self.sample_s = sample_s
        self.main_ident = main_ident if main_ident is not None else threading.main_thread().ident or 0
        self.clock = clock
        self.on_close = on_close  # run once the thread is gone (its socket's close)
        self.trust_mlx = trust_mlx
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self.pulses = 0
        self.windows = 0  # windows judged (tests wait on it)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self.on_close()

    def _cpu(self) -> float:
        """The process's CPU time, less this thread's."""
        return time.process_time() - time.thread_time()

    def _run(self) -> None:
        samples: list[Sample] = []
        window_start, cpu_start, turn = self.clock(), self._cpu(), None
        while not self._stop.wait(self.sample_s):
            now = self.clock()
            started = self.turn_started()
            if now - started < self.after_s:  # the loop turns: nothing to tell
                samples, turn = [], None
                continue
            if turn != started:  # a new long turn: its window starts now
                samples, turn, window_start, cpu_start = [], started, now, self._cpu()
            frame = sys._current_frames().get(self.main_ident)  # the one way to see another thread
            if frame is not None:
                samples.append(sample_of(frame))
            del frame
            if now - window_start < self.after_s or len(samples) < MIN_SAMPLES:
                continue
            cpu = self._cpu() - cpu_start
            self.windows += 1
            if computing(samples, cpu, self.trust_mlx):
                try:
                    self.send(round(now - started, 3), round(now - window_start, 3), round(cpu, 3), samples[-1].where)
                    self.pulses += 1
                except Exception:  # a Pulse lost is a Pulse not sent: the supervisor's timeout decides
                    log.exception("[watchdog] sending a pulse failed")
            elif samples:
                log.warning("[watchdog] loop turn of %.1fs not computing: held=%.2f cpu_s=%.3f at %s",
                            now - started, held_fraction(samples), cpu, samples[-1].where)
            samples, window_start, cpu_start = samples[-1:], now, self._cpu()
