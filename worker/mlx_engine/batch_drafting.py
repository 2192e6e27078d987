"""Speculative decoding inside the continuous batch (issue 30): every row drafts, one verification for all, lockstep.

The solo (solo.py) drafts for a request alone. When the batch is decoding (no prompt chunk pending), every row is
greedy with no logits processors and has its drafter (speculative.py's `Drafting`), the caches can take tokens back
and there are at most MAX_DRAFT_BATCH rows, an engine step may draft instead of calling `gen.next()`. It reads the
tokens in hand y_i (GenerationBatch's `_next_tokens`: sampled, not fed yet), each row proposes drafts after its
history and y_i, the model runs once on [B, n + 1] = [y_i, drafts_i], and the argmax is taken at every position.
Row i's first a_i drafts equal the target's argmax; the batch keeps m = min_i a_i of them in every row, so every
cache goes back uniformly to its m + 1 tokens kept. Each row emits y_i and its first m drafts, each through its stop
matcher and max_tokens as GenerationBatch.next does, and the token in hand afterwards is the argmax at position m,
with its logprobs: a following step, plain or drafted, continues seamlessly. Greedy ids are therefore plain
decoding's, token for token; rows that disagree cost only speed.

n, the drafts verified, is at most the shortest proposal (a position past it could never be kept in every row) and
stops at the first token at which any row would finish (a stop token, its max_tokens) or, with reply snapshots,
reach a block's end: a finishing row then ends at its last kept token, its extracted cache and all_tokens holding
exactly the tokens it emitted, and a snapshot boundary is met exactly, as plain decoding meets them.

Rollback, uniform over the rows: BatchKVCache is trimmed, and so is a BatchRotatingKVCache while the window has room
for the tokens fed; recurrent state (ArraysCache) and a full sliding window are marked before
the verification, given back after a rejection, and the m + 1 kept tokens fed again in one forward pass.

Paying: per batch-size bucket (1, 2, 4, 8) the worker measures once what a verification of [b, k + 1] costs against
a plain step of b rows (draft_pricing.Pricing at that size), and the solo's pause rule (speculative.Drafting:
break-even, a moving average of the surplus, doubling pauses) runs on the lockstep kept count m, so a batch where
drafting does not pay (many streams, compute-bound, rows disagreeing) stops drafting by its own measurement.

Invariants: after every step each row's cache holds exactly `batch.tokens[i]`, the tokens emitted, and
`_next_tokens` holds each row's next token, not fed; nothing here runs while a prompt is pending; a drafting step
emits exactly what the plain steps it replaces would have.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache

from worker.mlx_engine.draft_pricing import Costs, Pricing
from worker.mlx_engine.speculative import Drafting, Oracle, leading

MAX_DRAFT_BATCH = 8  # past this many rows a step is compute-bound: a verification costs what plain steps do
BUCKETS = (1, 2, 4, 8)  # batch sizes priced: a batch is priced as the next one up


def bucket(rows: int) -> int:
    return next(b for b in BUCKETS if b >= rows)


def _copied(a: mx.array | None) -> mx.array | None:
    """A copy of a small bookkeeping array that the caches change in place (`-=`), which a reference would follow."""
    return None if a is None else mx.array(a)


def mark(cache: list, n: int) -> dict[int, Any] | None:
    """Before feeding n tokens to every row: the state of the layers a trim cannot take them back out of (recurrent
    state, a sliding window without room for them), by layer; None: a trim does it for every layer. A feed of n >= 2
    tokens replaces the layers' arrays rather than writing into them, so references hold the state."""
    marked: dict[int, Any] = {}
    for i, c in enumerate(cache):
        if isinstance(c, ArraysCache):
            marked[i] = (list(c.cache), _copied(c.left_padding), _copied(c.lengths))
        elif isinstance(c, BatchRotatingKVCache) and (c.rotated or c._idx + n > c.max_size):
            keys, values, offset, left_padding, *rest = c.state
            marked[i] = (keys, values, _copied(offset), _copied(left_padding), *rest)
    return marked or None


def undoable(cache: list) -> bool:
    """Whether every layer of a batch's cache can be trimmed or marked."""
    return all(isinstance(c, (BatchKVCache, BatchRotatingKVCache, ArraysCache)) for c in cache)


def undo(model: Callable[..., object], cache: list, ids: mx.array, keep: int, marked: dict[int, Any] | None) -> int:
    """Keep the first `keep` of the tokens `ids` (B, fed) just fed, in every row: trimmed back, or the marked layers
    given their state back, the others trimmed by all, and the kept tokens fed again. The tokens fed again."""
    fed = ids.shape[1]
    if keep == fed:
        return 0
    if marked is None:
        for c in cache:
            c.trim(fed - keep)
        return 0
    for i, c in enumerate(cache):
        if i in marked:
            c.state = marked[i]
        else:
            c.trim(fed)
    model(ids[:, :keep], cache=cache)
    return keep


