"""Speculative decoding for the solo (issue 30, first slice): draft a few tokens, verify them in one forward pass.

A stream alone is bound by reading the weights once per token; verifying k drafted tokens reads them once for up
to k + 1 tokens. The solo (solo.py) asks its `Drafting` for a step: the drafter proposes up to k tokens after the
token in hand, the target model runs on [token, drafts], and the verification keeps the longest acceptable prefix
plus one token of the target's own (the correction, or the bonus when every draft holds).

Drafters: prompt lookup (`PromptLookup`: the tokens that followed the latest earlier occurrence of the last n
tokens, n from MAX_NGRAM down to 1, in the prompt and the output so far, repeated up to k where they run into
the end (a loop): no second model, and an agent editing code it was just shown repeats long runs of it), and a draft model (`ModelDrafter`: a smaller model with the same
tokenizer, loaded in the same worker by `load_draft`, its own cache kept in step with the target's).

Exact: a greedy request keeps a draft token only where it is the target's argmax, so its ids are plain decoding's.
A sampled request uses the standard rule on the request's own distribution (its temperature, top-p, min-p,
top-k: `Sampling.probs`): keep draft token d with probability min(1, p(d) / q(d)), else sample from
max(p - q, 0) renormalised; prompt lookup's q is one-hot (keep d with probability p(d), else sample from p
with d removed). A seeded request draws from its own key, split per verification, so it is reproducible: which
steps draft depends on the tokens only (never on time).

Rollback: the target's cache gets [token, drafts] and is trimmed back to the tokens kept. A cache that cannot be
trimmed gets no drafts (`room`): recurrent layers (ArraysCache: the Qwen3.5 hybrids) never, a sliding window
(RotatingKVCache) only while the window is not full (a full one overwrites what a trim would need); there the
request decodes plainly, which is parity trivially. Snapshot-based rollback is a later slice.

Paying: a verification of k drafts costs a forward pass of k + 1 tokens; the worker measures what that costs here
against a plain step, once (draft_pricing.py), which gives the drafts kept per verification at which drafting
pays (`Costs.break_even`). A request where even a fully kept draft would not pay never drafts; otherwise it
measures its own acceptance (a moving average of drafts kept per verification), and below break-even it stops
drafting for a pause that doubles each time (FIRST_PAUSE..MAX_PAUSE tokens), so a draft that is gibberish costs
a few verifications per pause, and a copying stretch later is still found. The costs are fixed per worker, so
which steps draft depends on the tokens only.

The oracle (`Oracle`, mode "oracle": a test and bench hook, not a config value) proposes a recorded sequence,
the target's own greedy output from an earlier plain run: every draft is kept and drafting costs nothing, so it
measures verification itself, the mechanism's ceiling; it always drafts.

Invariants: the target cache after a step holds exactly the tokens kept; a draft model's cache holds a prefix of
them; nothing here emits a token: the solo does, in order, stopping where plain decoding stops.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import CacheList, RotatingKVCache, make_prompt_cache
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from protocol.messages import Submit
from worker.mlx_engine.decode_graph import DecodeGraph
from worker.mlx_engine.draft_pricing import Pricing

MODES = ("off", "prompt-lookup", "draft")  # the config's and the worker's; "oracle" is a hook for tests and the bench
DEFAULT_DRAFT_TOKENS = 4
MAX_NGRAM = 3  # the longest suffix prompt lookup matches; then shorter ones, down to one token
EMA_WEIGHT = 0.25  # each verification's weight in that average
MIN_VERIFIES = 4  # verifications before the average may pause drafting (after a start or a pause)
FIRST_PAUSE, MAX_PAUSE = 32, 1024  # tokens decoded plainly after the first pause, doubled per pause up to the max
DRAFT_PREFILL = 512  # the draft model's catch-up (its prompt) in chunks of this many tokens


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


def room(cache: list | tuple) -> int:
    """How many tokens can be fed to `cache` and trimmed back exactly (0: none)."""
    left = sys.maxsize
    for c in cache:
        if isinstance(c, CacheList):
            left = min(left, room(c.caches))
        elif isinstance(c, RotatingKVCache):
            left = min(left, max(0, c.max_size - c.offset))
        elif not c.is_trimmable():
            return 0
    return left


def trim(cache: list, n: int) -> None:
    if n > 0:
        for c in cache:
            c.trim(n)


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
                key: mx.array | None) -> tuple[mx.array | None, mx.array | None]:
        """Up to k drafts after tokens + [y] (None: none), and the draft's probabilities (None: deterministic)."""
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
                key: mx.array | None) -> tuple[mx.array | None, mx.array | None]:
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
                key: mx.array | None) -> tuple[mx.array | None, mx.array | None]:
        n = len(tokens)  # y is at position n; checking it alone is enough while the history follows the record
        drafts = self.sequence[n + 1:n + 1 + k] if n < len(self.sequence) and self.sequence[n] == y else []
        return (mx.array(drafts, mx.uint32) if drafts else None), None

    def keep(self, valid: int) -> None:
        """Nothing to undo."""

    def room(self) -> int:
        return sys.maxsize


