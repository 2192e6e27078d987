"""Speculative decoding inside the continuous batch: every row drafts, one verification for all, each
row keeping its own count.

The solo (solo.py) drafts for a request alone. When the batch is decoding (no prompt chunk pending), every row has
its drafter (speculative.py's `Drafting`) and no logits processors but a grammar (guided.GrammarProcessor), the
caches can take tokens back and there are at most MAX_DRAFT_BATCH rows, an engine step may draft instead of calling
`gen.next()`. It reads the tokens in hand
y_i (GenerationBatch's `_next_tokens`: sampled, not fed yet), each row proposes up to k drafts after its history and
y_i, and the model runs once on [B, n + 1] = [y_i, drafts_i], n the longest proposal (a shorter one padded: its
padding is never kept). Each row verifies its own drafts by its own rule: a greedy row keeps the drafts equal to
the target's argmax, a sampled row applies the standard accept/reject rule to its distribution, and a seeded one
draws with its own `Draws` (which is also its sampler in the batch), exactly as the solo verifies. Row i keeps its
first a_i drafts and emits y_i and them, each through its stop matcher and max_tokens as GenerationBatch.next does;
the token in hand afterwards is the target's token after them, with its logprobs: a following step, plain or
drafted, continues seamlessly. Greedy ids are therefore plain decoding's, token for token, and seeded ids plain
seeded decoding's.

A constrained row's matcher is taken along its drafts before the verification (`GrammarProcessor.along`): it
consumes y and the drafts its grammar allows, and the first draft it forbids ends the row's draft; the masks after
each are applied to that row's logits at those positions, as its processor masks a plain step's, so verification,
`after` and the logprobs emitted are those of constrained decoding. The drafts rejected go back out of the matcher
(`back`): after the step it has consumed exactly the tokens emitted, and the next plain step's processor consumes
the token in hand, as it would have.

A row's proposal stops at the first token at which it would finish (a stop token, its max_tokens) or, with reply
snapshots, reach a block's end: a finishing row ends at its last kept token, its extracted cache and all_tokens
holding exactly the tokens it emitted, and a snapshot boundary is met exactly, as plain decoding meets them.

Rollback (`undo`): rows keeping as many go back uniformly: BatchKVCache is trimmed, and so is a
BatchRotatingKVCache while the window has room for the tokens fed; recurrent state (ArraysCache) and a full sliding
window are marked before the verification, given back after a rejection, and the kept tokens fed again in one
forward pass. Rows keeping different numbers use mlx-lm's own way of feeding prompts of different lengths in one
batch (right padding turned into left padding): a row that kept fewer than the most is shifted right, its rejected
tokens becoming masked padding; recurrent layers are fed again up to each row's own length.

Paying: per batch-size bucket (1, 2, 4, 8) the worker measures once what a verification of [b, k + 1] costs against
a plain step of b rows (draft_pricing.Pricing at that size), and the solo's pause rule (speculative.Drafting:
break-even, a moving average of the surplus, doubling pauses) runs on the mean count kept over the rows, so a batch
where drafting does not pay (many streams, compute-bound, rows disagreeing) stops drafting by its own measurement.

Invariants: after every step each row's cache holds exactly `batch.tokens[i]`, the tokens emitted, and
`_next_tokens` holds each row's next token, not fed; nothing here runs while a prompt is pending; a drafting step
emits exactly what the plain steps it replaces would have (for a sampled unseeded row: in distribution).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache

from worker.mlx_engine.draft_pricing import Costs, Pricing
from worker.mlx_engine.guided import GrammarProcessor
from worker.mlx_engine.quantized_kv import BatchQuantizedKVCache
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


def grammar(processors: list | None) -> GrammarProcessor | None | bool:
    """A row's grammar, where its only logits processor is one that can draft (its masks taken along the drafts);
    None: no processors; False: processors a drafting step cannot apply (penalties, a reasoning budget)."""
    if not processors:
        return None
    p = processors[0]
    return p if len(processors) == 1 and isinstance(p, GrammarProcessor) and p.drafts_ready() else False


def undoable(cache: list) -> bool:
    """Whether every layer of a batch's cache can be trimmed or marked."""
    return all(isinstance(c, (BatchKVCache, BatchRotatingKVCache, ArraysCache)) for c in cache)


