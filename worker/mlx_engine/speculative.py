"""Speculative decoding: draft a few tokens, verify them in one forward pass (the solo here; batches in
batch_drafting.py).

A stream alone is bound by reading the weights once per token; verifying k drafted tokens reads them once for up
to k + 1 tokens. The solo (solo.py) asks its `Drafting` for a step: the drafter proposes up to k tokens after the
token in hand, the target model runs on [token, drafts], and the verification keeps the longest acceptable prefix
plus one token of the target's own (the correction, or the bonus when every draft holds).

Drafters: prompt lookup (`PromptLookup`: the tokens that followed the latest earlier occurrence of the last n
tokens, n from MAX_NGRAM down to 1, in the prompt and the output so far, repeated up to k where they run into
the end (a loop): no second model, and an agent editing code it was just shown repeats long runs of it), a draft model (`ModelDrafter`: a smaller model with the same
tokenizer, loaded in the same worker by `load_draft`, its own cache kept in step with the target's), and the
checkpoint's own MTP head (mtp.py's `MTPDrafter`: one decoder layer on the target's last hidden state), and a DFlash
drafter (dflash.py's `DFlashDrafter`: a block of drafts in one pass, on some of the target's layers' hidden states).

Exact: a greedy request keeps a draft token only where it is the target's argmax, so its ids are plain decoding's.
A sampled request uses the standard rule on the request's own distribution (its temperature, top-p, min-p,
top-k: `Sampling.probs`): keep draft token d with probability min(1, p(d) / q(d)), else sample from
max(p - q, 0) renormalised; prompt lookup's q is one-hot (keep d with probability p(d), else sample from p
with d removed). A seeded request (`Draws`) is verified by its own draws instead: the token at each position is
the one its seeded sampler draws there (the draw numbered by the tokens generated before it, a resumed request's
included), and a draft is kept while it equals that token. For prompt lookup that is the standard rule in
distribution (d kept with probability p(d), else a draw from p without d); a draft model drafts with the same
draws (shared Gumbel noise), so it is kept where its draw and the target's agree. Either way the ids are those of
plain seeded decoding, whichever steps drafted: reproducible, and the same whole or resumed after any token.

Rollback (rollback.py): the target's cache gets [token, drafts] and is trimmed back to the tokens kept; where a
layer cannot be trimmed (recurrent layers: ArraysCache, the Qwen3.5 hybrids; a full sliding window:
RotatingKVCache) its state is marked before the verification, given back after a rejection, and the kept tokens
are fed again in one forward pass (the solo does it).

Paying: a verification of k drafts costs a forward pass of k + 1 tokens; the worker measures what that costs here
against a plain step, once (draft_pricing.py), which gives the drafts kept per verification at which drafting
pays (`Costs.break_even`, the re-feed after a rejection counted where there is one). A request where a draft would
have to be kept nearly whole to pay (break-even above NEAR_WHOLE of k: only an oracle keeps that much, and a CPU, where
a verification of k + 1 tokens costs about k + 1 plain steps, lands there) never drafts; otherwise it measures its own surplus (a moving average of the drafts kept
per verification above that verification's break-even), and below zero it stops
drafting for a pause that doubles each time (FIRST_PAUSE..MAX_PAUSE tokens), so a draft that is gibberish costs
a few verifications per pause, and a copying stretch later is still found. A drafter that proposes nothing (no
match for prompt lookup) is asked again only after a wait that doubles up to MAX_IDLE tokens (`Drafting.proposed`):
asking reads the token in hand before the next is launched, which stalls plain decoding's pipelining. The costs are
fixed per worker, so which steps draft depends on the tokens only.

The oracle (`Oracle`, mode "oracle": a test and bench hook, not a config value) proposes a recorded sequence,
the target's own greedy output from an earlier plain run: every draft is kept and drafting costs nothing, so it
measures verification itself, the mechanism's ceiling; it always drafts.

Invariants: the target cache after a step holds exactly the tokens kept; a draft model's cache holds a prefix of
them; nothing here emits a token: the solo does, in order, stopping where plain decoding stops.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from protocol.messages import Submit
from worker.mlx_engine.decode_graph import DecodeGraph
from worker.mlx_engine.dflash import DFlashDrafter, DFlashHead, DFlashStep
from worker.mlx_engine.draft_pricing import Costs, Pricing
from worker.mlx_engine.mtp import HeadStep, MTPDrafter, MTPHead
from worker.mlx_engine.rollback import mark, restore, room, trim, undoable

MODES = ("auto", "off", "prompt-lookup", "draft", "mtp", "dflash")  # the config's and the worker's; "oracle": a test and bench hook
DEFAULT_DRAFT_TOKENS = 4
MAX_NGRAM = 3  # the longest suffix prompt lookup matches; then shorter ones, down to one token
EMA_WEIGHT = 0.25  # each verification's weight in that average
ACCEPTANCE_DECAY = 0.75  # the weight left to the earlier verifications' counts in the acceptance a draft length is chosen by
MAX_ACCEPTANCE = 0.98  # the acceptance a draft length is chosen at, at most (a run of whole drafts is not a certainty)
MIN_VERIFIES = 2  # verifications before the average may pause drafting (after a start or a pause)
NEAR_WHOLE = 0.75  # a break-even above this part of k: drafting is not tried at all
FIRST_PAUSE, MAX_PAUSE = 64, 1024  # tokens decoded plainly after the first pause, doubled per pause up to the max
MAX_IDLE = 16  # tokens decoded plainly after a step whose drafter proposed nothing, doubled per such step up to this
DRAFT_PREFILL = 512  # the draft model's catch-up (its prompt) in chunks of this many tokens


def default_mode(draft: bool, gpu: bool, mtp: bool = False) -> str:
    """What `auto` drafts with: the draft model where one is given; else, where MLX runs on a GPU (Metal, CUDA: a
    verification of a few tokens costs about a plain step there, and the pricing stops what does not pay), the
    checkpoint's MTP head where it has one (mtp.py), else prompt lookup; else nothing (a CPU, where a verification of
    k + 1 tokens costs about k + 1 plain steps)."""
    return "draft" if draft else ("mtp" if mtp else "prompt-lookup") if gpu else "off"


def lookup(history: np.ndarray, k: int, max_n: int = MAX_NGRAM) -> list[int]:
    """k tokens after history's last n tokens (the longest n that occurs earlier, from max_n down to 1), as its
    latest earlier occurrence continued; [] when none does. That occurrence is p tokens back, so the history
    repeats with period p there: what followed it (p tokens up to the end) is drafted over and over, k in all.
    (Only what followed would be 1 token a step on a run of one repeated token.)"""
    size = len(history)
    for n in range(min(max_n, size - 1), 0, -1):
        starts = size - n  # an occurrence starting at s < starts ends before the suffix does, and something follows it
        hit = history[:starts] == history[starts]
        for j in range(1, n):
            hit &= history[j:starts + j] == history[starts + j]
        found = np.flatnonzero(hit)
        if found.size:
            follows = history[int(found[-1]) + n:]
            return np.resize(follows, k).tolist()
    return []


def leading(flags: list[bool]) -> int:
    """How many flags hold before the first that does not."""
    n = 0
    while n < len(flags) and flags[n]:
        n += 1
    return n


@dataclass(frozen=True, slots=True)
class Sampling:
    """A sampled request's distribution, as its sampler draws from it (make_sampler's filters, in its order)."""

    temperature: float
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0

    def logits(self, logprobs: mx.array) -> mx.array:
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p > 0:
            logprobs = apply_min_p(logprobs, self.min_p)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        return logprobs * (1 / self.temperature)

    def probs(self, logprobs: mx.array) -> mx.array:
        return mx.softmax(self.logits(logprobs), axis=-1)


class Draws:
    """A seeded request's random stream, as guided.seeded_sampler draws it: the i-th token sampled (a resumed
    request's earlier tokens counted) uses the i-th key split off the seed's. Called, it is the request's sampler."""

    def __init__(self, seed: int, skip: int, sampling: Sampling) -> None:
        self.sampling = sampling
        self.key = mx.random.key(seed)
        self.advance(skip)

    def keys(self, n: int) -> list[mx.array]:
        """The next n draws' keys, not used up."""
        key, out = self.key, []
        for _ in range(n):
            key, draw = mx.random.split(key)
            out.append(draw)
        return out

    def advance(self, n: int) -> None:
        for _ in range(n):
            self.key = mx.random.split(self.key)[0]

    def sample(self, logprobs: mx.array, key: mx.array) -> mx.array:
        """The token drawn with `key` from logprobs of shape (1, vocab), the sampler's shape: the same noise."""
        return mx.random.categorical(self.sampling.logits(logprobs), key=key)

    def __call__(self, logprobs: mx.array) -> mx.array:
        self.key, draw = mx.random.split(self.key)
        return self.sample(logprobs, draw)


