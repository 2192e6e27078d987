"""How long an engine step will take, and how many prompt tokens fit in one: steps bounded by time.

One BatchGenerator step decodes one token of every decoding sequence, then prefills up to
`chunk` prompt tokens of each sequence of its prompt batch (right-padded to the longest). The
decode is pipelined: a step launches its own decode and returns the tokens of the one launched
by the step before (`in_flight` sequences), so its wall time is that decode and its prefill
(measured on this CPU: a prefilling step costs one decode, not two, and the decode-only step
after it still waits for one). Step time is modelled, and fitted to what this model measures, as

    step             = decode(in_flight) + prefill(b, c, p)
    decode(n)        = d0 + d1 * n                         (0 when nothing decodes)
    prefill(b, c, p) = p0 + a * b * c + k * sum_i c * (p_i + c / 2)

p0: seconds a prefilling step costs whatever its chunk (on a GPU ~45 ms: an eval and a cache clear
per chunk, kernel launches); a: seconds per token of the position-independent work (the weights);
k: seconds per token per token of context attended to (attention grows with the prompt's position
p_i, the tokens already in sequence i's cache). The planner picks the largest chunk whose
prediction fits the prefill's share of the step target: what the decode leaves of the target, never
less than a decode's time, so neither the streams already decoding nor a long prompt starve the
other, and never less than twice p0. That last floor is for a target the fixed cost alone nearly
fills: fitting the target would take chunks of a few tokens, each paying p0 (a 6000-token prompt in
1500 steps of 4 tokens at 0.05 s); with the floor at least half of a prefilling step computes prompt
tokens, so a prompt goes in at least half the machine's prefill rate, and the steps overrun the
target by at most p0 (its whole cost: it cannot be split).

p0 and a can only be told apart by steps of different sizes. Until the fit has seen sizes that differ
(MIN_SPREAD), p0 is held at 0: all the cost is per token, the pessimistic reading, so chunks never
outgrow the target on that account (and a CPU, with no fixed cost to speak of, plans as before). A
fit with one size can stay stuck on it (a 4-token step of 45 ms reads as 11 ms a token, so 4 tokens
are all that fit again): after EXPLORE_AFTER steps of one size the planner takes another one, half
of it (shorter, so never over the target), or twice it when it is min_chunk already.

A step that no stream waits for (nothing decoding, no decode in flight: a lone long prompt, or prompts that
arrived together) is not held to the target: its chunk grows past the target's to the smallest one whose tokens a
second the fit puts within FAST_ENOUGH of the fastest chunk's (a fixed cost p0 favours large chunks, the
attention's c / 2 small ones), so a lone prompt goes in at the engine's best speed, up to max_chunk (mlx-lm's own
prefill_step_size by default), and chunks shrink to the target only while other streams decode. Where p0 is small
against a chunk's per-token work (a CPU), the target's chunk is already within FAST_ENOUGH and stays; while p0
cannot be told from a, the fit reads no fixed cost and nothing grows; and once a grown chunk's step measures
GROWN_MISS over its prediction, no chunk grows again (on this CPU a tiny model's 384-token chunks 5k tokens in took
1.5x the 128-token ones' time a token, which the fit's c / 2 did not foresee). A request arriving meanwhile waits
for that step, as it would for mlx-lm's prefill; the worker's watchdog tells the supervisor a long step computes
(worker/watchdog.py).

Invariants: pure and MLX-free (unit-tested with synthetic machines); the chunk is always within
[min_chunk, max_chunk]; before a measurement the per-token cost is the seed (one token's forward
pass at load, more than a token of a prefill costs), so the first chunk is conservatively small;
a chunk never grows past GROWTH times the largest one measured, so one bad fit costs a few
slow steps, not one huge one; a chunk that does not finish the prompts is rounded down to 2^k or
3 * 2^(k-1) tokens, so steps come in few shapes (MLX may compile kernels for each new shape).
A step measured at more than OUTLIER times the fit's prediction is learned as OUTLIER times it:
such a step did one-time work (MLX CUDA builds a cuDNN graph or kernels for a shape new to the
process, 0.05-2.5 s on an H200), and taken at face value it taught the fit that big chunks are
slow, so the planner picked other sizes, which were new shapes again (bench.diagnose long: a
4194-token prompt's TTFT 0.15-3.5 s until the chunks settled at 2048, then 45 ms). A machine that
really slowed down is still learned, a factor OUTLIER per step.
Coefficients are non-negative least squares over recent steps, older ones forgotten
geometrically (a machine's speed changes with its load); p0 is fitted only while the sizes measured
differ enough to tell it from a (else 0), and a chunk the fit cannot change is probed once every
EXPLORE_AFTER-or-more steps, within the target.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

MIN_CHUNK = 4  # a floor against degenerate steps; a model this slow per token may exceed the target
GROWTH = 4.0  # a chunk is at most this many times the largest chunk measured so far
FORGETTING = 0.9  # weight of an observation one step older
EXPLORE_AFTER = 4  # prefilling steps of one size in a row, the fit unable to split their cost, before another size
OUTLIER = 3.0  # a step is learned as at most this many times its prediction (the rest: one-time work)
FAST_ENOUGH = 0.05  # a lone prefill's chunk: the smallest within this fraction of the fastest one's tokens a second
GROWN_MISS = 0.5  # a grown chunk's step measured this much over its prediction ends the growing, for good
MIN_SPREAD = 1e-3  # how much the sizes measured must differ (1 - cos^2 of tokens vs 1) to fit a fixed cost
_SCALE_CONTEXT = 1024.0  # the attention feature in units of 1k tokens, so both features are O(tokens)


@dataclass(frozen=True, slots=True)
class PrefillSeq:
    """A sequence of the prompt batch: prompt tokens still to prefill, and tokens already in its cache."""

    left: int
    position: int


@dataclass(frozen=True, slots=True)
class StepWork:
    """What the next step holds: sequences it decodes (their tokens come a step later), those it
    prefills, and the sequences of the decode launched by the step before, which it waits for."""

    decoding: int
    prefill: tuple[PrefillSeq, ...] = ()
    in_flight: int = 0


@dataclass(frozen=True, slots=True)
class StepPlan:
    """A planned step: the prompt chunk per sequence, the tokens it computes, its predicted seconds."""

    chunk: int
    decoding: int
    in_flight: int
    prefill_tokens: int  # padded: sequences x chunk actually taken
    attention: float  # sum_i c * (p_i + c / 2), in _SCALE_CONTEXT units
    predicted_s: float


class NonNegativeFit:
    """y ~ sum_j t_j * x_j with every t_j >= 0: least squares over observations weighted by forgetting**age.

    It keeps the weighted Gram matrix and solves the normal equations on each subset of the features
    (n is 2 or 3 here, so enumerating them is cheap): the full solution if it is non-negative, else the
    non-negative subset solution of least residual, which is the constrained optimum."""

    def __init__(self, features: int = 2, forgetting: float = FORGETTING) -> None:
        self.features = features
        self.forgetting = forgetting
        self.gram = [[0.0] * features for _ in range(features)]  # sum w * x_i * x_j
        self.moment = [0.0] * features  # sum w * x_j * y
        self.syy = 0.0
        self.n = 0
        self._coef: dict[tuple[int, ...], tuple[float, ...] | None] = {}  # coef() by `use`, until the next add

    def add(self, *observation: float) -> None:
        """One observation: its `features` values, then y."""
        self._coef.clear()
        *x, y = observation
        f = self.forgetting
        for i in range(self.features):
            for j in range(self.features):
                self.gram[i][j] = f * self.gram[i][j] + x[i] * x[j]
            self.moment[i] = f * self.moment[i] + x[i] * y
        self.syy = f * self.syy + y * y
        self.n += 1

    def coef(self, use: tuple[int, ...] | None = None) -> tuple[float, ...] | None:
        """The fitted coefficients, or None before any informative observation; features not in `use`
        (all by default) are held at 0."""
        use = tuple(range(self.features)) if use is None else use
        if use not in self._coef:  # a plan asks many times between two observations (its chunk is bisected)
            self._coef[use] = self._fit(use)
        return self._coef[use]

    def _fit(self, use: tuple[int, ...]) -> tuple[float, ...] | None:
        trace = sum(self.gram[j][j] for j in use)
        if trace <= 0:
            return None
        ridge = 1e-9 * trace  # keeps a rank-one history (one shape seen so far) solvable
        full = self._solve(use, ridge)
        if full is not None and min(full) >= 0:
            return full
        candidates = [t for size in range(len(use) - 1, 0, -1) for subset in combinations(use, size)
                      if (t := self._solve(subset, ridge)) is not None and min(t) >= 0]
        return min(candidates, key=self._residual, default=(0.0,) * self.features)

    def spread(self, i: int, j: int) -> float:
        """1 - cos^2 of the angle between features i and j over the observations: 0 when one is
        proportional to the other in every observation (the fit cannot tell them apart), up to 1."""
        norm = self.gram[i][i] * self.gram[j][j]
        return 1.0 - self.gram[i][j] ** 2 / norm if norm > 0 else 0.0

    def _solve(self, subset: tuple[int, ...], ridge: float) -> tuple[float, ...] | None:
        """The least-squares coefficients with only `subset`'s features free (Gaussian elimination)."""
        rows = [[self.gram[i][j] + (ridge if i == j else 0.0) for j in subset] + [self.moment[i]] for i in subset]
        m = len(subset)
        for col in range(m):
            pivot = max(range(col, m), key=lambda r: abs(rows[r][col]))
            if rows[pivot][col] == 0:
                return None
            rows[col], rows[pivot] = rows[pivot], rows[col]
            for r in range(col + 1, m):
                factor = rows[r][col] / rows[col][col]
                rows[r] = [a - factor * b for a, b in zip(rows[r], rows[col])]
        solved = [0.0] * m
        for r in range(m - 1, -1, -1):
            solved[r] = (rows[r][m] - sum(rows[r][c] * solved[c] for c in range(r + 1, m))) / rows[r][r]
        t = [0.0] * self.features
        for j, value in zip(subset, solved):
            t[j] = value
        return tuple(t)

    def _residual(self, t: tuple[float, ...]) -> float:
        """The weighted sum of squared residuals of coefficients t."""
        fitted = sum(t[i] * t[j] * self.gram[i][j] for i in range(self.features) for j in range(self.features))
        return self.syy - 2 * sum(t[j] * self.moment[j] for j in range(self.features)) + fitted


