"""How one request is decoded, set up from its options once, at submit: its sampler, its logits processors
(penalties and logit_bias, a grammar, a reasoning budget, then those of any `hooks` a test wired in: scripted.py's
replies) and its output (the text
stream, the reply's parser, logprobs).

Samplers are shared: requests with the same (temperature, top_p, top_k, min_p) get the same one, the most
recent SAMPLERS_KEPT kept, so the batch samples them together and no client's settings grow memory; greedy
(temperature 0) is None, the generator's fallback. A seeded request gets its own.

Invariants: a resumed request (Submit.resume_tokens) gets a grammar, a budget, a seeded sampler and an output
replayed through its earlier tokens, so it continues exactly where its client's stopped; a constraint that
cannot be held is a RequestRejected here, never a failure inside the batched step; nothing here touches the
model or the batch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from protocol.messages import INVALID_REQUEST, Submit
from worker.chat_format import ConstraintError, Family, grammar_for, parser_for, starts_in_think
from worker.engine_api import RequestRejected
from worker.mlx_engine.budget import budget_of, reasoning_budget
from worker.mlx_engine.guided import GrammarProcessor, Grammars, logprob_entries, penalty_processors, seeded_sampler
from worker.request_output import RequestOutput
from worker.template_input import special_token_ids
from worker.textstream import TextStream

SAMPLERS_KEPT = 16  # samplers kept for reuse, by (temperature, top_p, top_k, min_p), least recently used dropped


@dataclass(slots=True)
class RequestDecoding:
    sampler: Callable | None  # None: greedy
    processors: list
    out: RequestOutput
    grammar: GrammarProcessor | None


class Decoding:
    def __init__(self, tokenizer: TokenizerWrapper, family: Family, vocab_size: int, grammars: Grammars) -> None:
        self.tokenizer = tokenizer
        self.family = family
        self.vocab_size = vocab_size
        self.grammars = grammars
        self._special = special_token_ids(tokenizer) - family.visible_specials
        self.samplers: OrderedDict[tuple, Callable] = OrderedDict()
        # processors a test wires in at startup (scripted.py's `install`), applied after every other one; none in service
        self.hooks: list[Callable[[Submit], list]] = []

    def _top_k(self, msg: Submit) -> int:
        return msg.top_k if self.vocab_size <= 0 or msg.top_k < self.vocab_size else 0

    def sampler(self, msg: Submit) -> Callable | None:
        if msg.temperature == 0:
            return None  # the generator's greedy fallback; shared, so the batch samples in one call
        # top_k at or past the vocabulary keeps every token, as OpenAI-compatible servers read it; mlx-lm
        # raises on it inside the batched step instead, failing the whole batch (and the generator after it)
        top_k = self._top_k(msg)
        key = (msg.temperature, msg.top_p, top_k, msg.min_p)
        sampler = self.samplers.pop(key, None)
        if sampler is None:
            top_p = msg.top_p if msg.top_p < 1.0 else 0.0
            sampler = make_sampler(msg.temperature, top_p=top_p, min_p=msg.min_p, top_k=top_k)
        self.samplers[key] = sampler  # the most recently used last
        while len(self.samplers) > SAMPLERS_KEPT:
            self.samplers.popitem(last=False)
        return sampler

    def setup(self, msg: Submit, prompt: list[int]) -> RequestDecoding:
        """A request's sampler, logits processors, output (parser, logprobs) and grammar, from its options; `prompt`
        is without a resumed request's earlier tokens, which its output and grammar are replayed through."""
        chat = msg.messages is not None
        in_think = chat and starts_in_think(self.family, self.tokenizer.decode(prompt[-4:]))
        processors = penalty_processors(msg.presence_penalty, msg.frequency_penalty, msg.repetition_penalty,
                                        msg.logit_bias)
        grammar = None
        if msg.constraint is not None:
            try:  # a resumed request's grammar is past what it generated
                grammar = self.grammars.processor(grammar_for(self.family, msg.constraint, msg.tools, in_think),
                                                  msg.resume_tokens)
                processors.append(grammar)
            except ConstraintError as exc:
                what = msg.constraint.get("name") or ("the tool call" if msg.constraint.get("type") == "tool"
                                                      else "the response format")
                raise RequestRejected(INVALID_REQUEST, f"cannot constrain decoding to {what}: {exc}") from None
        if chat and (budget := reasoning_budget(self.family, self.tokenizer, budget_of(
                msg.reasoning_budget, msg.template_kwargs), in_think, msg.resume_tokens)) is not None:
            processors.append(budget)
        for hook in self.hooks:
            processors += hook(msg)
        sampler = self.sampler(msg) if msg.seed is None else seeded_sampler(
            msg.temperature, msg.top_p, msg.min_p, self._top_k(msg), msg.seed, skip=len(msg.resume_tokens))
        logprobs = logprob_entries(self.tokenizer.decode, msg.logprobs) if msg.logprobs >= 0 else None
        parser = parser_for(self.family, chat, bool(msg.tools), in_think)
        out = RequestOutput(TextStream(self.tokenizer.detokenizer, msg.stop, self._special), parser, logprobs)
        out.replay(msg.resume_tokens)  # a resumed request's output continues exactly where its client's stopped
        return RequestDecoding(sampler, processors, out, grammar)
