"""Which of two ways of doing the same step is faster on this host now, by measurement. Pure: no MLX.

A lone request's next decode graph can be built ahead on a thread of its own (mlx_engine/solo.py's Ahead) or on the
main thread. On the GPU host which is faster depends on the host's speed of the moment: in its slow speed building
ahead took 13-17% off a token, in its fast speed it added ~10% (bench/results/gpu/itl-s18/). That speed changes from
one second to the next, and nothing but the steps' own times tells it. So a `Pace` times the steps in the way in use,
and after every `every` of them (once `window` were timed in the current request) tries the other way until `window`
of its steps are timed; it keeps the other way when that way's median step was faster by more than `margin`.

`begin()` starts a request: times from another request (another context length, maybe another speed of the host)
are not compared with this one's, and a trial left unfinished is dropped. `use()` says which way the next step runs
(True: the first way, the build ahead). `record(seconds, way)` is a step's time, from its start to the next step's,
for a step that ran wholly in `way`; the caller leaves out a step that carries a change of way (solo.py: a step that
builds ahead after one that did not, or the reverse).

Invariants: each way's list holds at most `window` times, all from the current request; only a trial changes the
way, and a trial compares `window` times of each way.
"""

from __future__ import annotations

from statistics import median


class Pace:
    def __init__(self, window: int = 12, every: int = 128, margin: float = 0.03) -> None:
        assert window >= 1 and every >= 0 and 0 <= margin < 1
        self.window, self.every, self.margin = window, every, margin
        self.way = True  # the way in use
        self.trial = False  # the other way is being tried
        self.times: dict[bool, list[float]] = {True: [], False: []}
        self.changes = 0  # how often the way in use changed
        self.trials = 0
        self._until_trial = every

    def begin(self) -> None:
        self.trial = False
        self.times[True].clear()
        self.times[False].clear()

    def use(self) -> bool:
        return self.way != self.trial

    def record(self, seconds: float, way: bool) -> None:
        times = self.times[way]
        times.append(seconds)
        del times[:-self.window]
        if not self.trial:
            if way == self.way:
                self._until_trial -= 1
            if self._until_trial <= 0 and len(self.times[self.way]) == self.window:
                self.trial, self.trials = True, self.trials + 1
                self.times[not self.way].clear()
        elif way != self.way and len(times) == self.window:  # the trial is over: keep the faster way
            if median(times) < median(self.times[self.way]) * (1 - self.margin):
                self.way, self.changes = way, self.changes + 1
            self.trial, self._until_trial = False, self.every
