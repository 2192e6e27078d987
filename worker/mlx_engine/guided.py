"""Per-request decoding in the batch: grammar constraints (llguidance), seeded samplers, penalties, logprobs.

Everything here is per sequence and plugs into mlx-lm's BatchGenerator as it is: a logits processor
list and a sampler given to `insert` for each request, so a constrained, seeded or penalised request
shares the batch with plain ones and costs them nothing but its own row's work.

llguidance was chosen over xgrammar and outlines-core (bench/ section `constrained` measures it):
its wheels are abi3 for macOS arm64 and Linux with no dependencies (xgrammar's pull in torch;
outlines-core's are per Python version), one Lark grammar holds a family's call syntax, its special
tokens and the arguments' JSON schema together (outlines-core takes a regex, no special tokens), and
it builds masks lazily, with no per-schema index to compile before the first token.

Refuse at the door: a grammar is built, and its first mask and the one past its forced tokens computed, at
submit, within bounded work (LIMITS), so a schema llguidance cannot hold is a 400 before any token; one that
still fails mid-request marks its processor failed and the engine ends that request with an error, never
with unconstrained output. Errors are reported by their first line, never with the grammar's text.

Invariants: a grammar processor advances its matcher by exactly the tokens its sequence sampled
(the one before each call, none before the first); a seeded sampler draws from its own key, split
once per token, so its choices do not depend on what else is in the batch; logprobs are finite
(a masked token's -inf is written as -9999.0, as OpenAI does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import llguidance
import llguidance.hf
import llguidance.numpy as llg_numpy
import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from worker.chat_format import ConstraintError

MIN_LOGPROB = -9999.0
PENALTY_CONTEXT = 1024  # tokens the presence and frequency penalties look back over


# Bounded build and mask work per request; errors without the grammar's text (a schema may be megabytes).
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
MAX_ERROR_CHARS = 300


def error_summary(error: str) -> str:
    """llguidance's error, first line only and bounded: what a client and a log line are told."""
    first = error.strip().splitlines()[0] if error.strip() else "the grammar failed"
    return first if len(first) <= MAX_ERROR_CHARS else first[:MAX_ERROR_CHARS] + "..."


class Grammars:
    """Compiles constraints for one tokenizer; the llguidance tokenizer is built on first use (~1 s for 150k tokens)."""

    def __init__(self, hf_tokenizer: Any, eos_ids: list[int], model_vocab: int) -> None:
        self._hf = hf_tokenizer
        self._eos = eos_ids
        self._model_vocab = model_vocab
        self._tok: llguidance.LLTokenizer | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tok is None:
            self._tok = llguidance.hf.from_tokenizer(self._hf, eos_token=self._eos)
        return self._tok

    def processor(self, lark: str, generated: list[int]) -> GrammarProcessor:
        """A processor past `generated` (a resumed request's earlier tokens), checked now rather than mid-request:
        ConstraintError when llguidance rejects the grammar, cannot hold it within LIMITS at its start or past its
        forced tokens (a recursion without a base case, thousands of alternatives), or it allows nothing but the end."""
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer, limits=LIMITS)
        if error:
            raise ConstraintError(error_summary(error))
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=LIMITS)
        for token in generated:
            matcher.consume_token(token)
        processor = GrammarProcessor(matcher, self.tokenizer.vocab_size, self._model_vocab, len(lark))
        allowed = processor.first_mask()
        if matcher.is_error():
            raise ConstraintError(f"the grammar fails where its output starts ({error_summary(matcher.get_error())})")
        if not generated and not np.delete(allowed, self._eos).any():
            raise ConstraintError("no output can satisfy it (it allows only an empty answer)")
        probe = matcher.deep_copy()  # past the forced tokens, where a grammar too large to hold fails first
        forced = probe.compute_ff_tokens()
        if forced and probe.consume_tokens(forced):
            probe.compute_bitmask()
        if probe.is_error():
            raise ConstraintError(f"the grammar fails where its output starts ({error_summary(probe.get_error())})")
        return processor