class BatchDrafting:
    """The batch's rows that may draft (their `Drafting`, by the generator's uid), and the lockstep drafting step."""

    def __init__(self, model: nn.Module, gen: BatchGenerator, boundary: int = 0) -> None:
        self.model, self.gen = model, gen
        self.boundary = boundary  # reply snapshots are taken where a row's cache fills a multiple of it (0: none)
        self.rows: dict[int, Drafting] = {}
        self.costs: Costs | None = None  # pinned for every batch size (tests, a known machine); None: measured
        self._paces: dict[tuple[Pricing | None, int], Drafting] = {}
        self.decoded = 0  # tokens decoded a row while the batch could draft: the pauses' clock

    def add(self, uid: int, drafting: Drafting | None) -> None:
        """A request in the batch drafts with `drafting` where greedy (sampled rows keep every step plain)."""
        if drafting is not None and drafting.sampling is None:
            self.rows[uid] = drafting

    def drop(self, uid: int) -> None:
        self.rows.pop(uid, None)

    def _drafting_rows(self) -> list[Drafting] | None:
        """Every row's drafting, where the batch may draft this step; None: a plain step."""
        if not self.rows:  # nothing drafts (speculative decoding off): no cost on the batch's steps
            return None
        gen, batch = self.gen, self.gen._generation_batch
        if gen._unprocessed_sequences or len(gen._prompt_batch) or not 0 < len(batch) <= MAX_DRAFT_BATCH:
            return None
        rows = [self.rows.get(uid) for uid in batch.uids]
        if any(d is None for d in rows) or any(batch.logits_processors) or not undoable(batch.prompt_cache):
            return None
        return cast(list[Drafting], rows)

    def _pace(self, row: Drafting, size: int) -> Drafting:
        """The batch's pricing and pause rule at its size (a Drafting whose own drafter proposes nothing: each row
        proposes with its own); free, and always drafting, for the oracle."""
        key = (row.pricing, bucket(size))
        if (pace := self._paces.get(key)) is None:
            pricing = None if row.pricing is None else Pricing(row.k, row.pricing.draft, self.costs, rows=key[1])
            pace = self._paces[key] = Drafting(Oracle([]), row.k, None, None, pricing)
        return pace

    def step(self) -> list | None:
        """A drafting step's responses (GenerationBatch.Response, several a row); None: take a plain step instead."""
        rows = self._drafting_rows()
        if rows is None:
            return None
        pace = self._pace(rows[0], len(rows))
        if pace.priced(self.model, None, self.decoded):
            with mx.stream(self.gen.stream):
                responses = self._draft(self.gen._generation_batch, rows, pace)
            if responses is not None:
                return responses
        self.decoded += 1
        return None

    def _limit(self, batch: GenerationBatch, i: int, tokens: list[int]) -> int:
        """The most drafts row i can keep after `tokens` ([y, drafts...]): up to the token at which it finishes, and
        the one that fills its cache to a snapshot boundary."""
        matcher, count = copy.copy(batch._matchers[i]), batch._num_tokens[i]
        limit = len(tokens) - 1
        for j, token in enumerate(tokens):
            count += 1
            if matcher.advance(token) or count >= batch.max_tokens[i]:
                limit = j
                break
        if self.boundary:
            limit = min(limit, self.boundary - len(batch.tokens[i]) % self.boundary - 1)
        return limit

    def _draft(self, batch: GenerationBatch, rows: list[Drafting], pace: Drafting) -> list | None:
        y = batch._next_tokens
        mx.eval(y)
        ys = cast(list[int], y.tolist())
        proposed: list[list[int]] = []
        for i, d in enumerate(rows):
            drafts, _ = d.drafter.propose(batch.tokens[i], ys[i], d.k, None, None) if d.drafter.room() > 1 else (
                None, None)
            proposed.append(cast(list[int], drafts.tolist()) if drafts is not None else [])
        pace.proposed(all(proposed), self.decoded)  # a row with nothing to propose: no drafting step for a while
        n = min(self._limit(batch, i, [ys[i], *p]) for i, p in enumerate(proposed))
        if n < 1:
            for i, d in enumerate(rows):
                d.drafter.keep(len(batch.tokens[i]))  # a draft model fed its drafts: taken back
            return None
        ids = mx.concatenate([y.astype(mx.uint32)[:, None], mx.array([p[:n] for p in proposed], mx.uint32)], axis=1)
        cache = batch.prompt_cache
        marked = mark(cache, n + 1)
        logits = self.model(ids, cache=cache)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        target = mx.argmax(logprobs, axis=-1)
        said = cast(list[list[int]], target.tolist())
        m = min(leading([a == b for a, b in zip(s, p[:n])]) for s, p in zip(said, proposed))
        refed = undo(self.model, cache, ids, m + 1, marked)
        pace.observe(n, m, self.decoded, refed)
        self.decoded += m + 1
        for i, d in enumerate(rows):
            d.counts.drafted += n
            d.counts.accepted += m
            d.drafter.keep(len(batch.tokens[i]) + m + 1)
        return self._emit(batch, [[ys[i], *p[:m]] for i, p in enumerate(proposed)], logprobs, target[:, m])

    def _emit(self, batch: GenerationBatch, kept: list[list[int]], logprobs: mx.array, after: mx.array) -> list:
        """Each row's kept tokens as GenerationBatch.next emits a token (a finish only at a row's last one, by
        `_limit`), and the target's token after them in hand; finished rows leave the batch."""
        y_logprobs = batch._next_logprobs
        m = len(kept[0]) - 1
        batch._next_tokens, batch._next_logprobs = after, list(logprobs[:, m])
        responses, going = [], []
        for i, tokens in enumerate(kept):
            batch.tokens[i].extend(tokens)
            reason = None
            for j, token in enumerate(tokens):
                batch._num_tokens[i] += 1
                reason = "length" if batch._num_tokens[i] >= batch.max_tokens[i] else None
                if batch._matchers[i].advance(token):
                    reason = "stop"
                done = reason is not None
                responses.append(GenerationBatch.Response(
                    batch.uids[i], token, y_logprobs[i] if j == 0 else logprobs[i, j - 1], reason,
                    batch.extract_cache(i) if done else None, batch.tokens[i] if done else None))
            if reason is None:
                going.append(i)
        if len(going) < len(kept):
            batch.filter(going)
        return responses
