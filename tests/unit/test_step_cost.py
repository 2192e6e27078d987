"""The step cost model against synthetic machines: chunks sized to a time target, learned from measured steps."""

from __future__ import annotations

import random

import pytest

from worker.step_cost import GROWN_MISS, GROWTH, OUTLIER, NonNegativeFit, PrefillSeq, StepCostModel, StepWork, bucket


class Machine:
    """A synthetic machine with known costs: what a real step's wall time would be (seconds), pipelining
    included: a step waits for the decode the step before launched, and runs its prefill (p0 fixed per
    prefilling step, as on a GPU, plus its per-token costs)."""

    def __init__(self, a: float, k: float, d0: float = 0.0, d1: float = 0.0, noise: float = 0.0, seed: int = 0,
                 p0: float = 0.0) -> None:
        self.a, self.k, self.d0, self.d1, self.noise, self.p0 = a, k, d0, d1, noise, p0
        self.rng = random.Random(seed)

    def decode_s(self, n: int) -> float:
        return self.d0 + self.d1 * n if n else 0.0

    def step_s(self, work: StepWork, chunk: int) -> float:
        t = self.decode_s(work.in_flight)
        if work.prefill:
            c = min(chunk, max(s.left for s in work.prefill))
            t += self.p0 + self.a * c * len(work.prefill) + self.k * sum(c * (s.position + c / 2) for s in work.prefill)
        return t * (1 + self.rng.uniform(-self.noise, self.noise))


def decode_steps(model: StepCostModel, machine: Machine, n: int, steps: int) -> None:
    """Decode-only steps of n sequences, each waiting for the previous one's decode."""
    for _ in range(steps):
        work = StepWork(n, in_flight=n)
        model.observe(model.plan(work), machine.step_s(work, 0))


def prefill_prompt(model: StepCostModel, machine: Machine, prompt: int, decoding: int = 0,
                   position: int = 0) -> list[tuple[int, float]]:
    """Prefill one prompt step by step as the engine does, `decoding` streams decoding all along;
    return (chunk, measured seconds) per step."""
    steps, left = [], prompt
    while left > 0:
        work = StepWork(decoding, (PrefillSeq(left, position + prompt - left),), decoding)
        plan = model.plan(work)
        elapsed = machine.step_s(work, plan.chunk)
        model.observe(plan, elapsed)
        steps.append((plan.chunk, elapsed))
        left -= plan.chunk
    return steps


def test_fit_recovers_known_coefficients_and_keeps_them_non_negative() -> None:
    fit = NonNegativeFit(forgetting=1.0)
    for x1, x2 in [(16, 1), (64, 40), (128, 300), (32, 900), (256, 50)]:
        fit.add(x1, x2, 0.002 * x1 + 0.0005 * x2)
    t1, t2 = fit.coef()
    assert t1 == pytest.approx(0.002, rel=1e-6) and t2 == pytest.approx(0.0005, rel=1e-6)
    anti = NonNegativeFit(forgetting=1.0)  # data that a negative coefficient would fit best
    for x1, x2 in [(10, 10), (20, 10), (30, 10)]:
        anti.add(x1, x2, 1.0 - 0.01 * x1)
    assert all(t >= 0 for t in anti.coef())
    assert NonNegativeFit().coef() is None


def test_a_fit_is_solved_once_between_two_observations_and_afresh_after_one() -> None:
    fit = NonNegativeFit(forgetting=1.0)
    fit.add(16, 1, 0.04)
    fit.add(64, 40, 0.15)
    solved: list[tuple[int, ...]] = []
    solve = fit._fit
    fit._fit = lambda use: (solved.append(use), solve(use))[1]  # type: ignore[method-assign]
    first = [fit.coef() for _ in range(5)] + [fit.coef((1,)) for _ in range(3)]
    assert solved == [(0, 1), (1,)] and len(set(first[:5])) == 1  # a plan's bisection asks again and again
    fit.add(128, 300, 0.4)
    after = fit.coef()
    assert solved == [(0, 1), (1,), (0, 1)] and after != first[0]
    fresh = NonNegativeFit(forgetting=1.0)
    for x1, x2, y in [(16, 1, 0.04), (64, 40, 0.15), (128, 300, 0.4)]:
        fresh.add(x1, x2, y)
    assert after == fresh.coef()  # what it returns is the fit of every observation so far


def test_first_chunk_is_small_before_any_measurement() -> None:
    model = StepCostModel(target_s=0.25, max_chunk=2048, seed_token_s=0.005)
    plan = model.plan(StepWork(0, (PrefillSeq(10_000, 0),)))
    assert plan.chunk == 48  # 0.25 s at the seed's (pessimistic) 5 ms per token: 50, in a bucket
    assert plan.predicted_s == pytest.approx(0.24)


