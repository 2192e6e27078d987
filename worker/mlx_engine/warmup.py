"""Batch shapes warmed at load, so the first clients of a ramp do not pay for kernels built on demand (issue 15).

On the GPU (MLX CUDA), a BatchGenerator step whose (generation batch, prefill batch) sizes are
new takes ~6x a known one (44 ms against 7.4 ms on an H200), and requests reaching a worker a
few per step meet a new size nearly every step: 32 clients starting together saw twice the
in-process TTFT. Before Ready, a scratch BatchGenerator over the same model runs the shapes the
engine will meet, on dummy tokens: arrivals one per step up to the largest batch, and their
departures one per step back down (every generation batch size, with a prefill batch of 1),
then arrivals k per step for k = 2..prefill_batch_size. It stops at a time budget, so loading
stays bounded.

`mode`: "on", "off", or "auto" (on where MLX runs on a GPU; MLX on the CPU builds nothing per
shape, and there the warm-up would only cost load time).
Invariants: the engine's own generator is untouched (the scratch one is closed, its memory
given back); the dummy prompts are decoded greedily, so no random state is drawn.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator

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


def warm_batch_shapes(model: nn.Module, max_batch_size: int, prefill_batch_size: int, prefill_step_size: int,
                      budget_s: float, report: Callable[[str, float], None] = lambda *_: None) -> Warmed:
    """Run the ramps described above on a scratch generator, within `budget_s` seconds."""
    warmed = Warmed()
    t0 = time.perf_counter()
    gen = BatchGenerator(model, stop_tokens=None, completion_batch_size=max_batch_size,
                         prefill_batch_size=prefill_batch_size, prefill_step_size=prefill_step_size)
    try:
        ramps = list(range(1, min(prefill_batch_size, max_batch_size) + 1))
        for n, k in enumerate(ramps):
            if not _ramp(gen, k, max_batch_size, warmed, t0 + budget_s):
                break
            warmed.arrivals_per_step.append(k)
            report("warm-up", (n + 1) / len(ramps))
        else:
            warmed.complete = True
    finally:
        gen.close()
        mx.clear_cache()
    warmed.seconds = time.perf_counter() - t0
    return warmed


def _ramp(gen: BatchGenerator, k: int, total: int, warmed: Warmed, deadline: float) -> bool:
    """Insert `total` dummy prompts, `k` per step; k = 1: they leave one per step, else together. False: out of time."""
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
        if time.perf_counter() > deadline:
            return False
    return True
