"""Agents' side of the chat API end to end, through the unmodified openai client, with the families' tiny
random-weight models: forced tool calls (named and required), JSON-schema answers, logprobs, n, seeds,
reasoning apart from the answer, a multi-turn tool loop, and openai-agents driving one.

Random weights say nothing sensible, so what is checked is what constrained decoding and parsing must
guarantee whatever the weights: the call or the JSON validates against its schema, the streamed pieces
join to the whole response's, nothing of the markup reaches `content`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import Daemon, start_daemon

WEATHER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                  "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                 "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER_SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "description": "The time",
                                           "parameters": {"type": "object", "properties": {}}}}]
ANSWER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "mood"],
                 "properties": {"ok": {"type": "boolean"}, "mood": {"type": "string", "enum": ["calm", "busy"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FAMILIES = ["qwen3", "gpt_oss"]
MARKUP = ("<tool_call>", "</tool_call>", "<think>", "</think>", "<|channel|>", "<|message|>", "<|call|>", "<|end|>")


@pytest.fixture(scope="module")
def agents_daemon(family_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("agents-state"), "--model-dir", str(family_models))
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def client(agents_daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=agents_daemon.v1, api_key="unused", max_retries=0, timeout=120)


def no_markup(text: str | None) -> None:
    assert not any(m in (text or "") for m in MARKUP), text


def streamed_calls(stream: openai.Stream) -> tuple[dict[int, dict], str | None, str]:
    """The tool calls joined from a stream's deltas (id and name from the first piece), its finish reason, its text."""
    calls: dict[int, dict] = {}
    finish, text = None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.id:
                assert piece.index not in calls, "a call's id and name come once"
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    return calls, finish, text


@pytest.mark.parametrize("family", FAMILIES)
def test_a_named_tool_choice_returns_a_valid_call_whole_and_streamed(client: openai.OpenAI, family: str) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(model=family, messages=ASK, tools=TOOLS, tool_choice=named,
                                           temperature=0, max_tokens=60)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
    no_markup(choice.message.content)

    calls, finish, text = streamed_calls(client.chat.completions.create(
        model=family, messages=ASK, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=60, stream=True))
    assert finish == "tool_calls" and list(calls) == [0]
    assert (calls[0]["name"], calls[0]["arguments"]) == ("get_weather", call.function.arguments)
    no_markup(text)


@pytest.mark.parametrize("family", FAMILIES)
def test_required_tool_choice_and_a_json_schema_answer_validate(client: openai.OpenAI, family: str) -> None:
    r = client.chat.completions.create(model=family, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_tokens=60)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls and calls[0].function.name in ("get_weather", "get_time")
    schema = WEATHER_SCHEMA if calls[0].function.name == "get_weather" else TOOLS[1]["function"]["parameters"]
    jsonschema.validate(json.loads(calls[0].function.arguments), schema)

    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    r = client.chat.completions.create(model=family, messages=ASK, response_format=fmt, temperature=0, max_tokens=40)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER_SCHEMA)
    r = client.chat.completions.create(model=family, messages=ASK, response_format={"type": "json_object"},
                                       temperature=0, max_tokens=40)
    assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_n_and_seed(client: openai.OpenAI, agents_daemon: Daemon, family: str) -> None:
    r = client.chat.completions.create(model=family, messages=ASK, temperature=0, max_tokens=8, logprobs=True,
                                       top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries)
    assert all(e.top_logprobs[0].logprob >= e.logprob for e in entries)  # greedy: the token is the most likely

    r = client.chat.completions.create(model=family, messages=ASK, temperature=1, max_tokens=6, n=3, seed=11,
                                       logprobs=True)
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.finish_reason for c in r.choices)
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)

    def seeded() -> str:
        return client.chat.completions.create(model=family, messages=ASK, temperature=1, max_tokens=12,
                                              seed=1234).choices[0].message.content or ""

    first = seeded()

    async def with_company() -> str:  # the same seed again, in a batch with unseeded strangers
        c = openai.AsyncOpenAI(base_url=agents_daemon.v1, api_key="unused", max_retries=0, timeout=120)
        others = [c.chat.completions.create(model=family, messages=[{"role": "user", "content": f"Hi {i}"}],
                                            temperature=1, max_tokens=12) for i in range(3)]
        mine = c.chat.completions.create(model=family, messages=ASK, temperature=1, max_tokens=12, seed=1234)
        results = await asyncio.gather(mine, *others)
        return results[0].choices[0].message.content or ""

    assert asyncio.run(with_company()) == first