class ModelDrafter:
    """A draft model's proposals for one request; its cache holds `fed` tokens of the request's history."""

    def __init__(self, model: nn.Module, vocab: int) -> None:
        self.model = model
        self.vocab = vocab  # the target's logits width: the draft's probabilities are cut or padded to it
        self.cache = make_prompt_cache(model)
        self.fed = 0

    def _logprobs(self, ids: mx.array) -> mx.array:
        logits = self.model(ids[None], cache=self.cache)[0, -1:, :]
        width = logits.shape[-1]
        if width > self.vocab:
            logits = logits[:, :self.vocab]
        elif width < self.vocab:
            logits = mx.concatenate([logits, mx.full((1, self.vocab - width), -mx.inf, logits.dtype)], axis=-1)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def propose(self, tokens: list[int], y: int, k: int, sampling: Sampling | None,
                key: mx.array | None) -> tuple[mx.array | None, mx.array | None]:
        behind = tokens[self.fed:] + [y]
        k = min(k, room(self.cache) - len(behind))
        if k < 1:
            return None, None
        with mx.stream(generation_stream):
            while len(behind) > 1:  # the prompt, the first time: in chunks, as generate_step prefills
                n = min(DRAFT_PREFILL, len(behind) - 1)
                self.model(mx.array(behind[:n])[None], cache=self.cache)
                mx.eval([c.state for c in self.cache])
                behind, self.fed = behind[n:], self.fed + n
            ids = mx.array(behind, mx.uint32)
            drafts, qs = [], []
            keys = mx.random.split(key, k) if key is not None else [None] * k
            for i in range(k):
                logprobs = self._logprobs(ids)
                if sampling is None:
                    ids = mx.argmax(logprobs, axis=-1).astype(mx.uint32)
                else:
                    logits = sampling.logits(logprobs)
                    qs.append(mx.softmax(logits, axis=-1))
                    ids = mx.random.categorical(logits, key=keys[i]).astype(mx.uint32)
                drafts.append(ids)
        self.fed = len(tokens) + k  # y and the drafts but the last are in its cache now
        return mx.concatenate(drafts), (mx.concatenate(qs) if qs else None)

    def keep(self, valid: int) -> None:
        if self.fed > valid:
            trim(self.cache, self.fed - valid)
            self.fed = valid

    def room(self) -> int:
        return room(self.cache)


@dataclass(slots=True)
class DraftCounts:
    """A request's drafted and kept tokens (its usage reports them)."""

    drafted: int = 0
    accepted: int = 0


