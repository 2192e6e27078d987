"""Reasoning budgets: a request thinks for at most N tokens, then its reasoning is closed the family's way and the
answer goes on.

A `ReasoningBudget` is one more logits processor in the request's list (guided.py's way: per sequence, so a
budgeted request shares the batch with the others). It follows the tokens its sequence samples, counts those inside
the reasoning, and once `budget` of them are spent while the reasoning is still open, forces the family's closing
sequence a token per step (every other token masked to -inf, as scripted.py forces a reply), then lets the model
go on with its answer:
- think markers (Qwen3, Qwen3.5): reasoning runs from `<think>` (or from the prompt's end, when the generation
  prompt opened it) to `</think>`; closed by `</think>\\n\\n`, as the templates write a finished thought;
- harmony (gpt-oss): reasoning is the body of a message on the `analysis` channel; closed by
  `<|end|><|start|>assistant<|channel|>final<|message|>`, harmony's next message, the final answer.
A family with neither (Llama, Gemma) does not think: no budget applies.

Where a budget comes from: Submit.reasoning_budget (Anthropic's `thinking.budget_tokens`), else the request's
`reasoning_effort` template argument (the Responses API's `reasoning.effort`, chat's `reasoning_effort`,
Anthropic's `output_config.effort`) by EFFORT_BUDGETS: fixed sizes, low 1024, medium 4096 and high 16384 tokens
(fixed rather than a fraction of max_tokens, so an effort means the same thinking whatever room the client left
for the answer; the answer still ends at max_tokens). No budget when thinking is switched off.

Invariants: the processor sees exactly the tokens its sequence sampled (the one before each call, none before the
first; a resumed request's earlier tokens replayed at its creation); the forced logit is the model's own logit
times zero (finite), so the step's forward pass stays in the graph.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import mlx.core as mx

from worker.chat_format import Family

log = logging.getLogger(__name__)

EFFORT_BUDGETS = {"low": 1024, "medium": 4096, "high": 16384}
HARMONY_CLOSE = "<|end|><|start|>assistant<|channel|>final<|message|>"
HARMONY_BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>")


def budget_of(reasoning_budget: int | None, template_kwargs: dict) -> int | None:
    """The request's reasoning budget in tokens: its own, else its effort's; None: unbounded."""
    if template_kwargs.get("enable_thinking") is False:
        return None
    if reasoning_budget is not None:
        return max(0, reasoning_budget)
    effort = template_kwargs.get("reasoning_effort")
    return EFFORT_BUDGETS.get(effort) if isinstance(effort, str) else None


class ReasoningBudget:
    """A logits processor closing the reasoning after `budget` tokens of it (see the module's docstring).

    Markup families: `opens`/`closes` are the think markers' ids. Harmony: `header` is the `<|channel|>` id,
    `message` the `<|message|>` id, `analysis` the ids of the channel name, `closes` the body-ending ids."""

    def __init__(self, budget: int, close: list[int], *, opens: frozenset[int] = frozenset(),
                 closes: frozenset[int] = frozenset(), in_reasoning: bool = False, header: int | None = None,
                 message: int | None = None, analysis: tuple[int, ...] = ()) -> None:
        if not close:
            raise ValueError("a reasoning budget needs a closing sequence")
        self.budget = budget
        self.close = close
        self.opens = opens
        self.closes = closes
        self.header = header
        self.message = message
        self.analysis = analysis
        self.in_reasoning = in_reasoning
        self.spent = 0  # reasoning tokens sampled so far
        self.forced = 0  # times the budget closed the reasoning
        self._header: list[int] | None = None  # a harmony header's ids, while one is read
        self._forcing: list[int] = []  # the closing sequence's ids still to force
        self._started = False

    def observe(self, token: int) -> None:
        """One token its sequence sampled."""
        if self._header is not None:
            if token == self.message:
                self.in_reasoning = tuple(self._header[:len(self.analysis)]) == self.analysis
                self._header = None
            else:
                self._header.append(token)
            return
        if token == self.header:
            self._header = []
        elif token in self.opens:
            self.in_reasoning = True
        elif token in self.closes:
            self.in_reasoning = False
        elif self.in_reasoning:
            self.spent += 1

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._started:
            mx.async_eval(logits)  # this step's forward pass runs while the host waits for the previous token
            self.observe(cast(int, tokens[-1].item()))
        self._started = True
        if not self._forcing and self.in_reasoning and self.spent >= self.budget:
            self._forcing = list(self.close)
            self.forced += 1
            log.debug("[budget] reasoning closed after tokens=%d", self.spent)
        if not self._forcing:
            return logits
        token = self._forcing.pop(0)
        chosen = mx.arange(logits.shape[-1]) == token
        anchor = mx.where(mx.isfinite(logits), logits, 0) * 0  # finite, and keeps the forward pass in the graph
        return mx.where(chosen, anchor, mx.array(-mx.inf, dtype=logits.dtype))


def reasoning_budget(family: Family, tokenizer: Any, budget: int | None, in_think: bool,
                     generated: list[int]) -> ReasoningBudget | None:
    """The processor holding a request to `budget` reasoning tokens in this family's format, past `generated` (a
    resumed request's earlier tokens); None when there is no budget or the family does not think."""
    if budget is None:
        return None
    vocab = tokenizer.get_vocab()
    if family.harmony:
        h = family.harmony
        processor = ReasoningBudget(
            budget, list(tokenizer.encode(HARMONY_CLOSE, add_special_tokens=False)),
            closes=frozenset(h[m] for m in HARMONY_BODY_ENDS if m in h), header=h["<|channel|>"],
            message=h["<|message|>"], analysis=tuple(tokenizer.encode("analysis", add_special_tokens=False)))
    elif family.think and family.think[0] in vocab and family.think[1] in vocab:
        start, end = family.think
        processor = ReasoningBudget(budget, list(tokenizer.encode(end + "\n\n", add_special_tokens=False)),
                                    opens=frozenset({vocab[start]}), closes=frozenset({vocab[end]}),
                                    in_reasoning=in_think)
    else:
        return None  # no reasoning to close (or markers that are not one token each: nothing to follow them by)
    for token in generated:
        processor.observe(token)
    return processor
