"""Anthropic Messages' prompt and reasoning controls end to end, through the real daemon, workers and tiny
random-weight models: count_tokens without generating, `thinking.budget_tokens` held, and assistant prefill.

Random weights say nothing sensible; what is checked holds whatever they say: the worker's generated-token
counter, the prompt's token count against the model's own tokenizer, and where the reasoning ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.conftest import Daemon, start_daemon, wait_for

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SYSTEM = "Answer briefly."
TOOLS = [{"name": "get_time", "description": "The time", "input_schema": {"type": "object", "properties": {}}}]
GREEDY = {"temperature": 0}
PREFILL = "The weather in Paris is"


@pytest.fixture(scope="module")
def controls_daemon(family_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("controls-state"), "--model-dir", str(family_models))
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def claude(controls_daemon: Daemon) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=controls_daemon.url, api_key="unused", max_retries=0, timeout=120)


def generated_after(daemon: Daemon, model: str, at_least: int) -> int:
    """The worker's generated-token counter once its heartbeat shows at least `at_least` (a heartbeat comes a
    second or so after the tokens it counts)."""
    return int(wait_for(lambda: (n := daemon.model(model).get("generated_tokens") or 0) >= at_least and n,
                        30, what=f"{model}'s heartbeat to count {at_least} tokens"))


def test_count_tokens_generates_nothing_and_counts_what_the_request_reports(claude: anthropic.Anthropic,
                                                                            controls_daemon: Daemon) -> None:
    body = {"model": "qwen3", "messages": ASK, "system": SYSTEM, "tools": TOOLS}
    first = claude.messages.create(max_tokens=3, extra_body=GREEDY, **body)  # loads the model
    before = generated_after(controls_daemon, "qwen3", first.usage.output_tokens)

    counts = [claude.messages.count_tokens(**body).input_tokens for _ in range(3)]
    made = claude.messages.create(max_tokens=5, extra_body=GREEDY, **body)
    # every token generated since `before` is the last request's: the counts generated none
    assert generated_after(controls_daemon, "qwen3", before + made.usage.output_tokens) == \
        before + made.usage.output_tokens
    assert counts == [made.usage.input_tokens + made.usage.cache_read_input_tokens] * 3
    assert counts[0] > claude.messages.count_tokens(model="qwen3", messages=ASK).input_tokens  # tools and system in


def test_count_tokens_of_a_prompt_the_template_refuses_is_anthropic_s_400(controls_daemon: Daemon) -> None:
    r = httpx.post(controls_daemon.url + "/v1/messages/count_tokens", timeout=60, json={
        "model": "gemma3", "messages": [*ASK, {"role": "assistant", "content": "Sunny."},  # Gemma's template wants
                                        {"role": "assistant", "content": "Warm."}, *ASK]})  # the roles to alternate
    # (user messages in a row are joined for it: opencode sends them; assistant ones are not, no client does)
    assert r.status_code == 400, r.text
    assert "alternate" in r.json()["error"]["message"]
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


def test_a_thinking_budget_closes_the_reasoning_and_the_answer_follows(claude: anthropic.Anthropic,
                                                                      family_models: Path) -> None:
    """Qwen3.5's generation prompt opens a think block, and a random model never closes it by itself."""
    tokenizer = AutoTokenizer.from_pretrained(family_models / "qwen3_5")
    unbounded = claude.messages.create(model="qwen3_5", max_tokens=40, messages=ASK, extra_body=GREEDY,
                                       thinking={"type": "adaptive"})
    assert [b.type for b in unbounded.content] == ["thinking"]  # without a budget: thought to the end

    budget = 8
    held = claude.messages.create(model="qwen3_5", max_tokens=40, messages=ASK, extra_body=GREEDY,
                                  thinking={"type": "enabled", "budget_tokens": budget})
    kinds = [b.type for b in held.content]
    assert kinds[0] == "thinking" and "text" in kinds, kinds
    thought = held.content[0].thinking  # type: ignore[union-attr]
    assert 0 < len(tokenizer.encode(thought.strip(), add_special_tokens=False)) <= budget + 1  # + 1: re-tokenized
    assert "</think>" not in thought and "</think>" not in "".join(b.text for b in held.content if b.type == "text")
    assert held.usage.output_tokens > budget + 3  # the closing </think>\n\n, then the answer went on


def test_an_assistant_prefill_is_continued_not_closed(claude: anthropic.Anthropic, family_models: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(family_models / "qwen3")
    turn = [*ASK, {"role": "assistant", "content": PREFILL}]
    continued = tokenizer.apply_chat_template(turn, continue_final_message=True, return_dict=False)
    closed = tokenizer.apply_chat_template(turn, add_generation_prompt=True, return_dict=False)
    assert tokenizer.decode(continued).endswith(PREFILL) and len(closed) > len(continued)

    counted = claude.messages.count_tokens(model="qwen3", messages=turn).input_tokens
    made = claude.messages.create(model="qwen3", max_tokens=4, messages=turn, extra_body=GREEDY)
    assert counted == made.usage.input_tokens + made.usage.cache_read_input_tokens == len(continued)
    assert made.stop_reason in ("end_turn", "max_tokens") and made.usage.output_tokens > 0

    # an empty final assistant message is no prefill: the prompt is the conversation's without it
    empty = claude.messages.count_tokens(model="qwen3", messages=[*ASK, {"role": "assistant", "content": ""}])
    assert empty.input_tokens == claude.messages.count_tokens(model="qwen3", messages=ASK).input_tokens


def test_a_prefill_ending_in_whitespace_is_refused_as_anthropic_does(controls_daemon: Daemon) -> None:
    r = httpx.post(controls_daemon.url + "/v1/messages", timeout=60, json={
        "model": "qwen3", "max_tokens": 4, "messages": [*ASK, {"role": "assistant", "content": PREFILL + " "}]})
    assert r.status_code == 400, r.text
    assert "trailing whitespace" in r.json()["error"]["message"]


def test_a_reasoning_effort_is_a_budget_in_the_responses_api(controls_daemon: Daemon, family_models: Path) -> None:
    """`low` is EFFORT_BUDGETS' 1024 tokens (worker/mlx_engine/budget.py): the random model thinks that long, no more."""
    tokenizer = AutoTokenizer.from_pretrained(family_models / "qwen3_5")
    codex = openai.OpenAI(base_url=controls_daemon.v1, api_key="unused", max_retries=0, timeout=300)
    made = codex.responses.create(model="qwen3_5", input="Weather?", max_output_tokens=1040, temperature=0,
                                  reasoning={"effort": "low"}, store=False)
    kinds = [item.type for item in made.output]
    assert kinds == ["reasoning", "message"], kinds
    thought = made.output[0].content[0].text  # type: ignore[union-attr]
    assert 1000 < len(tokenizer.encode(thought.strip(), add_special_tokens=False)) <= 1025
    assert made.output_text and made.usage is not None and made.usage.output_tokens > 1024 + 3
