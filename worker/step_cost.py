"""How long an engine step will take, and how many prompt tokens fit in one: steps bounded by time.

One BatchGenerator step decodes one token of every decoding sequence, then prefills up to
`chunk` prompt tokens of each sequence of its prompt batch (right-padded to the longest). The
decode is pipelined: a step launches its own decode and returns the tokens of the one launched
by the step before (`in_flight` sequences), so its wall time is that decode and its prefill
(measured on this CPU: a prefilling step costs one decode, not two, and the decode-only step
after it still waits for one). Step time is modelled, and fitted to what this model measures, as

    step             = decode(in_flight) + prefill(b, c, p)
    decode(n)        = d0 + d1 * n                         (0 when nothing decodes)
    prefill(b, c, p) = a * b * c + k * sum_i c * (p_i + c / 2)

a: seconds per token of the position-independent work (the weights); k: seconds per token per
token of context attended to (attention grows with the prompt's position p_i, the tokens already
in sequence i's cache). The planner picks the largest chunk whose prediction fits the prefill's
share of the step target: what the decode leaves of the target, and never less than a decode's
time, so neither the streams already decoding nor a long prompt starve the other.

Invariants: pure and MLX-free (unit-tested with synthetic machines); the chunk is always within
[min_chunk, max_chunk]; before a measurement the per-token cost is the seed (one token's forward
pass at load, more than a token of a prefill costs), so the first chunk is conservatively small;
a chunk never grows past GROWTH times the largest one measured, so one bad fit costs a few
slow steps, not one huge one; a chunk that does not finish the prompts is rounded down to 2^k or
3 * 2^(k-1) tokens, so steps come in few shapes (MLX may compile kernels for each new shape).
Coefficients are non-negative least squares over recent steps, older ones forgotten
geometrically (a machine's speed changes with its load).
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_CHUNK = 4  # a floor against degenerate steps; a model this slow per token may exceed the target
GROWTH = 4.0  # a chunk is at most this many times the largest chunk measured so far
FORGETTING = 0.9  # weight of an observation one step older
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
    """y ~ t1 * x1 + t2 * x2 with t1, t2 >= 0: least squares over observations weighted by forgetting**age."""

    def __init__(self, forgetting: float = FORGETTING) -> None:
        self.forgetting = forgetting
        self.s11 = self.s12 = self.s22 = self.b1 = self.b2 = self.syy = 0.0
        self.n = 0

    def add(self, x1: float, x2: float, y: float) -> None:
        f = self.forgetting
        self.s11 = f * self.s11 + x1 * x1
        self.s12 = f * self.s12 + x1 * x2
        self.s22 = f * self.s22 + x2 * x2
        self.b1 = f * self.b1 + x1 * y
        self.b2 = f * self.b2 + x2 * y
        self.syy = f * self.syy + y * y
        self.n += 1

    def coef(self) -> tuple[float, float] | None:
        """The fitted (t1, t2), or None before any informative observation."""
        if self.s11 <= 0 and self.s22 <= 0:
            return None
        ridge = 1e-9 * (self.s11 + self.s22)  # keeps a rank-one history (one shape seen so far) solvable
        s11, s22 = self.s11 + ridge, self.s22 + ridge
        det = s11 * s22 - self.s12 * self.s12
        if det > 0:
            t1 = (self.b1 * s22 - self.b2 * self.s12) / det
            t2 = (s11 * self.b2 - self.s12 * self.b1) / det
            if t1 >= 0 and t2 >= 0:
                return t1, t2
        one = (max(0.0, self.b1 / s11), 0.0)  # the best fit on either feature alone
        two = (0.0, max(0.0, self.b2 / s22))
        return min((one, two), key=self._residual)

    def _residual(self, t: tuple[float, float]) -> float:
        t1, t2 = t
        return (self.syy - 2 * (t1 * self.b1 + t2 * self.b2)
                + t1 * t1 * self.s11 + 2 * t1 * t2 * self.s12 + t2 * t2 * self.s22)


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
        self.decode_fit = NonNegativeFit()  # decode(n) = d0 * 1 + d1 * n
        self.prefill_fit = NonNegativeFit()  # prefill = a * tokens + k * attention
        self.largest_measured = 0

    # --- predictions -------------------------------------------------------------------

    def decode_s(self, decoding: int) -> float:
        if decoding <= 0:
            return 0.0
        coef = self.decode_fit.coef()
        if coef is None:
            return self.seed_token_s * decoding  # one forward pass per sequence: what the seed measured
        return coef[0] + coef[1] * decoding

    def prefill_s(self, tokens: int, attention: float) -> float:
        if tokens <= 0:
            return 0.0
        coef = self.prefill_fit.coef()
        if coef is None:
            return self.seed_token_s * tokens
        return coef[0] * tokens + coef[1] * attention

    def predict(self, work: StepWork, chunk: int) -> StepPlan:
        tokens, attention, taken = _features(work, chunk)
        seconds = self.decode_s(work.in_flight) + self.prefill_s(tokens, attention)
        return StepPlan(taken, work.decoding, work.in_flight, tokens, attention, seconds)

    # --- planning ----------------------------------------------------------------------

    def prefill_budget_s(self, work: StepWork) -> float:
        """The prefill's share of a step: what the decode leaves of the target, and at least a decode's time."""
        return max(self.target_s - self.decode_s(work.in_flight), self.decode_s(max(work.in_flight, work.decoding)))

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
        return self.predict(work, lo)

    # --- learning ----------------------------------------------------------------------

    def observe(self, plan: StepPlan, elapsed_s: float) -> None:
        """Fold one step's measured wall time into the fits."""
        if plan.prefill_tokens <= 0:
            if plan.in_flight > 0:  # it waited for the decode launched before it, and only for that
                self.decode_fit.add(1.0, float(plan.in_flight), elapsed_s)
            return
        fitted = self.decode_fit.coef() is not None  # an unfitted decode counts as prefill: the safe side
        prefill = max(0.0, elapsed_s - (self.decode_s(plan.in_flight) if fitted else 0.0))
        self.prefill_fit.add(float(plan.prefill_tokens), plan.attention, prefill)
        self.largest_measured = max(self.largest_measured, plan.chunk)
