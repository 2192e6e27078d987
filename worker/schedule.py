"""Each engine step's plan, from what the step holds: pure, no MLX and no engine. The engine (mlx_engine/engine.py)
says what it holds (how many sequences decode, the prompts still prefilling, oldest first, and the decode in
flight) and runs the plan; step_cost.py's StepCostModel sizes the plan's prefill chunk to the step target.

- A batch step prefills the oldest prompts, `prefill_batch_size` at a time, while fewer than `max_batch_size`
  sequences decode.
- A batch's decode step has nothing to size: its plan serves `reuse_steps` steps of the same work (each still
  teaches the fits), as solving the fits is the plan's whole cost.
- A solo's decode step has nothing to size either: one plan (`solo_plan`) for all the steps of one solo, predicted
  afresh for each (a solo is known by its uid); the fits learn from batches only, so the engine observes no step
  that ran it.

Invariants: a plan's chunk is the cost model's (within its [min_chunk, max_chunk]); a reused plan is only ever one
made for equal work with no prefill.
"""

from __future__ import annotations

from collections.abc import Iterable

from worker.step_cost import PrefillSeq, StepCostModel, StepPlan, StepWork


class Scheduler:
    def __init__(self, cost: StepCostModel, max_batch_size: int, prefill_batch_size: int, reuse_steps: int) -> None:
        self.cost = cost
        self.max_batch_size = max_batch_size
        self.prefill_batch_size = prefill_batch_size
        self.reuse_steps = reuse_steps
        self.solo_plan: StepPlan | None = None  # the plan of every decode step of the last solo planned
        self._solo_uid: int | None = None  # ... that solo
        self._decode: tuple[StepWork, StepPlan, int] | None = None  # a decode step's plan, and its reuses left

    def solo(self, uid: int) -> StepPlan:
        """The plan of a decode step of the solo `uid`: one token, one in flight; predicted at its first, from what
        the fits know then."""
        if self.solo_plan is None or self._solo_uid != uid:
            self.solo_plan = self.cost.predict(StepWork(1, in_flight=1), self.cost.min_chunk)
            self._solo_uid = uid
        return self.solo_plan

    def work(self, decoding: int, prefilling: Iterable[PrefillSeq], in_flight: int) -> StepWork:
        """What the next step holds: the oldest prompts prefill, prefill_batch_size at a time, while the decoding
        sequences leave room in the batch."""
        if decoding >= self.max_batch_size:
            return StepWork(decoding, in_flight=in_flight)
        prefill = []
        for seq in prefilling:
            prefill.append(seq)
            if len(prefill) == self.prefill_batch_size:
                break
        return StepWork(decoding, tuple(prefill), in_flight)

    def plan(self, work: StepWork) -> StepPlan:
        """The plan for `work`: a decode step's kept plan while it serves, else the cost model's."""
        kept = self._decode
        if not work.prefill and kept is not None and kept[0] == work and kept[2] > 0:
            self._decode = (work, kept[1], kept[2] - 1)
            return kept[1]
        plan = self.cost.plan(work)
        self._decode = None if work.prefill else (work, plan, self.reuse_steps - 1)
        return plan