def accept_sampled(p: mx.array, drafts: mx.array, q: mx.array | None, key: mx.array | None) -> tuple[mx.array, mx.array]:
    """The standard rule, lazily: (whether each draft is kept, shape (k,); the token after each possible prefix,
    shape (k + 1,): at i < k a draw from max(p_i - q_i, 0), at k one from p_k). p: the target's probabilities
    at the k + 1 positions; q: the draft's at the k drafted ones (None: the drafts are deterministic, q one-hot)."""
    k = drafts.size
    rows = mx.arange(k)
    pd = p[rows, drafts]
    keys = mx.random.split(key) if key is not None else (None, None)
    u = mx.random.uniform(shape=(k,), key=keys[0])
    if q is None:
        kept = u < pd
        residual = mx.put_along_axis(p[:k], drafts[:, None], mx.array(0.0, p.dtype), axis=-1)
    else:
        kept = u * q[rows, drafts] < pd
        residual = mx.maximum(p[:k] - q, 0.0)
    after = mx.random.categorical(mx.log(mx.concatenate([residual, p[k:]])), key=keys[1])
    return kept, after


class Drafter(Protocol):
    def propose(self, tokens: list[int], y: int, k: int, sampling: Sampling | None,
                keys: Sequence[mx.array] | None) -> tuple[mx.array | None, mx.array | None]:
        """Up to k drafts after tokens + [y] (None: none), and the draft's probabilities (None: deterministic). `keys`:
        a seeded request's draws at the k positions (the draft draws with them; None: unseeded)."""
        ...

    def keep(self, valid: int) -> None:
        """Only the first `valid` tokens of the history hold (the rest were rejected)."""
        ...

    def room(self) -> int: ...