@dataclass(slots=True)
class Drafting:
    """One request's drafting: its drafter, its distribution, its key, and whether drafting pays for it now."""

    drafter: Drafter
    k: int
    sampling: Sampling | None  # None: greedy
    key: mx.array | None  # a seeded request's own stream of draws
    pricing: Pricing | None  # the worker's costs of drafting (None: draft always: the oracle)
    counts: DraftCounts = field(default_factory=DraftCounts)
    break_even: float | None = None  # drafts kept per verification below which drafting pauses; None: not priced yet
    average: float = 0.0  # drafts kept per verification, a moving average
    verifies: int = 0  # since drafting (re)started
    resume_at: int = 0  # the generated count at which a pause ends
    pause: int = FIRST_PAUSE

    def wants(self, generated: int) -> bool:
        return generated >= self.resume_at

    def priced(self, model: nn.Module, graph: DecodeGraph | None, generated: int) -> bool:
        """Whether to draft now, the worker's costs known (measured here the first time): never, where even a draft
        kept whole would not pay."""
        if self.break_even is None:
            self.break_even = -1.0 if self.pricing is None else self.pricing.get(model, graph).break_even(self.k)
            self.average = min(float(self.k), self.break_even + 1)
            if self.break_even >= self.k:
                self.resume_at = sys.maxsize
        return self.wants(generated)

    def next_key(self) -> mx.array | None:
        if self.key is None:
            return None
        self.key, draw = mx.random.split(self.key)
        return draw

    def verify(self, logprobs: mx.array, drafts: mx.array, q: mx.array | None) -> tuple[int, int]:
        """(drafts kept, the target's token after them) for the target's logprobs at the k + 1 positions."""
        if self.sampling is None:
            target = mx.argmax(logprobs, axis=-1)
            mx.eval(target, drafts)
            said, proposed = cast(list[int], target.tolist()), cast(list[int], drafts.tolist())
            kept = leading([a == b for a, b in zip(said, proposed)])
            return kept, said[kept]
        flags, after = accept_sampled(self.sampling.probs(logprobs), drafts, q, self.next_key())
        mx.eval(flags, after)
        kept = leading(cast(list[bool], flags.tolist()))
        return kept, cast(list[int], after.tolist())[kept]

    def observe(self, drafted: int, kept: int, generated: int) -> None:
        """Count a verification; pause drafting when its average says it does not pay."""
        self.counts.drafted += drafted
        self.counts.accepted += kept
        if self.break_even is None or self.break_even < 0:
            return
        self.average += EMA_WEIGHT * (kept - self.average)
        self.verifies += 1
        if self.verifies >= MIN_VERIFIES and self.average < self.break_even:
            self.resume_at = generated + self.pause
            self.pause = min(2 * self.pause, MAX_PAUSE)
            self.average, self.verifies = min(float(self.k), self.break_even + 1), 0


class Speculation:
    """A model's speculative decoding, as configured: its mode, draft length and draft model (one per engine), and
    what drafting costs on this machine (measured once, on first use)."""

    def __init__(self, mode: str = "off", k: int = DEFAULT_DRAFT_TOKENS, draft: nn.Module | None = None,
                 vocab: int = 0, oracle: list[int] | None = None) -> None:
        if mode not in (*MODES, "oracle"):
            raise ValueError(f"speculative mode must be one of {MODES}, not {mode!r}")
        if mode == "draft" and draft is None:
            raise ValueError("speculative mode 'draft' needs a draft model")
        if (mode == "oracle") != (oracle is not None):
            raise ValueError("speculative mode 'oracle' goes with a recorded sequence, and a sequence with it")
        if k < 1:
            raise ValueError(f"num_draft_tokens must be at least 1, not {k}")
        self.mode, self.k, self.draft, self.vocab, self.oracle = mode, k, draft, vocab, oracle
        self.pricing = Pricing(k, draft)

    def drafting(self, msg: Submit) -> Drafting | None:
        """A request's drafting (None: the mode is off). Only the solo drafts; it takes no logits processors."""
        if self.mode == "off":
            return None
        drafter: Drafter = (Oracle(self.oracle) if self.oracle is not None else PromptLookup() if self.draft is None
                            else ModelDrafter(self.draft, self.vocab))
        sampling = None if msg.temperature == 0 else Sampling(
            msg.temperature, msg.top_p, msg.min_p, msg.top_k if self.vocab <= 0 or msg.top_k < self.vocab else 0)
        key = mx.random.key(msg.seed) if msg.seed is not None and sampling is not None else None
        return Drafting(drafter, self.k, sampling, key, self.pricing if self.oracle is None else None)


def load_draft(path: Path, tokenizer: Any) -> tuple[nn.Module, int]:
    """The draft model and its weights' bytes; a ValueError when its tokenizer is not the model's."""
    from worker.mlx_engine.loading import load_with_progress

    model, draft_tokenizer = load_with_progress(path, lambda *_: None)
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"the draft model at {path} has another tokenizer than the model's: speculative decoding "
                         "needs the same one (a smaller model of the same family)")
    return model, sum(p.stat().st_size for p in path.glob("*.safetensors"))