def test_completions_take_token_ids_and_lists_and_give_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model="qwen3", prompt=[[5, 6, 7], "Once upon"], max_tokens=4, temperature=0,
                                  logprobs=2, n=2)
    assert len(r.choices) == 4 and [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(c.logprobs.top_logprobs)
        assert c.text.strip() in "".join(c.logprobs.tokens)  # tokens name special ones too; text trims a space
    assert r.choices[0].text == r.choices[1].text and r.usage.completion_tokens == sum(
        len(c.logprobs.tokens) for c in r.choices)


def test_reasoning_comes_apart_from_the_answer_and_can_be_switched_off(client: openai.OpenAI) -> None:
    """Qwen3.5's generation prompt opens a think block: a random model's whole output is reasoning until it
    closes it; with enable_thinking false the template closes it and all is answer."""
    thinking = client.chat.completions.create(model="qwen3_5", messages=ASK, temperature=0, max_tokens=10)
    message = thinking.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and not (message.content or "").strip().startswith(reasoning.strip())
    no_markup(reasoning)
    stream = client.chat.completions.create(model="qwen3_5", messages=ASK, temperature=0, max_tokens=10, stream=True)
    pieces = [c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in stream if c.choices]
    assert "".join(pieces) == reasoning

    off = client.chat.completions.create(model="qwen3_5", messages=ASK, temperature=0, max_tokens=10,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content and "reasoning_content" not in (off.choices[0].message.model_extra or {})


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tool_result_turn_goes_back_into_the_prompt(client: openai.OpenAI, family: str) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(model=family, messages=ASK, tools=TOOLS, tool_choice=named,
                                           temperature=0, max_tokens=60)
    call = first.choices[0].message.tool_calls[0]
    turn = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    again = client.chat.completions.create(model=family, messages=turn, tools=TOOLS, temperature=0, max_tokens=4)
    longer = client.chat.completions.create(model=family, messages=turn[:-1] + [
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C, light wind from the west"}],
        tools=TOOLS, temperature=0, max_tokens=4)
    assert again.usage.prompt_tokens > first.usage.prompt_tokens + 5  # the call and its result are in the prompt
    assert longer.usage.prompt_tokens > again.usage.prompt_tokens  # the tool's text itself is


def test_get_a_model(client: openai.OpenAI, agents_daemon: Daemon) -> None:
    httpx.post(f"{agents_daemon.url}/api/models/qwen3/load", timeout=120).raise_for_status()
    model = client.models.retrieve("qwen3")
    assert model.id == "qwen3" and model.model_extra["loaded"] is True and model.model_extra["context_length"] > 0
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_openai_agents_drives_a_tool_loop(agents_daemon: Daemon) -> None:
    """openai-agents with tool_choice forcing the call: the call runs, its result goes back, the next turn answers."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunConfig,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    seen: list[tuple[str, int]] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"], days: Literal[1, 2, 3]) -> str:
        """The weather in a city for some days."""
        seen.append((city, days))
        return f"Sunny in {city} for {days} days"

    model = OpenAIChatCompletionsModel("qwen3", openai.AsyncOpenAI(base_url=agents_daemon.v1, api_key="unused",
                                                                   max_retries=0, timeout=120))
    agent = Agent(name="weather", instructions="Answer with the tool.", model=model, tools=[get_weather],
                  model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=100))
    result = Runner.run_sync(agent, "Weather in Paris?", max_turns=3, run_config=RunConfig(tracing_disabled=True))
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item", kinds
    assert len(seen) == 1 and isinstance(seen[0][0], str) and isinstance(seen[0][1], int)
    assert result.new_items[1].output == f"Sunny in {seen[0][0]} for {seen[0][1]} days"


def test_a_schema_that_cannot_compile_is_a_400_naming_it(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "broken_schema", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="qwen3", messages=ASK, response_format=fmt, max_tokens=4)
    assert "broken_schema" in err.value.message and "strin" in err.value.message