def undo(model: Callable[..., object], cache: list, ids: mx.array, keep: list[int],
         marked: dict[int, Any] | None) -> int:
    """Keep row i's first keep[i] of the tokens `ids` (B, fed) just fed: as if only those had been fed. The tokens
    fed again (0: none).

    Rows keeping as many: trimmed back, or the marked layers given their state back, the others trimmed by all, and
    the kept tokens fed again. Rows keeping different numbers go as mlx-lm's BatchGenerator feeds prompts of
    different lengths (`prepare` with each row's length and right padding, `finalize`): attention layers shift a row
    that kept fewer right by the difference, its rejected tokens becoming left padding, and recurrent layers stop at
    each row's length. Where every layer is a BatchKVCache, a trim to the most kept and that shift do it; otherwise
    the most kept are fed again, each row to its own length."""
    fed, most = ids.shape[1], max(keep)
    if min(keep) == fed:
        return 0
    padding = [most - k for k in keep]
    if marked is None and (not any(padding) or all(type(c) in (BatchKVCache, BatchQuantizedKVCache) for c in cache)):
        for c in cache:
            c.trim(fed - most)
            if any(padding):
                c.prepare(right_padding=padding)
                c.finalize()
        return 0
    for i, c in enumerate(cache):
        if marked is not None and i in marked:
            c.state = marked[i]
        else:
            c.trim(fed)
    if any(padding):
        for c in cache:
            c.prepare(lengths=keep, right_padding=padding)
    model(ids[:, :most], cache=cache)
    if any(padding):
        for c in cache:
            c.finalize()
    return most


