"""What drafting costs on this machine, and the acceptance at which it pays.

A verification of k drafts runs the model on k + 1 tokens. Where a token's forward pass is bound by reading the
weights (a GPU at one stream) that costs little more than one token; where it is bound by compute (this CPU, or a
big batch) it costs close to k + 1 plain steps, and drafting loses whatever it keeps. So a worker measures, once,
on a scratch cache, the seconds of a plain decode step (compiled where the solo decodes compiled), of a
verification of 2 and of k + 1 tokens (in between: linear), and of a draft model's step; `Costs.break_even` is
the drafts kept per verification above which drafting is faster than plain decoding by MARGIN. Where a rejection
is undone by feeding the kept tokens again (recurrent layers, a full sliding window: rollback.py), that forward
pass counts too: a verification that re-feeds n tokens costs one of n more. A request drafts while its own
acceptance stays above that (speculative.py's `Drafting`), and never where even a fully accepted draft would not
pay.

Timing: every shape is first run WARMUPS times untimed (a trace, kernels built, a first-shape cost), then the
shapes are timed in turn, REPEATS rounds of one run each, and each keeps its fastest: a slow stretch (another
process, clocks ramping up) then slows a round of every shape, not one shape's whole series (an H100 once priced
a verification of 2 tokens at 11.7 ms and one of 3 at 5.9 ms, each shape timed in one stretch). A forward pass of fewer tokens never costs more
than one of more, so a cost that reads higher than a longer one's is that longer one's (`Costs.measured`).

In the worker the measurement is idle work (`Pricing.step`, a forward pass per call while no request runs: the
worker loop's, after Ready), the solo's costs first, then the batch's at each size: a request never waits for it,
and one that comes before it is over decodes plainly (a slow host took over 30 s to price, on the first request's
loop before).

Invariants: `Pricing` measures once per worker (the first request that would draft, or its idle work), then its
costs are fixed, so
which steps draft depends on the tokens alone and a seeded request stays reproducible; measuring touches no
request's cache and draws no random numbers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from worker.mlx_engine.decode_graph import DecodeGraph
from worker.mlx_engine.rollback import mark, restore, trim

log = logging.getLogger(__name__)

MARGIN = 0.1  # drafting must be this much faster than plain decoding, expected, to be worth its variance
CONTEXT = 128  # tokens in the scratch cache the costs are measured at
WARMUPS = 2  # untimed runs of each shape before any is timed
REPEATS = 5  # timed runs of each shape, interleaved; the fastest counts (the others met interference)


@dataclass(frozen=True, slots=True)
class Costs:
    """Seconds of: a plain decode step; a verification of 2 and of k + 1 tokens; a draft model's step (0: none)."""

    plain_s: float
    verify2_s: float
    verify_s: float
    k: int
    draft_s: float = 0.0
    block: bool = False  # draft_s is a drafter's one pass for every draft of a verification (DFlash), not a draft's

    def drafting(self, k: int) -> float:
        """The drafter's seconds for k drafts."""
        return self.draft_s if self.block or k == 0 else k * self.draft_s

    @classmethod
    def measured(cls, seconds: dict[int, float], k: int, draft_s: float = 0.0, block: bool = False) -> Costs:
        """The costs from a forward pass's seconds per token count (1, 2 and k + 1), each no more than a longer
        one's."""
        plain_s, verify2_s, verify_s = (seconds[n] for n in (1, min(2, k + 1), k + 1))
        verify2_s = min(verify2_s, verify_s)
        return cls(min(plain_s, verify2_s), verify2_s, verify_s, k, draft_s, block)

    def verify(self, n: int) -> float:
        """A verification of n tokens (linear between the two measured; one token is a plain step)."""
        if n <= 1 or self.k <= 1:
            return self.plain_s if n <= 1 else self.verify_s
        return self.verify2_s + (self.verify_s - self.verify2_s) * (n - 2) / (self.k - 1)

    def break_even(self, k: int, refeed: int = 0) -> float:
        """The drafts kept per verification of k at which drafting beats plain decoding by MARGIN: a verification
        emits the kept drafts and one token of its own, where plain decoding emits one per plain step. `refeed`:
        the tokens fed again after it (a rejection undone by a mark), a forward pass of its own."""
        again = self.verify(refeed) if refeed > 0 else 0.0
        return (1 + MARGIN) * (self.verify(k + 1) + self.drafting(k) + again) / self.plain_s - 1


