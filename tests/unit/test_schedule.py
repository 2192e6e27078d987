"""worker/schedule.py, pure: what a step holds, a decode step's plan kept for its reuses, one plan per solo."""

from __future__ import annotations

from worker.schedule import Scheduler
from worker.step_cost import PrefillSeq, StepCostModel, StepWork


def scheduler(reuse: int = 3) -> tuple[Scheduler, list[StepWork]]:
    cost = StepCostModel(target_s=0.25, max_chunk=512, seed_token_s=0.001)
    made: list[StepWork] = []
    plan = cost.plan
    cost.plan = lambda work: (made.append(work), plan(work))[1]  # type: ignore[method-assign]
    return Scheduler(cost, max_batch_size=4, prefill_batch_size=2, reuse_steps=reuse), made


def test_a_step_prefills_the_oldest_prompts_a_prefill_batch_at_a_time_while_the_batch_has_room() -> None:
    s, _ = scheduler()
    seqs = [PrefillSeq(100, 0), PrefillSeq(50, 10), PrefillSeq(7, 0)]
    assert s.work(1, iter(seqs), 1) == StepWork(1, tuple(seqs[:2]), 1)
    assert s.work(4, iter(seqs), 4) == StepWork(4, in_flight=4)  # the batch is full: decode only
    assert s.work(2, iter([]), 2) == StepWork(2, in_flight=2)


def test_a_decode_steps_plan_serves_its_reuses_and_a_prefill_is_planned_each_time() -> None:
    s, made = scheduler(reuse=3)
    decode = StepWork(3, in_flight=3)
    plans = [s.plan(decode) for _ in range(7)]
    assert len(made) == 3 and plans[0] is plans[1] is plans[2] and plans[3] is not plans[2]  # made, then kept twice
    assert s.plan(StepWork(2, in_flight=3)) is not plans[6] and len(made) == 4  # other work: planned anew
    prefill = StepWork(1, (PrefillSeq(64, 0),), 1)
    s.plan(prefill)
    s.plan(prefill)
    assert len(made) == 6


def test_a_solos_decode_plan_is_made_once_per_solo() -> None:
    s, made = scheduler()
    first = s.solo(-1)
    assert s.solo(-1) is first and s.solo_plan is first and not made  # predicted, not planned: nothing to size
    assert first.decoding == 1 and first.in_flight == 1 and first.prefill_tokens == 0
    second = s.solo(-2)  # the next solo
    assert second is not first and s.solo(-2) is second and s.solo_plan is second