def test_chunks_come_in_few_sizes() -> None:
    assert [bucket(n) for n in (1, 3, 4, 5, 6, 7, 8, 11, 12, 50, 2047, 2048, 2479, 3071, 3072)] == \
        [1, 3, 4, 4, 6, 6, 8, 8, 12, 48, 1536, 2048, 2048, 2048, 3072]
    model = StepCostModel(target_s=0.25, max_chunk=500, seed_token_s=1e-6)
    assert model.plan(StepWork(0, (PrefillSeq(100_000, 0),))).chunk == 500  # the cap is kept as it is
    assert model.plan(StepWork(0, (PrefillSeq(450, 0),))).chunk == 450  # the whole rest in one step


def test_steps_settle_on_the_target_on_a_slow_cpu() -> None:
    """A `small`-like model on this CPU: ~0.1 s a token, growing with position. The old fixed 512-token step
    would take ~60 s; every step after the first few stays near the 0.25 s target."""
    cpu = Machine(a=0.09, k=0.00003, noise=0.05)
    model = StepCostModel(target_s=0.25, max_chunk=2048, seed_token_s=0.11, min_chunk=1)
    steps = prefill_prompt(model, cpu, prompt=300)
    assert sum(c for c, _ in steps) >= 300
    assert max(t for _, t in steps[3:]) < 0.25 * 1.5
    assert cpu.step_s(StepWork(0, (PrefillSeq(512, 0),)), 512) > 40  # what one old step cost


