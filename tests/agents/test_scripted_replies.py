"""The worker's `--script` switch end to end: a scripted reply through the real daemon, model, template, output
parser and stream comes back as a parsed tool call of the OpenAI chat API; an unscripted request is untouched."""

from __future__ import annotations

import json

import openai
import pytest

from tests.agents.conftest import KEY
from tests.conftest import Daemon

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
ASK = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris? WEATHER-STEP-1"}]


@pytest.fixture(scope="module")
def client(scripted_daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=scripted_daemon.v1, api_key=KEY, max_retries=0, timeout=120)


def test_a_scripted_reply_is_a_parsed_tool_call_whole_and_streamed(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="qwen3", messages=ASK, tools=WEATHER, max_tokens=200,
                                           temperature=0.8)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2})]
    assert not choice.message.content

    pieces: dict[int, str] = {}
    reasons = []
    for chunk in client.chat.completions.create(model="qwen3", messages=ASK, tools=WEATHER,
                                                max_tokens=200, stream=True):
        for delta_call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            pieces[delta_call.index] = pieces.get(delta_call.index, "") + (delta_call.function.arguments or "")
        reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
    assert reasons == ["tool_calls"] and [json.loads(a) for a in pieces.values()] == [{"city": "Paris", "days": 2}]


def test_what_the_script_does_not_match_is_generated_freely(client: openai.OpenAI) -> None:
    free = client.chat.completions.create(model="qwen3", max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert free.choices[0].finish_reason in ("length", "stop") and not free.choices[0].message.tool_calls
    assert free.usage is not None and free.usage.completion_tokens > 0
