"""Batch shapes warmed while the worker is idle, so clients of a ramp do not pay for kernels built on demand.

On the GPU (MLX CUDA), a BatchGenerator step whose (generation batch, prefill batch) sizes are
new takes ~6x a known one (44 ms against 7.4 ms on an H200), and requests reaching a worker a
few per step meet a new size nearly every step: 32 clients starting together saw twice the
in-process TTFT. A scratch BatchGenerator over the same model runs the shapes the engine will
meet, on dummy tokens: arrivals one per step up to the largest batch, and their departures one
per step back down (every generation batch size, with a prefill batch of 1), then arrivals k per
step for k = 2..prefill_batch_size. It stops at a budget of step seconds.

It runs one step at a time (`ShapeWarmer.step`), while nothing is in flight: the worker loop
calls it when its inbox is empty, after Ready. Run before Ready it made every load ~10 s longer on
a fresh GPU host (a step of a new shape takes ~0.3 s there: kernels are built), which a cold start
paid in full (bench: 9.9 s over in-process load + first token, against a target of 1 s); run while
idle, a request arriving meanwhile waits for one step at most, and a ramp arriving later meets
shapes already built.

`WarmUp` is the engine's idle work, a step per call: first the decode graph's first trace (a solo's
compiled step, worker/mlx_engine/decode_graph.py), then the batch shapes.
`mode`: "on", "off", or "auto" (on where MLX runs on a GPU; MLX on the CPU builds nothing per
shape, and there the warm-up would only cost time).
Invariants: the engine's own generator is untouched (the scratch one is closed, its memory given
back, when the warm-up ends or the engine settles); the dummy prompts are decoded greedily, so no
random state is drawn.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator

from worker.mlx_engine.decode_graph import DecodeGraph

log = logging.getLogger(__name__)

WARM_MODES = ("auto", "on", "off")
DUMMY_PROMPT = [1, 2, 3, 4]


@dataclass(slots=True)
class Warmed:
    decode_sizes: set[int] = field(default_factory=set)  # generation batch sizes a step ran with
    arrivals_per_step: list[int] = field(default_factory=list)  # the ramps run: k prompts inserted per step
    steps: int = 0
    seconds: float = 0.0
    complete: bool = False  # False: the budget ran out first


def wants_warm_up(mode: str) -> bool:
    if mode not in WARM_MODES:
        raise ValueError(f"warm-up mode must be one of {WARM_MODES}, not {mode!r}")
    return mode == "on" or (mode == "auto" and mx.default_device() == mx.gpu)


class ShapeWarmer:
    """The ramps above on a scratch generator, one step per `step()`, within `budget_s` seconds of steps."""

    def __init__(self, model: nn.Module, max_batch_size: int, prefill_batch_size: int, prefill_step_size: int,
                 budget_s: float) -> None:
        self.warmed = Warmed()
        self.budget_s = budget_s
        self._gen: BatchGenerator | None = BatchGenerator(
            model, stop_tokens=None, completion_batch_size=max_batch_size, prefill_batch_size=prefill_batch_size,
            prefill_step_size=prefill_step_size)
        self._steps = self._ramps(max_batch_size, prefill_batch_size)

    @property
    def over(self) -> bool:
        return self._gen is None

    def step(self) -> bool:
        """Run one step; False once the warm-up is over (every ramp run, or the budget spent)."""
        if self._gen is None:
            return False
        t0 = time.perf_counter()
        more = next(self._steps, False)
        self.warmed.seconds += time.perf_counter() - t0
        if not more or self.warmed.seconds >= self.budget_s:
            self.close()
        return not self.over

    def close(self) -> None:
        """End the warm-up: the scratch generator and its memory go."""
        if self._gen is not None:
            self._gen.close()
            self._gen = None
            mx.clear_cache()

    def _ramps(self, total: int, prefill_batch_size: int) -> Iterator[bool]:
        for k in range(1, min(prefill_batch_size, total) + 1):
            yield from self._ramp(k, total)
            self.warmed.arrivals_per_step.append(k)
        self.warmed.complete = True

    def _ramp(self, k: int, total: int) -> Iterator[bool]:
        """Insert `total` dummy prompts, `k` per step; k = 1: they leave one per step, else together."""
        gen, warmed = self._gen, self.warmed
        assert gen is not None
        inserted = done = 0
        while done < total:
            if inserted < total:
                n = min(k, total - inserted)
                steps_left = (total - inserted - 1) // k  # insertion steps after this one
                # k = 1: all live `total` + 1 steps, so they finish in arrival order, one per step;
                # k > 1: each lives until the last arrival has decoded twice, so all leave together
                max_tokens = total + 1 if k == 1 else steps_left + 2
                gen.insert([DUMMY_PROMPT] * n, max_tokens=[max_tokens] * n)
                inserted += n
            _, responses = gen.next()
            warmed.steps += 1
            warmed.decode_sizes.add(len(gen._generation_batch))
            done += sum(r.finish_reason is not None for r in responses)
            yield True


class WarmUp:
    """The decode graph's first trace (if there is a graph), then the ShapeWarmer's steps, one per `step()`."""

    def __init__(self, model: nn.Module, graph: DecodeGraph | None, max_batch_size: int, prefill_batch_size: int,
                 prefill_step_size: int, budget_s: float, model_id: str) -> None:
        self._graph = graph  # None once traced
        self.shapes = ShapeWarmer(model, max_batch_size, prefill_batch_size, prefill_step_size, budget_s)
        self.warmed = self.shapes.warmed
        self.model_id = model_id

    def step(self) -> bool:
        """Run one step; False once the warm-up is over."""
        graph, self._graph = self._graph, None
        if graph is not None:
            if graph.warm():
                log.info("[warm] model=%s decode_graph s=%.2f", self.model_id, graph.warm_s)
            return True
        if self.shapes.step():
            return True
        w = self.warmed
        log.info("[warm] model=%s batch_shapes sizes=%d steps=%d s=%.2f complete=%s", self.model_id,
                 len(w.decode_sizes), w.steps, w.seconds, w.complete)
        return False

    def close(self) -> None:
        self.shapes.close()