def test_chunks_shrink_as_attention_grows_with_position() -> None:
    gpu = Machine(a=0.00005, k=0.00000002)
    model = StepCostModel(target_s=0.25, max_chunk=8192, seed_token_s=0.004)
    steps = prefill_prompt(model, gpu, prompt=60_000)
    chunks = [c for c, _ in steps]
    late = [t for _, t in steps[len(steps) // 2:]]
    assert chunks[-2] < max(chunks)  # the late chunks are smaller than the largest
    assert max(late) < 0.25 * 1.5


def test_growth_is_bounded_by_the_largest_measured_chunk() -> None:
    fast = Machine(a=1e-6, k=0.0)
    model = StepCostModel(target_s=0.25, max_chunk=100_000, seed_token_s=0.01)
    steps = prefill_prompt(model, fast, prompt=50_000)
    chunks = [c for c, _ in steps]
    assert chunks[0] == 24  # 25 in a bucket
    for before, after in zip(chunks, chunks[1:]):
        assert after <= max(model.min_chunk, GROWTH * before) or after == chunks[-1]


def test_chunk_respects_min_and_max_and_what_is_left() -> None:
    model = StepCostModel(target_s=0.25, max_chunk=512, seed_token_s=1e-6)
    assert model.plan(StepWork(0, (PrefillSeq(100_000, 0),))).chunk == 512  # max_chunk
    assert model.plan(StepWork(0, (PrefillSeq(40, 0),))).chunk == 40  # only what is left
    slow = StepCostModel(target_s=0.25, max_chunk=512, seed_token_s=10.0, min_chunk=16)
    plan = slow.plan(StepWork(0, (PrefillSeq(1000, 0),)))
    assert plan.chunk == 16 and plan.predicted_s == pytest.approx(160.0)  # over the target, and says so


def test_sequences_prefilled_together_share_the_budget() -> None:
    model = StepCostModel(target_s=0.25, max_chunk=4096, seed_token_s=0.001)
    one = model.plan(StepWork(0, (PrefillSeq(10_000, 0),)))
    four = model.plan(StepWork(0, tuple(PrefillSeq(10_000, 0) for _ in range(4))))
    assert one.chunk == 192 and four.chunk == 48  # 250 and 62, in buckets
    assert four.prefill_tokens == 4 * 48


def test_decoding_takes_its_part_of_the_step_and_never_starves() -> None:
    model = StepCostModel(target_s=0.25, max_chunk=4096, seed_token_s=0.001)
    decode_steps(model, Machine(a=0, k=0, d1=0.05 / 8), 8, 5)  # 8 sequences, 0.05 s a decode
    assert model.decode_s(8) == pytest.approx(0.05, rel=0.01)
    plan = model.plan(StepWork(8, (PrefillSeq(10_000, 0),), in_flight=8))
    assert plan.chunk == 192 and plan.predicted_s == pytest.approx(0.242, rel=0.01)  # 0.20 s left for prefill
    assert model.plan(StepWork(8, (PrefillSeq(10_000, 0),), in_flight=0)).chunk == 192  # 0.25 s: 250, bucketed
    busy = StepCostModel(target_s=0.25, max_chunk=4096, seed_token_s=0.001)
    decode_steps(busy, Machine(a=0, k=0, d1=0.1), 8, 5)  # decoding alone takes longer than the target
    assert busy.plan(StepWork(8, (PrefillSeq(10_000, 0),), 8)).chunk == 768  # as much as a decode: 0.8 s, bucketed


def test_the_decode_a_step_waits_for_is_not_taken_for_prefill() -> None:
    """A prefilling step also waits for the decode launched before it (2 s here): a fit that took it for
    prefill would think a token costs more than twice what it does, and crawl at small chunks."""
    cpu = Machine(a=0.1, k=0.0, d1=0.25)
    model = StepCostModel(target_s=0.25, max_chunk=2048, seed_token_s=0.12)
    decode_steps(model, cpu, 8, 6)
    steps = prefill_prompt(model, cpu, prompt=400, decoding=8)
    assert model.prefill_s(1, 0.0) == pytest.approx(0.1, rel=0.01)
    assert [c for c, _ in steps[1:4]] == [16, 16, 16]  # a decode's 2 s buys 20 tokens: 16 in a bucket


def test_decode_cost_is_learned_apart_from_prefill() -> None:
    cpu = Machine(a=0.01, k=0.0, d0=0.002, d1=0.02)
    model = StepCostModel(target_s=0.5, max_chunk=4096, seed_token_s=0.05)
    for n in (1, 2, 4, 8, 4, 8):
        decode_steps(model, cpu, n, 1)
    steps = prefill_prompt(model, cpu, prompt=2000, decoding=8)
    assert model.decode_s(8) == pytest.approx(0.162, rel=0.01)
    assert max(t for _, t in steps[3:]) < 0.5 * 1.2
    chunks = sorted(c for c, _ in steps[3:-1])  # all (0.5 - 0.162) / 0.01 per token, but for one half-size
    assert chunks[0] >= 16 and chunks[1] >= 30  # step that probes for a fixed cost (and finds none)
    assert StepCostModel(0.25, 64, 0.01).plan(StepWork(4, in_flight=0)).predicted_s == 0.0  # nothing to wait for


def test_decode_only_step_predictions_need_no_prefill() -> None:
    model = StepCostModel(target_s=0.25, max_chunk=2048, seed_token_s=0.1)
    plan = model.plan(StepWork(3, in_flight=3))  # it waits for the decode launched by the step before
    assert plan.prefill_tokens == 0 and plan.predicted_s == pytest.approx(0.3)
    assert model.plan(StepWork(0)).predicted_s == 0.0


def gpu_like() -> Machine:
    """The 1b model on an H200 (bench prefill_itl): every prefilling step costs ~45 ms whatever its chunk,
    a prompt token ~10 us; 8 streams decode in 4 ms."""
    return Machine(a=1e-5, k=1e-9, d1=0.004 / 8, p0=0.045)


def test_a_fixed_cost_per_step_does_not_shrink_chunks_to_nothing() -> None:
    """A 4-token step that took 45 ms is not 11 ms a token: with a 0.05 s target, a fit without a fixed
    cost prefilled a 6000-token prompt in 1500 steps of 4 tokens (71 s on the H200)."""
    gpu = gpu_like()
    model = StepCostModel(target_s=0.05, max_chunk=2048, seed_token_s=0.03)
    decode_steps(model, gpu, 8, 5)
    steps = prefill_prompt(model, gpu, prompt=6000, decoding=8)
    assert len(steps) <= 20
    p0, a, _ = model.prefill_coef()
    assert p0 == pytest.approx(0.045, rel=0.05) and a == pytest.approx(1e-5, rel=0.1)
    assert max(c for c, _ in steps) == 2048  # a step's prompt work at least its fixed cost: 4500, capped
    assert max(t for _, t in steps) < 2 * 0.045 + 0.004 + 0.01  # and no more than that


def test_a_fixed_cost_is_learned_while_chunks_grow() -> None:
    """With the default 0.25 s target the chunks grow as fast as GROWTH lets them, and then each step's
    prediction is what it measures: the planner knows a small step costs its fixed 45 ms too."""
    gpu = gpu_like()
    model = StepCostModel(target_s=0.25, max_chunk=2048, seed_token_s=0.03)
    decode_steps(model, gpu, 8, 5)
    left, steps = 6000, []
    while left > 0:
        work = StepWork(8, (PrefillSeq(left, 6000 - left),), 8)
        plan = model.plan(work)
        elapsed = gpu.step_s(work, plan.chunk)
        model.observe(plan, elapsed)
        steps.append((plan.chunk, plan.predicted_s, elapsed))
        left -= plan.chunk
    assert [c for c, _, _ in steps[:5]] == [8, 32, 128, 512, 2048]
    assert len(steps) <= 8
    for _, predicted, measured in steps[3:]:
        assert predicted == pytest.approx(measured, rel=0.05)
    small = StepWork(8, (PrefillSeq(8, 0),), 8)
    assert model.plan(small).predicted_s == pytest.approx(gpu.step_s(small, 8), rel=0.05)


def test_a_one_time_slow_step_does_not_shrink_the_chunks() -> None:
    """A step that built a graph for a new shape (0.6 s for a 2048-token chunk on an H200, against 30 ms) is
    learned as OUTLIER times its prediction: the next long prompt still goes in at the largest chunk, the same
    shapes again, not in smaller ones that would each be new."""
    gpu = gpu_like()
    model = StepCostModel(target_s=0.25, max_chunk=2048, seed_token_s=0.03)
    prefill_prompt(model, gpu, prompt=6000)  # settled
    work = StepWork(0, (PrefillSeq(6000, 0),), 0)
    plan = model.plan(work)
    assert plan.chunk == 2048
    model.observe(plan, 20 * gpu.step_s(work, plan.chunk))  # the build
    assert model.plan(work).chunk == 2048
    steps = prefill_prompt(model, gpu, prompt=6000)
    assert [c for c, _ in steps][:2] == [2048, 2048]


def test_a_machine_that_really_slowed_down_is_still_learned() -> None:
    """Ten times slower for good: each step is learned as at most OUTLIER times its prediction, so the
    predictions climb by that factor a step until they meet what is measured."""
    model = StepCostModel(target_s=0.25, max_chunk=2048, seed_token_s=0.03)
    prefill_prompt(model, gpu_like(), prompt=6000)
    decode_steps(model, gpu_like(), 8, 5)
    slow = Machine(a=1e-4, k=1e-8, d1=0.04 / 8, p0=0.45)
    decode_steps(model, slow, 8, 30)
    work = StepWork(8, in_flight=8)
    assert model.plan(work).predicted_s == pytest.approx(slow.step_s(work, 0), rel=0.1)
    left = 100000
    for _ in range(30):
        work = StepWork(8, (PrefillSeq(left, 100000 - left),), 8)
        plan = model.plan(work)
        measured = slow.step_s(work, plan.chunk)
        model.observe(plan, measured)
        left -= plan.chunk
    assert plan.predicted_s == pytest.approx(measured, rel=0.15)
    assert OUTLIER * 0.004 < 0.04  # a single step could not have taught it this


def test_a_lone_prefill_takes_the_fastest_chunks_and_shrinks_only_while_streams_decode() -> None:
    """A 30k-token prompt with a 0.05 s target on a GPU-like machine (45 ms fixed a step): alone, no stream waits
    for its steps, so once the fit knows the fixed cost they go in at max_chunk to the end (mlx-lm's own chunking);
    with 8 streams decoding, the same prompt late in its prefill is held to the target's smaller chunks."""
    gpu = gpu_like()
    alone = StepCostModel(target_s=0.05, max_chunk=2048, seed_token_s=0.03)
    decode_steps(alone, gpu, 8, 5)
    steps = prefill_prompt(alone, gpu, prompt=30_000)
    chunks = [c for c, _ in steps]
    assert alone.intercept_known() and chunks[-2] == 2048
    assert chunks.index(2048) <= 8 and set(chunks[chunks.index(2048):-1]) == {2048}  # GROWTH-bound ramp, then 2048
    shared = StepCostModel(target_s=0.05, max_chunk=2048, seed_token_s=0.03)
    decode_steps(shared, gpu, 8, 5)
    late = [c for c, _ in prefill_prompt(shared, gpu, prompt=30_000, decoding=8)][-6:-1]
    assert max(late) < 2048
    rate = {n: n / gpu.step_s(StepWork(0, (PrefillSeq(n, 28_000),)), n) for n in (1024, 2048)}
    assert rate[2048] > 1.05 * rate[1024]  # what the lone prompt's larger chunks buy late in its prefill


def test_a_grown_chunk_that_measures_slower_than_its_prediction_ends_the_growing() -> None:
    """Where larger chunks cost more than the fit foresees (a CPU's caches overflow), the first grown step that
    measures over GROWN_MISS of its prediction sends a lone prompt back to the target's chunks, for good."""
    gpu = gpu_like()
    model = StepCostModel(target_s=0.05, max_chunk=2048, seed_token_s=0.03)
    decode_steps(model, gpu, 8, 5)
    prefill_prompt(model, gpu, prompt=30_000)
    assert model.grown == 2048
    work = StepWork(0, (PrefillSeq(4000, 26_000),), 0)
    plan = model.plan(work)
    assert plan.chunk == 2048
    model.observe(plan, (1 + GROWN_MISS) * 1.01 * plan.predicted_s)
    assert not model.grows and model.plan(work).chunk < 2048
    steps = prefill_prompt(model, gpu, prompt=30_000)
    assert max(c for c, _ in steps[len(steps) // 2:]) < 2048
