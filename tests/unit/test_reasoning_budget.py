"""worker/mlx_engine/budget.py: a reasoning budget closes the reasoning the family's way once spent, and only then;
where budgets come from; and the prompt-side controls beside it (a prefill rendered open, Anthropic's fields parsed).

The processor runs against a stand-in model that always prefers the next token of a fixed stream: what comes out
is the stream wherever the budget leaves the choice to the model, the closing sequence where it does not."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.utils import load_tokenizer

from supervisor.gateway.anthropic_api import AnthropicInvalid, parse_messages
from worker.chat_format import family_of
from worker.mlx_engine.budget import EFFORT_BUDGETS, ReasoningBudget, budget_of, reasoning_budget
from worker.template_input import chat_template_args

VOCAB = 64
WORD, OPEN, CLOSE, NL = 5, 10, 11, 12  # a reasoning word, <think>, </think>, "\n"
HEADER, MESSAGE, END, START, FINAL, ASSISTANT = 20, 21, 22, 23, 40, 41  # harmony's markers and words
ANALYSIS, COMMENTARY = (30, 31), (32,)


def generate(processor: ReasoningBudget, wants: list[int], prompt: list[int] | None = None) -> list[int]:
    """Greedy generation: at step i the model prefers wants[i]; the processor may overrule it."""
    tokens = list(prompt or [1])
    out = []
    for want in wants:
        logits = mx.where(mx.arange(VOCAB) == want, 10.0, 0.0)[None]
        token = int(mx.argmax(processor(mx.array(tokens), logits), axis=-1).item())
        tokens.append(token)
        out.append(token)
    return out


def markup(budget: int, in_think: bool) -> ReasoningBudget:
    return ReasoningBudget(budget, [CLOSE, NL, NL], opens=frozenset({OPEN}), closes=frozenset({CLOSE}),
                           in_reasoning=in_think)


def test_a_spent_budget_forces_the_close_then_the_model_answers_on() -> None:
    p = markup(3, in_think=True)
    assert generate(p, [WORD] * 10) == [WORD] * 3 + [CLOSE, NL, NL] + [WORD] * 4
    assert (p.spent, p.forced, p.in_reasoning) == (3, 1, False)


def test_reasoning_the_model_closes_within_its_budget_is_left_alone() -> None:
    wants = [WORD, WORD, CLOSE, NL, WORD, WORD, WORD, WORD]
    p = markup(3, in_think=True)
    assert generate(p, wants) == wants and p.forced == 0


def test_reasoning_counts_from_the_model_s_own_think_marker() -> None:
    p = markup(2, in_think=False)
    assert generate(p, [WORD, OPEN] + [WORD] * 6) == [WORD, OPEN, WORD, WORD, CLOSE, NL, NL, WORD]


def test_a_resumed_request_s_earlier_tokens_count() -> None:
    p = markup(3, in_think=True)
    for token in (WORD, WORD):  # what reasoning_budget() replays for a resume
        p.observe(token)
    assert generate(p, [WORD] * 5, prompt=[1, WORD, WORD]) == [WORD, CLOSE, NL, NL, WORD]


def test_a_forced_token_wins_even_over_a_mask_and_stays_finite() -> None:
    p = markup(0, in_think=True)
    masked = mx.where(mx.arange(VOCAB) == CLOSE, -mx.inf, 1.0)[None]  # an earlier processor ruled it out
    forced = p(mx.array([1]), masked)
    assert int(mx.argmax(forced, axis=-1).item()) == CLOSE and float(forced[0, CLOSE].item()) == 0.0


def test_harmony_budgets_the_analysis_channel_only() -> None:
    close = [END, START, ASSISTANT, HEADER, FINAL, MESSAGE]
    p = ReasoningBudget(2, close, closes=frozenset({END}), header=HEADER, message=MESSAGE, analysis=ANALYSIS)
    commentary = [HEADER, *COMMENTARY, MESSAGE, WORD, WORD, WORD, END, START, ASSISTANT]
    analysis = [HEADER, *ANALYSIS, MESSAGE]
    out = generate(p, commentary + analysis + [WORD] * 10)
    assert out[:len(commentary + analysis)] == commentary + analysis  # three commentary words: not reasoning
    assert out[len(commentary + analysis):] == [WORD, WORD, *close, WORD, WORD]
    assert p.forced == 1


def test_budgets_come_from_the_request_or_its_effort() -> None:
    assert budget_of(64, {"reasoning_effort": "high"}) == 64
    assert budget_of(None, {"reasoning_effort": "low"}) == EFFORT_BUDGETS["low"] == 1024
    assert (EFFORT_BUDGETS["medium"], EFFORT_BUDGETS["high"]) == (4096, 16384)
    assert budget_of(None, {}) is None and budget_of(None, {"reasoning_effort": "odd"}) is None
    assert budget_of(64, {"enable_thinking": False}) is None


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from worker.mlx_engine.make_model import make_model

    root = tmp_path_factory.mktemp("budget-models")
    out = {}
    for arch in ("qwen3", "gpt_oss", "llama"):
        make_model(root / arch, "tiny", seed=0, arch=arch)
        out[arch] = load_tokenizer(root / arch)
    return out


def test_each_family_closes_its_own_way(tokenizers: dict) -> None:
    qwen = tokenizers["qwen3"]
    p = reasoning_budget(family_of(qwen), qwen, 8, in_think=True, generated=[])
    assert p is not None and qwen.decode(p.close) == "</think>\n\n" and p.in_reasoning
    harmony = tokenizers["gpt_oss"]
    h = reasoning_budget(family_of(harmony), harmony, 8, in_think=False, generated=[])
    assert h is not None and harmony.decode(h.close) == "<|end|><|start|>assistant<|channel|>final<|message|>"
    llama = tokenizers["llama"]
    assert reasoning_budget(family_of(llama), llama, 8, in_think=False, generated=[]) is None  # it does not think
    assert reasoning_budget(family_of(qwen), qwen, None, in_think=True, generated=[]) is None


def test_a_prefill_is_rendered_open_and_anything_else_with_the_generation_prompt(tokenizers: dict) -> None:
    qwen = tokenizers["qwen3"]
    turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well, it is"}]
    kwargs = {"continue_final_message": True, "enable_thinking": False}
    prompt = qwen.decode(qwen.apply_chat_template(turn, **chat_template_args(turn, kwargs)))
    assert prompt.endswith("Well, it is")  # no end of turn, no new turn after it
    closed = qwen.decode(qwen.apply_chat_template(turn, **chat_template_args(turn, {})))
    assert closed.endswith("<|im_start|>assistant\n") and "Well, it is<|im_end|>" in closed
    asked = chat_template_args(turn[:1], kwargs)  # the flag without a final assistant message: a new turn
    assert asked == {"enable_thinking": False, "add_generation_prompt": True}


def _parse(**body: object) -> object:
    return parse_messages({"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "Hi"}], **body})


def test_anthropic_s_budget_and_prefill_reach_the_submit() -> None:
    submit = _parse(thinking={"type": "enabled", "budget_tokens": 64}).submit  # type: ignore[attr-defined]
    assert (submit.reasoning_budget, submit.template_kwargs) == (64, {"enable_thinking": True})
    assert _parse(thinking={"type": "adaptive"}).submit.reasoning_budget is None  # type: ignore[attr-defined]

    prefill = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "text", "text": "Yes"}]}]
    submit = _parse(messages=prefill).submit  # type: ignore[attr-defined]
    assert submit.template_kwargs == {"continue_final_message": True} and submit.messages[-1]["content"] == "Yes"
    empty = _parse(messages=[*prefill[:1], {"role": "assistant", "content": ""}]).submit  # type: ignore[attr-defined]
    assert empty.messages == [{"role": "user", "content": "Hi"}] and not empty.template_kwargs
    with pytest.raises(AnthropicInvalid, match="trailing whitespace"):
        _parse(messages=[*prefill[:1], {"role": "assistant", "content": "Yes\n"}])
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}
    assert not _parse(messages=[*prefill[:1], call]).submit.template_kwargs  # type: ignore[attr-defined]