class GrammarProcessor:
    """A logits processor that masks every token the grammar does not allow next.

    A matcher that fails mid-request (a limit reached deep in a schema) leaves `failure` set: its sequence's
    tokens are no longer constrained from then on, so the engine ends that request with an error."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int, model_vocab: int, grammar_chars: int = 0) -> None:
        self.matcher = matcher
        self.grammar_chars = grammar_chars
        self.failure: str | None = None
        self._vocab = vocab
        self._width = max(vocab, model_vocab)
        self._bitmask = llg_numpy.allocate_token_bitmask(1, vocab)
        self._first: np.ndarray | None = None  # the first mask, computed at submit
        self._started = False

    def first_mask(self) -> np.ndarray:
        self._first = self._allowed()
        return self._first

    def _allowed(self) -> np.ndarray:
        llg_numpy.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        return np.unpackbits(self._bitmask[0].view(np.uint8), bitorder="little")[: self._vocab]

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.failure is not None:
            return logits  # the engine ends this request after this step; what it samples now is dropped
        if self._started:
            # Launch this step's forward pass first, then wait only for the token this sequence sampled the step
            # before (computed ahead of it): the mask is made on the host while the batch's forward runs.
            mx.async_eval(logits)
            self.matcher.consume_token(cast(int, tokens[-1].item()))
        self._started = True
        allowed, self._first = (self._first, None) if self._first is not None else (self._allowed(), None)
        if self.matcher.is_error():
            self.failure = error_summary(self.matcher.get_error())
            return logits
        width = logits.shape[-1]
        if width != len(allowed):
            allowed = np.pad(allowed, (0, max(0, width - len(allowed))))[:width]
        return mx.where(mx.array(allowed.astype(np.bool_)), logits, mx.array(-np.inf, dtype=logits.dtype))

    def drafts_ready(self) -> bool:
        """Whether a drafting step may take this row's grammar along (batch_drafting.py): past its first token, its
        matcher sound."""
        return self._started and self._first is None and self.failure is None

    def along(self, y: int, drafts: list[int]) -> tuple[np.ndarray | None, int]:
        """For a drafting step: consume the token in hand and then the drafts the grammar allows, in order, up to the
        first it forbids (a forbidden draft ends the draft). The masks after y and after each draft consumed, shape
        (1 + consumed, vocab), and how many drafts were consumed; (None, 0) where the matcher failed at y. The
        caller takes the drafts verification rejects back out (`back`), so that, as after plain steps, the matcher
        has consumed exactly the tokens emitted and the next call consumes the token in hand."""
        self.matcher.consume_token(y)
        if self.matcher.is_error():
            self.failure = error_summary(self.matcher.get_error())
            return None, 0
        masks = [self._allowed()]
        for d in drafts:
            if d >= len(masks[-1]) or not masks[-1][d]:
                break
            self.matcher.consume_token(d)
            if self.matcher.is_error():  # not expected of an allowed token: the draft stops before it
                self.matcher.rollback(1)
                break
            masks.append(self._allowed())
        return np.stack(masks), len(masks) - 1

    def back(self, n: int) -> None:
        """Take the last n tokens consumed back out of the matcher."""
        if n > 0:
            self.matcher.rollback(n)


def penalty_processors(presence: float, frequency: float, repetition: float,
                       logit_bias: list | None) -> list[Callable]:
    bias = {int(t): float(b) for t, b in logit_bias} if logit_bias else None
    return make_logits_processors(
        logit_bias=bias,
        repetition_penalty=repetition if repetition != 1.0 else None,
        presence_penalty=presence or None, presence_context_size=PENALTY_CONTEXT,
        frequency_penalty=frequency or None, frequency_context_size=PENALTY_CONTEXT,
    )


def seeded_sampler(temperature: float, top_p: float, min_p: float, top_k: int, seed: int, skip: int = 0) -> Callable:
    """A sampler with its own random stream: the n-th token it draws depends on the seed and n only.

    `skip`: draws already made (a resumed request's earlier tokens), so its stream goes on where it was."""
    key = mx.random.key(seed)
    for _ in range(skip):
        key, _ = mx.random.split(key)

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, draw = mx.random.split(key)
        if temperature == 0:
            return mx.argmax(logprobs, axis=-1)
        if 0 < top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p > 0:
            logprobs = apply_min_p(logprobs, min_p)
        if top_k > 0:
            logprobs = apply_top_k(logprobs, top_k)
        return mx.random.categorical(logprobs * (1 / temperature), key=draw)

    return sample


def logprob_entries(decode: Callable[[list[int]], str], top: int) -> Callable[[int, Any], list]:
    """A function of (token, its step's logprobs vector) -> [token_text, logprob, [[alt_text, alt_logprob]...]]."""
    def finite(value: float) -> float:
        return value if value > MIN_LOGPROB else MIN_LOGPROB

    def entry(token: int, logprobs: mx.array) -> list:
        alts: list[list] = []
        with mx.stream(generation_stream):  # where the logprobs were computed: no sync across two streams
            if top > 0:  # the top few by a partition, then sorted: sorting Qwen3's vocabulary took 7.6x as long
                part = mx.argpartition(-logprobs, kth=min(top, logprobs.size) - 1)[:top]
                best = logprobs[part]
                order = mx.argsort(-best)
                ids = cast(list[int], part[order].tolist())
                values = cast(list[float], best[order].tolist())
                alts = [[decode([i]), finite(v)] for i, v in zip(ids, values)]
            return [decode([token]), finite(cast(float, logprobs[token].item())), alts]

    return entry