class PromptLookup:
    """Drafts from the request's own history (`lookup`), mirrored in a growing array."""

    def __init__(self) -> None:
        self._h = np.zeros(256, np.int64)
        self._n = 0  # the history's tokens mirrored

    def propose(self, tokens: list[int], y: int, k: int, sampling: Sampling | None,
                keys: Sequence[mx.array] | None) -> tuple[mx.array | None, mx.array | None]:
        n = len(tokens)
        if n + 1 > len(self._h):
            self._h = np.concatenate([self._h, np.zeros(max(n + 1, len(self._h)), np.int64)])
        self._h[self._n:n] = tokens[self._n:n]
        self._n = n
        self._h[n] = y
        drafts = lookup(self._h[:n + 1], k)
        return (mx.array(drafts, mx.uint32) if drafts else None), None

    def keep(self, valid: int) -> None:
        """Nothing to undo: the mirror only ever holds tokens kept."""

    def room(self) -> int:
        return sys.maxsize


class Oracle:
    """Drafts a recorded sequence (a prompt and the target's greedy output after it) while the history follows it."""

    def __init__(self, sequence: list[int]) -> None:
        self.sequence = sequence

    def propose(self, tokens: list[int], y: int, k: int, sampling: Sampling | None,
                keys: Sequence[mx.array] | None) -> tuple[mx.array | None, mx.array | None]:
        n = len(tokens)  # y is at position n; checking it alone is enough while the history follows the record
        drafts = self.sequence[n + 1:n + 1 + k] if n < len(self.sequence) and self.sequence[n] == y else []
        return (mx.array(drafts, mx.uint32) if drafts else None), None

    def keep(self, valid: int) -> None:
        """Nothing to undo."""

    def room(self) -> int:
        return sys.maxsize