def masked(logits: mx.array, masks: dict[int, np.ndarray | None]) -> mx.array:
    """`logits` (B, n + 1, width) with each constrained row's masks (positions, vocab) applied from its first position
    on: what its grammar forbids is -inf, as its processor makes it in a plain step (past the tokenizer's vocabulary
    too); other rows and positions as they are. Only the constrained rows' masks go to the device."""
    _, n, width = logits.shape
    rows = []
    for i in range(logits.shape[0]):
        m = masks.get(i)
        if m is None:
            rows.append(logits[i])
            continue
        allow = np.ones((n, width), np.bool_)
        k = min(m.shape[1], width)
        allow[:m.shape[0], :k] = m[:, :k].astype(np.bool_)
        allow[:m.shape[0], k:] = False
        rows.append(mx.where(mx.array(allow), logits[i], mx.array(-np.inf, dtype=logits.dtype)))
    return mx.stack(rows)


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
        """A request in the batch drafts with `drafting` (a seeded one's sampler in the batch is its `draws`)."""
        if drafting is not None:
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
        if any(d is None for d in rows) or not undoable(batch.prompt_cache):
            return None
        if any(grammar(ps) is False for ps in batch.logits_processors or []):  # penalties, a budget: plain steps
            return None
        return cast(list[Drafting], rows)

    def _pace(self, row: Drafting, size: int) -> Drafting:
        """The batch's pricing and pause rule at its size (a Drafting whose own drafter proposes nothing: each row
        proposes with its own); free, and always drafting, for the oracle."""
        key = (row.pricing, bucket(size))
        if (pace := self._paces.get(key)) is None:
            pricing = None if row.pricing is None else row.pricing.at(key[1], self.costs)
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
        qs: list[mx.array | None] = []
        for i, d in enumerate(rows):
            drafts, q = d.drafter.propose(batch.tokens[i], ys[i], d.k, d.sampling, d.draft_keys(d.k)) if (
                d.drafter.room() > 1) else (None, None)
            p = cast(list[int], drafts.tolist()) if drafts is not None else []
            p = p[:self._limit(batch, i, [ys[i], *p])]
            proposed.append(p)
            qs.append(None if q is None else q[:len(p)])
        pace.proposed(any(proposed), self.decoded)  # no row with anything to propose: no drafting step for a while
        # a constrained row's drafts run as far as its grammar allows them, its masks taken along (its matcher
        # consumes y and them; what verification rejects goes back out after it)
        grammars = [cast(GrammarProcessor | None, grammar(ps)) for ps in batch.logits_processors or [[]] * len(rows)]
        masks: dict[int, np.ndarray | None] = {}
        if any(proposed):
            for i, g in enumerate(grammars):
                if g is not None:
                    masks[i], allowed = g.along(ys[i], proposed[i])
                    proposed[i] = proposed[i][:allowed]
                    qs[i] = None if qs[i] is None else cast(mx.array, qs[i])[:allowed]
        n = max(len(p) for p in proposed)
        if n < 1:
            for i, d in enumerate(rows):
                d.drafter.keep(len(batch.tokens[i]))  # a draft model fed its drafts: taken back
                if (g := grammars[i]) is not None and i in masks:
                    g.back(1 if masks[i] is not None else 0)  # y: the plain step's processor consumes it
            return None
        # a row proposing fewer than n is padded with its last token: a position past its own drafts is never kept
        fed = [[ys[i], *p] for i, p in enumerate(proposed)]
        ids = mx.array([f + f[-1:] * (n + 1 - len(f)) for f in fed], mx.uint32)
        cache = batch.prompt_cache
        marked = mark(cache, n + 1)
        logits = self.model(ids, cache=cache)
        if any(m is not None for m in masks.values()):
            logits = masked(logits, masks)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        kept, after = self._verify(rows, logprobs, proposed, qs)
        for i, g in enumerate(grammars):
            if g is not None and masks.get(i) is not None:
                g.back(len(proposed[i]) - kept[i])
                batch._token_context[i].update_and_fetch(mx.array(fed[i][:kept[i] + 1], mx.int32))
        refed = undo(self.model, cache, ids, [a + 1 for a in kept], marked)
        pace.observe(n, sum(kept) / len(kept), self.decoded, refed)
        self.decoded += max(kept) + 1
        for i, d in enumerate(rows):
            d.counts.drafted += len(proposed[i])
            d.counts.accepted += kept[i]
            d.drafter.keep(len(batch.tokens[i]) + kept[i] + 1)
        return self._emit(batch, [[ys[i], *p[:a]] for i, (p, a) in enumerate(zip(proposed, kept))], logprobs, after)

    @staticmethod
    def _verify(rows: list[Drafting], logprobs: mx.array, proposed: list[list[int]],
                qs: list[mx.array | None]) -> tuple[list[int], list[int]]:
        """Each row's drafts kept and the target's token after them: a greedy row's where they are the argmax (all
        such rows read at once), a sampled row's by its own rule (`Drafting.verify`: its distribution, its draws)."""
        greedy = [i for i, d in enumerate(rows) if d.sampling is None]
        read = logprobs if len(greedy) == len(rows) else logprobs[mx.array(greedy)] if greedy else None
        said = cast(list[list[int]], mx.argmax(read, axis=-1).tolist()) if read is not None else []
        kept, after = [0] * len(rows), [0] * len(rows)
        for i, s in zip(greedy, said):
            kept[i] = leading([a == b for a, b in zip(s, proposed[i])])
            after[i] = s[kept[i]]
        for i, d in enumerate(rows):
            if d.sampling is not None:
                p = proposed[i]
                kept[i], after[i] = d.verify(logprobs[i, :len(p) + 1], mx.array(p, mx.uint32), qs[i])
        return kept, after

    def _emit(self, batch: GenerationBatch, kept: list[list[int]], logprobs: mx.array, after: list[int]) -> list:
        """Each row's kept tokens as GenerationBatch.next emits a token (a finish only at a row's last one, by
        `_limit`), and the target's token after them in hand; finished rows leave the batch."""
        y_logprobs = batch._next_logprobs
        batch._next_tokens = mx.array(after, mx.uint32)
        batch._next_logprobs = [logprobs[i, len(tokens) - 1] for i, tokens in enumerate(kept)]
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