def bucket(n: int) -> int:
    """`n` rounded down to 2^k or 3 * 2^(k-1): at most two chunk sizes per octave."""
    if n < 4:
        return n
    power = 1 << (n.bit_length() - 1)
    return power + power // 2 if n >= power + power // 2 else power


def _features(work: StepWork, chunk: int) -> tuple[int, float, int]:
    """(padded prefill tokens, attention work, chunk actually taken) of `work` prefilled `chunk` at a time."""
    if not work.prefill:
        return 0, 0.0, 0
    taken = min(chunk, max(s.left for s in work.prefill))
    tokens = taken * len(work.prefill)
    attention = sum(taken * (s.position + taken / 2) for s in work.prefill) / _SCALE_CONTEXT
    return tokens, attention, taken


class StepCostModel:
    """Plans each step's prefill chunk from the step-time target, and learns from each step's measured time."""

    def __init__(self, target_s: float, max_chunk: int, seed_token_s: float, min_chunk: int = MIN_CHUNK) -> None:
        self.target_s = target_s
        self.max_chunk = max(1, max_chunk)
        self.min_chunk = max(1, min(min_chunk, self.max_chunk))
        self.seed_token_s = max(seed_token_s, 1e-6)
        self.decode_fit = NonNegativeFit(2)  # decode(n) = d0 * 1 + d1 * n
        self.prefill_fit = NonNegativeFit(3)  # prefill = p0 * 1 + a * tokens + k * attention
        self.largest_measured = 0
        self.last_measured = 0  # the chunk of the last prefilling step measured,
        self.repeats = 0  # and how many prefilling steps in a row measured it
        self.grown = 0  # the largest chunk a step no stream waited for grew to, since a step shared with decoding
        self.grows = True  # such steps grow past the target's chunk: until one measures GROWN_MISS over its prediction

    # --- predictions -------------------------------------------------------------------

    def decode_s(self, decoding: int) -> float:
        if decoding <= 0:
            return 0.0
        coef = self.decode_fit.coef()
        if coef is None:
            return self.seed_token_s * decoding  # one forward pass per sequence: what the seed measured
        return coef[0] + coef[1] * decoding

    def intercept_known(self) -> bool:
        """Whether the steps measured differ enough in size to tell a step's fixed cost from its per-token cost."""
        return self.prefill_fit.spread(0, 1) >= MIN_SPREAD

    def prefill_coef(self) -> tuple[float, float, float] | None:
        """(p0, a, k) fitted; p0 held at 0 (all the cost per token: the pessimistic reading) while unknown."""
        coef = self.prefill_fit.coef(None if self.intercept_known() else (1, 2))
        return None if coef is None else (coef[0], coef[1], coef[2])

    def prefill_s(self, tokens: int, attention: float) -> float:
        if tokens <= 0:
            return 0.0
        coef = self.prefill_coef()
        if coef is None:
            return self.seed_token_s * tokens
        return coef[0] + coef[1] * tokens + coef[2] * attention

    def predict(self, work: StepWork, chunk: int) -> StepPlan:
        tokens, attention, taken = _features(work, chunk)
        seconds = self.decode_s(work.in_flight) + self.prefill_s(tokens, attention)
        return StepPlan(taken, work.decoding, work.in_flight, tokens, attention, seconds)

    # --- planning ----------------------------------------------------------------------

    def prefill_budget_s(self, work: StepWork) -> float:
        """The prefill's share of a step: what the decode leaves of the target, at least a decode's time, and
        at least twice the prefill's fixed cost (so at least half of it computes prompt tokens)."""
        coef = self.prefill_coef()
        fixed = coef[0] if coef is not None else 0.0
        return max(self.target_s - self.decode_s(work.in_flight), self.decode_s(max(work.in_flight, work.decoding)),
                   2 * fixed)

    def plan(self, work: StepWork) -> StepPlan:
        """The largest chunk in [min_chunk, max_chunk] whose prefill fits its budget (min_chunk if none does)."""
        if not work.prefill:
            return self.predict(work, self.min_chunk)
        cap = self.max_chunk
        if self.largest_measured:
            cap = min(cap, max(self.min_chunk, int(GROWTH * self.largest_measured)))
        longest = max(s.left for s in work.prefill)
        cap = min(cap, max(self.min_chunk, longest))
        budget = self.prefill_budget_s(work)
        lo, hi = self.min_chunk, cap
        while lo < hi:  # the prediction grows with the chunk: bisect for the largest that fits
            mid = (lo + hi + 1) // 2
            tokens, attention, _ = _features(work, mid)
            if self.prefill_s(tokens, attention) <= budget:
                lo = mid
            else:
                hi = mid - 1
        if lo < longest and lo < self.max_chunk:
            lo = max(self.min_chunk, bucket(lo))
        if not work.decoding and not work.in_flight:  # no stream waits for this step's end
            lo = self._alone(work, lo, cap)
        else:
            self.grown = 0
        if lo < cap and lo == self.last_measured and self.repeats >= EXPLORE_AFTER and not self.intercept_known():
            lo = self._explore(lo, cap)
        return self.predict(work, lo)

    def _alone(self, work: StepWork, chunk: int, cap: int) -> int:
        """A step no stream waits for: the target's `chunk` grown while a larger one is fast enough
        (`_fast_enough`), and never below the chunk an earlier such step grew to (kept until a step is shared with
        decoding streams): the best chunk does not move with the position (the attention's p_i is per-token work),
        while a run of one chunk size lets the fit drift between p0 and a, and read small chunks as fast again."""
        if chunk < cap and self.grows:
            grown = self._fast_enough(work, chunk, cap)
            if grown > chunk:
                self.grown = max(self.grown, grown)
            chunk = max(grown, min(self.grown, cap))
        return chunk

    def _fast_enough(self, work: StepWork, chunk: int, cap: int) -> int:
        """The smallest chunk in [chunk, cap] (`chunk`, a bucket, or cap) that the fit says prefills `work` within
        FAST_ENOUGH of the most tokens a second any chunk there does; `chunk` while the fit cannot tell a step's
        fixed cost from its per-token cost (it reads none then: no larger chunk could look faster)."""
        if not self.intercept_known():
            return chunk
        sizes = sorted({chunk, cap, *(n for k in range(2, cap.bit_length() + 1) for n in (1 << k, 3 << (k - 1))
                                      if chunk < n < cap)})
        rates = []
        for n in sizes:
            tokens, attention, _ = _features(work, n)
            seconds = self.prefill_s(tokens, attention)
            rates.append(tokens / seconds if seconds > 0 else float("inf"))
        best = max(rates)
        return next(n for n, rate in zip(sizes, rates) if rate >= best * (1 - FAST_ENOUGH))

    def _explore(self, chunk: int, cap: int) -> int:
        """Another size than the one chunk the fit has seen, so it can tell fixed from per-token cost:
        half of it (never over the target), or twice it when it is already min_chunk."""
        smaller = max(self.min_chunk, bucket(chunk // 2))
        return smaller if smaller < chunk else min(cap, 2 * chunk)

    # --- learning ----------------------------------------------------------------------

    def observe(self, plan: StepPlan, elapsed_s: float) -> None:
        """Fold one step's measured wall time into the fits."""
        # the plan's prediction is the fits' now (nothing was learned since it was made): no solve for the bound
        fitted = self.decode_fit.n > 0  # an unfitted decode counts as prefill: the safe side
        if plan.prefill_tokens <= 0:
            if plan.in_flight > 0:  # it waited for the decode launched before it, and only for that
                self.decode_fit.add(1.0, float(plan.in_flight),
                                    min(elapsed_s, OUTLIER * plan.predicted_s) if fitted else elapsed_s)
            return
        if self.grown and plan.chunk >= self.grown and elapsed_s > (1 + GROWN_MISS) * plan.predicted_s:
            self.grows, self.grown = False, 0  # the fit cannot say what larger chunks cost here: the target's again
        decode = self.decode_s(plan.in_flight)
        prefill = max(0.0, elapsed_s - (decode if fitted else 0.0))
        if self.prefill_fit.n > 0:
            prefill = min(prefill, OUTLIER * (plan.predicted_s - decode))
        self.prefill_fit.add(1.0, float(plan.prefill_tokens), plan.attention, prefill)
        self.largest_measured = max(self.largest_measured, plan.chunk)
        self.repeats = self.repeats + 1 if plan.chunk == self.last_measured else 1
        self.last_measured = plan.chunk