class Forced:
    """An MTP head's or a DFlash drafter's drafting, paid in full, with a recorded sequence's tokens proposed instead
    (mode "mtp" or "dflash" given an oracle: a bench and test hook, the drafter's forced-acceptance ceiling: every
    draft kept, each costing the drafter's work as well as its verification)."""

    taps = True

    def __init__(self, drafter: MTPDrafter | DFlashDrafter, oracle: Oracle) -> None:
        self.drafter, self.oracle = drafter, oracle

    def see(self, start: int, hidden: mx.array, tokens: Sequence[int]) -> None:
        self.drafter.see(start, hidden, tokens)

    def propose(self, tokens: list[int], y: int, k: int, sampling: Sampling | None,
                keys: Sequence[mx.array] | None) -> tuple[mx.array | None, mx.array | None]:
        drafts, _ = self.drafter.propose(tokens, y, k, sampling, keys)
        if drafts is not None:
            mx.eval(drafts)
        return self.oracle.propose(tokens, y, k, sampling, keys)

    def keep(self, valid: int) -> None:
        self.drafter.keep(valid)

    def room(self) -> int:
        return sys.maxsize


class ModelDrafter:
    """A draft model's proposals for one request; its cache holds `fed` tokens of the request's history.

    Its drafts go back out of its cache by a trim where every layer can take them back; a recurrent layer or a full
    sliding window (rollback.MARKED) is snapshotted before the drafts are fed instead, and a rejection gives it its
    state back and feeds the kept tokens again in one forward pass. The snapshot holds copies of the layers' arrays,
    not the arrays: a RotatingKVCache writes a token into its arrays in place."""

    def __init__(self, model: nn.Module, vocab: int) -> None:
        self.model = model
        self.vocab = vocab  # the target's logits width: the draft's probabilities are cut or padded to it
        self.cache = make_prompt_cache(model)
        self.fed = 0
        self.undoable = undoable(self.cache)
        self._mark: tuple[int, dict[int, Any], list[int]] | None = None  # (fed at the mark, states, the ids fed since)

    def _logprobs(self, ids: mx.array) -> mx.array:
        logits = self.model(ids[None], cache=self.cache)[0, -1:, :]
        width = logits.shape[-1]
        if width > self.vocab:
            logits = logits[:, :self.vocab]
        elif width < self.vocab:
            logits = mx.concatenate([logits, mx.full((1, self.vocab - width), -mx.inf, logits.dtype)], axis=-1)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def propose(self, tokens: list[int], y: int, k: int, sampling: Sampling | None,
                keys: Sequence[mx.array] | None) -> tuple[mx.array | None, mx.array | None]:
        behind = tokens[self.fed:] + [y]
        k = min(k, self.room() - len(behind))
        if k < 1:
            return None, None
        with mx.stream(generation_stream):
            while len(behind) > 1:  # the prompt, the first time: in chunks, as generate_step prefills
                n = min(DRAFT_PREFILL, len(behind) - 1)
                self.model(mx.array(behind[:n])[None], cache=self.cache)
                mx.eval([c.state for c in self.cache])
                behind, self.fed = behind[n:], self.fed + n
            marked = mark(self.cache, k, copies=True)  # y and k - 1 drafts are fed after it, one at a time
            self._mark = None if marked is None else (self.fed, marked, [y])
            ids = mx.array(behind, mx.uint32)
            drafts, qs = [], []
            for i in range(k):
                logprobs = self._logprobs(ids)
                if sampling is None:
                    ids = mx.argmax(logprobs, axis=-1).astype(mx.uint32)
                else:
                    logits = sampling.logits(logprobs)
                    qs.append(mx.softmax(logits, axis=-1))
                    ids = mx.random.categorical(logits, key=None if keys is None else keys[i]).astype(mx.uint32)
                drafts.append(ids)
        self.fed = len(tokens) + k  # y and the drafts but the last are in its cache now
        out = mx.concatenate(drafts)
        if self._mark is not None:
            self._mark[2].extend(cast(list[int], out[:-1].tolist()))
        return out, (mx.concatenate(qs) if qs else None)

    def keep(self, valid: int) -> None:
        mark, self._mark = self._mark, None
        if self.fed <= valid:
            return
        if mark is None:
            trim(self.cache, self.fed - valid)
        else:
            start, marked, ids = mark
            restore(self.cache, marked, self.fed - start)
            if valid > start:
                with mx.stream(generation_stream):
                    self.model(mx.array(ids[:valid - start])[None], cache=self.cache)
        self.fed = valid

    def room(self) -> int:
        """Tokens it can feed and take back: any number where its layers are trimmed or snapshotted."""
        return sys.maxsize if self.undoable else room(self.cache)


