"""Which of two ways of doing the same step is faster on this host now, by measurement. Pure: no MLX.

A lone request's next decode graph can be built ahead on a thread of its own (mlx_engine/solo.py's Ahead) or on the
main thread. On the GPU host which is faster depends on the host's speed of the moment: in its slow band the build
ahead took ~13% off a token, in its fast band it added ~10% (bench/results/gpu/itl-s18/). That speed changes from
one second to the next, and nothing but the steps' own times tells it. So a `Pace` times each step in the way in use,
and every `every` steps tries the other way for `window` steps; it keeps the other way when that way's median step
was faster by more than `margin`.

`use()` says which way the next step runs (True: the first way, the build ahead); `record(seconds, way)` is the time
from one step's start to the next's, for the way the first of them ran. The first `skip` steps after a change are
not counted: they carry the change itself (a graph built one way and taken the other).

Invariants: each way's list holds at most `window` times, all taken in that way; a trial ends after `window` counted
steps, and only a trial changes the way.
"""

from __future__ import annotations

from statistics import median


class Pace:
    def __init__(self, window: int = 12, every: int = 128, margin: float = 0.03, skip: int = 2) -> None:
        self.window, self.every, self.margin, self.skip = window, every, margin, skip
        self.way = True  # the way in use
        self.trial = False  # the other way is being tried
        self.times: dict[bool, list[float]] = {True: [], False: []}
        self.changes = 0  # how often the way in use changed
        self._until_trial = every
        self._skip = 0

    def use(self) -> bool:
        return self.way != self.trial

    def record(self, seconds: float, way: bool) -> None:
        if way != self.use():  # a step from before a change: it carries the change
            return
        if self._skip:
            self._skip -= 1
            return
        times = self.times[way]
        times.append(seconds)
        del times[:-self.window]
        if not self.trial:
            self._until_trial -= 1
            if self._until_trial <= 0 and len(times) == self.window:
                self.trial, self._skip = True, self.skip
                self.times[not way].clear()
        elif len(times) == self.window:  # the trial is over: keep the faster way
            if median(times) < median(self.times[self.way]) * (1 - self.margin):
                self.way, self.changes = way, self.changes + 1
                self.times[not way].clear()
            self.trial, self._until_trial, self._skip = False, self.every, self.skip