def fastest(runs: dict[str, Callable[[], None]], clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Each run's fastest time: all warmed first, then timed in turn, round after round (the module says why)."""
    best: dict[str, float] = {}
    for _ in timing(runs, best, clock):
        pass
    return best


def timing(runs: dict[str, Callable[[], None]], best: dict[str, float],
           clock: Callable[[], float] = time.perf_counter) -> Iterator[None]:
    """`fastest`, a run per step: each run's fastest time lands in `best` once the steps are over."""
    for run in runs.values():
        for _ in range(WARMUPS):
            run()
            yield
    times = dict.fromkeys(runs, float("inf"))
    for _ in range(REPEATS):
        for name, run in runs.items():
            t0 = clock()
            run()
            times[name] = min(times[name], clock() - t0)
            yield
    best.update(times)


def _one_by_one(model: nn.Module, n: int, rows: int = 1) -> Callable[[], None]:
    """A forward pass of n tokens after CONTEXT others in each of `rows` rows, uncompiled, taken back out of the cache
    each time (as the solo, and the batch, undo rejected drafts)."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((rows, CONTEXT), mx.uint32), cache=cache))
    ids = mx.zeros((rows, n), mx.uint32)

    def run() -> None:
        marked = mark(cache, n)  # at n = 1 a full window writes into the marked arrays: a scratch cache, timed only
        mx.eval(model(ids, cache=cache))
        if marked is None:
            trim(cache, n)
        else:
            restore(cache, marked, n)
    return run


def _compiled(graph: DecodeGraph, n: int) -> Callable[[], None]:
    """The same through the decode graph (a plain step at n = 1, `DecodeGraph.verify` past it)."""
    cache = make_prompt_cache(graph.model)
    mx.eval(graph.model(mx.zeros((1, CONTEXT), mx.uint32), cache=cache))
    state = graph.start(cache)
    ids = mx.zeros((n,), mx.uint32)

    def run() -> None:
        arrays = state.arrays or None  # recurrent layers' state: the step replaces it, so this is its mark
        mx.eval(graph.feed(state, ids) if n == 1 else graph.verify(state, ids))
        graph.rollback(state, n, arrays)
    return run


def measure(model: nn.Module, graph: DecodeGraph | None, k: int, draft: nn.Module | None, rows: int = 1) -> Costs:
    """This machine's costs of drafting k tokens with `model` (through `graph` where the solo would), in a batch of
    `rows` (batch_drafting.py; uncompiled: `graph` None), whose rows each draft with the draft model alone."""
    steps = measuring(model, graph, k, draft, rows)
    while True:
        try:
            with mx.stream(generation_stream):
                next(steps)
        except StopIteration as done:
            return done.value


def measuring(model: nn.Module, graph: DecodeGraph | None, k: int, draft: nn.Module | None,
              rows: int = 1) -> Generator[None, None, Costs]:
    """`measure`, a forward pass per step (each step to be run on the generation stream); its return value (the
    generator's StopIteration.value) is the Costs."""
    compiled = graph is not None and graph.fits(_filled(model))
    step = ((lambda n: _compiled(graph, n)) if compiled and graph is not None
            else (lambda n: _one_by_one(model, n, rows)))
    runs = {str(n): step(n) for n in sorted({1, 2, k + 1})}
    block = bool(getattr(draft, "block", False))  # a DFlash drafter: one pass of k + 1 a verification
    if draft is not None:
        runs["draft"] = _one_by_one(draft, k + 1 if block else 1)
    yield
    seconds: dict[str, float] = {}
    yield from timing(runs, seconds)
    runs.clear()
    mx.clear_cache()
    return Costs.measured({int(n): s for n, s in seconds.items() if n != "draft"}, k,
                          rows * seconds.get("draft", 0.0), block)


def _filled(model: nn.Module) -> list:
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, 1), mx.uint32), cache=cache))
    return cache


class Pricing:
    """A worker's costs of drafting: measured on first use, or (`idle`) a forward pass at a time in the worker's idle
    work (`step`), the requests before that decoding plainly; or given (tests, a known machine). A batch's costs at
    each size it is priced at (`at`) are Pricings of their own, measured the same way."""

    def __init__(self, k: int, draft: nn.Module | None, costs: Costs | None = None, rows: int = 1,
                 idle: bool = False) -> None:
        self.k, self.draft, self.rows = k, draft, rows  # rows: a batch's, verified together (batch_drafting.py)
        self.costs = costs
        self.idle = idle  # measured in idle work only: no request waits for it
        self._sizes: dict[int, Pricing] = {}
        self._steps: Generator[None, None, Costs] | None = None
        self._spent = 0.0  # seconds of steps so far

    def at(self, rows: int, costs: Costs | None = None) -> Pricing:
        """The costs of a batch of `rows` drafting together (given `costs`: those, for every size)."""
        if costs is not None:
            return Pricing(self.k, self.draft, costs, rows)
        if (p := self._sizes.get(rows)) is None:
            p = self._sizes[rows] = Pricing(self.k, self.draft, None, rows, self.idle)
        return p

    def get(self, model: nn.Module, graph: DecodeGraph | None) -> Costs | None:
        """The costs (measured now where not `idle`); None: not measured yet."""
        if self.costs is None and not self.idle:
            t0 = time.perf_counter()
            self._done(measure(model, graph, self.k, self.draft, self.rows), time.perf_counter() - t0)
        return self.costs

    def step(self, model: nn.Module, graph: DecodeGraph | None, sizes: tuple[int, ...] = ()) -> bool:
        """One forward pass of the measurement, this one's then each batch size's in `sizes`; False once all are
        measured (nothing was run)."""
        for p in (self, *(self.at(n) for n in sizes)):
            if p.costs is not None:
                continue
            if p._steps is None:
                p._steps = measuring(model, graph if p is self else None, p.k, p.draft, p.rows)
            t0 = time.perf_counter()
            try:
                with mx.stream(generation_stream):
                    next(p._steps)
            except StopIteration as done:
                p._done(done.value, p._spent + time.perf_counter() - t0)
            else:
                p._spent += time.perf_counter() - t0
            return True
        return False

    def _done(self, c: Costs, seconds: float) -> None:
        self.costs, self._steps = c, None
        log.info("[draft] phase=priced rows=%d k=%d plain_ms=%.3f verify2_ms=%.3f verify_ms=%.3f draft_ms=%.3f "
                 "break_even=%.2f ms=%d", self.rows, c.k, c.plain_s * 1e3, c.verify2_s * 1e3, c.verify_s * 1e3,
                 c.draft_s * 1e3, c.break_even(c.k), seconds * 1e3)