@dataclass(slots=True)
class DraftCounts:
    """A request's drafted and kept tokens (its usage reports them)."""

    drafted: int = 0
    accepted: int = 0


@dataclass(slots=True)
class Record:
    """What a draft model's drafting has paid in this worker so far, across its requests (prompt lookup's requests
    each start afresh: what it finds is in each request's own prompt): a request starts paused for the last pause
    taken (`wait` tokens decoded plainly first, then `pause` for its own first pause), so a drafter that keeps nothing
    (a draft model on random weights) is tried a few times per worker, not a few times per request; drafting that pays
    resets it. (Which steps draft so depends on earlier requests too: never what they emit, the verification being
    exact, and a seeded request's draws are its sampler's.)"""

    wait: int = 0
    pause: int = FIRST_PAUSE


@dataclass(slots=True)
class Drafting:
    """One request's drafting: its drafter, its distribution, its draws, and whether drafting pays for it now."""

    drafter: Drafter
    k: int
    sampling: Sampling | None  # None: greedy
    draws: Draws | None  # a seeded request's own stream of draws (its sampler in the solo)
    pricing: Pricing | None  # the worker's costs of drafting (None: draft always: the oracle)
    record: Record | None = None  # the worker's record of what drafting paid (None: this request's alone)
    counts: DraftCounts = field(default_factory=DraftCounts)
    break_even: float | None = None  # drafts kept per verification of k at which drafting pays; None: not priced yet
    costs: Costs | None = None  # the worker's, once priced (None: the oracle's, free)
    surplus: float = 0.0  # drafts kept per verification above its break-even, a moving average
    verifies: int = 0  # since drafting (re)started
    resume_at: int = 0  # the generated count at which a pause ends
    pause: int = FIRST_PAUSE
    idle: int = 1  # tokens to wait after the next step whose drafter proposes nothing (`proposed`)
    idle_until: int = 0  # the generated count before which the drafter is not asked again
    hits: float = 1.0  # drafts kept, and verifications that rejected one, decayed: the acceptance `length` goes by
    misses: float = 1.0

    def __post_init__(self) -> None:
        if self.record is not None:
            self.resume_at, self.pause = self.record.wait, self.record.pause

    def wants(self, generated: int) -> bool:
        return generated >= self.resume_at and generated >= self.idle_until

    def soon(self, generated: int) -> bool:
        """Whether the step at `generated` may draft (else a plain step's graph may be built ahead for it)."""
        p = self.pricing
        return self.wants(generated) and (p is None or not p.idle or p.costs is not None)

    def proposed(self, anything: bool, generated: int) -> None:
        """Whether the drafter proposed anything at this step. Asking costs even when nothing comes (prompt lookup
        finding no match): the token in hand is read before the next one is launched, a stall in the pipelining of
        plain steps; so after nothing it is asked again only `idle` tokens later, doubling up to MAX_IDLE."""
        if anything:
            self.idle = 1
        else:
            self.idle_until = generated + self.idle
            self.idle = min(2 * self.idle, MAX_IDLE)

    def priced(self, model: nn.Module, graph: DecodeGraph | None, generated: int) -> bool:
        """Whether to draft now, the worker's costs known (measured here the first time): never, where even a draft
        kept whole would not pay."""
        if self.break_even is None:
            if self.pricing is not None:
                self.costs = self.pricing.get(model, graph)
                if self.costs is None:  # priced in the worker's idle work, not yet: plain steps meanwhile
                    return False
            self.break_even = -1.0 if self.costs is None else self.costs.break_even(self.k)
            self.surplus = 0.0  # neutral: MIN_VERIFIES verifications keeping nothing pause it
            if self.break_even > NEAR_WHOLE * self.k:
                self.resume_at = sys.maxsize
        return self.wants(generated)

    def length(self, most: int) -> int:
        """The draft length, at most `most`, that emits the most tokens a second at the acceptance seen so far: each
        draft is kept with probability a (drafts kept over those kept plus the verifications that rejected one), so j
        drafts emit (1 - a^(j+1)) / (1 - a) tokens a verification, which costs a verification of j + 1 tokens and j
        draft steps. Unpriced (the oracle): `most`."""
        c = self.costs
        if c is None or most <= 1:
            return most
        a = min(self.hits / (self.hits + self.misses), MAX_ACCEPTANCE)

        def rate(j: int) -> float:
            return (1 - a ** (j + 1)) / (1 - a) / (c.verify(j + 1) + c.drafting(j))
        return max(range(1, most + 1), key=rate)

    def draft_keys(self, k: int) -> list[mx.array] | None:
        """A seeded request's draws at the k drafted positions (the drafter's to draw with); None: unseeded."""
        return None if self.draws is None else self.draws.keys(k)

    def verify(self, logprobs: mx.array, drafts: mx.array, q: mx.array | None) -> tuple[int, int]:
        """(drafts kept, the target's token after them) for the target's logprobs at the k + 1 positions."""
        if self.sampling is None or self.draws is not None:
            if self.draws is None:
                target = mx.argmax(logprobs, axis=-1)
            else:  # each position's token as the seeded sampler draws it there (the module says why)
                draws = self.draws
                target = mx.concatenate([draws.sample(logprobs[i:i + 1], key)
                                         for i, key in enumerate(draws.keys(drafts.size + 1))])
            mx.eval(target, drafts)
            said, proposed = cast(list[int], target.tolist()), cast(list[int], drafts.tolist())
            kept = leading([a == b for a, b in zip(said, proposed)])
            if self.draws is not None:
                self.draws.advance(kept + 1)
            return kept, said[kept]
        if drafts.size == 0:  # nothing drafted (a row of the batch): the token after is a plain draw
            return 0, cast(int, mx.random.categorical(self.sampling.logits(logprobs[0])).item())
        flags, after = accept_sampled(self.sampling.probs(logprobs), drafts, q, None)
        mx.eval(flags, after)
        kept = leading(cast(list[bool], flags.tolist()))
        return kept, cast(list[int], after.tolist())[kept]

    def observe(self, drafted: int, kept: float, generated: int, refed: int = 0) -> None:
        """Count a verification of `drafted` (after which `refed` tokens were fed again); pause drafting when the
        average surplus says it does not pay. (`kept`: a batch's mean over its rows, which count their own.)"""
        self.counts.drafted += drafted
        self.counts.accepted += round(kept)
        self.hits = ACCEPTANCE_DECAY * self.hits + kept
        self.misses = ACCEPTANCE_DECAY * self.misses + (kept < drafted)
        if self.costs is None or self.break_even is None:
            return
        self.surplus += EMA_WEIGHT * (kept - self.costs.break_even(drafted, refed) - self.surplus)
        self.verifies += 1
        if self.verifies >= MIN_VERIFIES and self.surplus < 0:
            self.resume_at = generated + self.pause
            if self.record is not None:
                self.record.wait = self.pause
            self.pause = min(2 * self.pause, MAX_PAUSE)
            self.surplus, self.verifies = 0.0, 0
            if self.record is not None:
                self.record.pause = self.pause
        elif self.verifies >= MIN_VERIFIES and self.record is not None:  # it pays: the next request starts drafting
            self.record.wait, self.record.pause = 0, FIRST_PAUSE


class Speculation:
    """A model's speculative decoding, as configured: its mode, draft length and draft model (one per engine), and
    what drafting costs on this machine (measured once, on first use)."""

    def __init__(self, mode: str = "off", k: int | None = None, draft: nn.Module | None = None,
                 vocab: int = 0, oracle: list[int] | None = None, idle: bool = False,
                 head: MTPHead | DFlashHead | None = None) -> None:
        if mode == "auto":
            mode = "dflash" if isinstance(head, DFlashHead) else default_mode(
                draft is not None, mx.default_device() == mx.gpu, head is not None)
        if mode not in (*MODES, "oracle"):
            raise ValueError(f"speculative mode must be one of {MODES}, not {mode!r}")
        if mode == "draft" and draft is None:
            raise ValueError("speculative mode 'draft' needs a draft model")
        if mode == "mtp" and not isinstance(head, MTPHead):
            raise ValueError("speculative mode 'mtp' needs a checkpoint with an MTP head (mtp.* weights) mlxsup loads")
        if mode == "dflash" and not isinstance(head, DFlashHead):
            raise ValueError("speculative mode 'dflash' needs a DFlash drafter (--draft)")
        if (mode == "oracle" and oracle is None) or (oracle is not None and mode not in ("oracle", "mtp", "dflash")):
            raise ValueError("speculative mode 'oracle' goes with a recorded sequence, and a sequence with it, 'mtp' or "
                             "'dflash'")
        if k is None:  # a DFlash drafter's one pass drafts its whole block; else DEFAULT_DRAFT_TOKENS
            k = head.block - 1 if mode == "dflash" and isinstance(head, DFlashHead) else DEFAULT_DRAFT_TOKENS
        if k < 1:
            raise ValueError(f"num_draft_tokens must be at least 1, not {k}")
        self.mode, self.k, self.draft, self.vocab, self.oracle = mode, k, draft, vocab, oracle
        self.head = head if mode in ("mtp", "dflash") else None  # drafts from the target's hidden states (taps.py)
        # idle: measured in the worker's idle work (`price_step`); a head's draft step priced as a draft model's, a
        # DFlash drafter's block once a verification
        step: nn.Module | None = (None if self.head is None else HeadStep(self.head) if isinstance(self.head, MTPHead)
                                  else DFlashStep(self.head))
        self.pricing = Pricing(k, step if step is not None else draft, idle=idle)
        self.record = Record()

    def price_step(self, model: nn.Module, graph: DecodeGraph | None, sizes: tuple[int, ...]) -> bool:
        """One forward pass of the idle pricing (the solo's costs, then a batch's at each of `sizes`); False once
        there is none left (or nothing drafts)."""
        return self.mode != "off" and self.oracle is None and self.pricing.idle and self.pricing.step(
            model, graph, sizes)

    def drafting(self, msg: Submit) -> Drafting | None:
        """A request's drafting (None: the mode is off): the solo's (a request without logits processors), or a row's
        in the batch (batch_drafting.py: no logits processors but a grammar)."""
        if self.mode == "off" or not msg.speculative:
            return None
        drafter: Drafter
        if self.head is not None:  # the head's drafts, or (given a record) its cost with the record's drafts
            tapped = MTPDrafter(self.head) if isinstance(self.head, MTPHead) else DFlashDrafter(self.head)
            drafter = tapped if self.oracle is None else Forced(tapped, Oracle(self.oracle))
        else:
            drafter = (Oracle(self.oracle) if self.oracle is not None else PromptLookup() if self.draft is None
                       else ModelDrafter(self.draft, self.vocab))
        sampling = None if msg.temperature == 0 else Sampling(
            msg.temperature, msg.top_p, msg.min_p, msg.top_k if self.vocab <= 0 or msg.top_k < self.vocab else 0)
        draws = None if msg.seed is None or sampling is None else Draws(msg.seed, len(msg.resume_tokens), sampling)
        if self.oracle is not None:
            return Drafting(drafter, self.k, sampling, draws, None)
        # a draft model's pauses carry over to the next request (Record); prompt lookup's acceptance is its request's
        # prompt's (a code edit after a chat), so each request starts drafting
        return Drafting(drafter, self.k, sampling, draws, self.pricing,
                        self.record if isinstance(drafter, (ModelDrafter, MTPDrafter, DFlashDrafter)) else None)


def load_draft(path: Path, tokenizer: Any) -> tuple[nn.Module, int]:
    """The draft model and its weights' bytes; a ValueError when its tokenizer is not the model's."""
    from worker.mlx_engine.loading import load_with_progress

    model, draft_tokenizer = load_with_progress(path, lambda *_: None)
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"the draft model at {path} has another tokenizer than the model's: speculative decoding "
                         "needs the same one (a smaller model of the same family)")
    return model, sum(p.stat().st_size for p in path.glob("*.safetensors"))
