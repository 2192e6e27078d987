"""Issue 34: agents on models whose chat template writes no tools (make-model's `llama`, a minimal ChatML, and
`gemma3`, Gemma 3's own template): the worker writes the tools and the tool turns into the prompt itself
(worker/tool_fallback.py), parses `<tool_call>{json}</tool_call>` back into calls, and forces a call in that
format, so the SDKs' tool loops run on them, and a tool loop's next turn reads the previous turn from the cache.

Random weights: what a forced call says is the grammar's doing, which is what is checked (a valid call by the
function's schema); an unforced answer is whatever the weights make of the prompt.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import anthropic
import jsonschema
import openai
import pytest

from tests.conftest import MLXSUP, Daemon, assert_gone, start_daemon

MODELS = ["llama", "gemma3"]
SLACK = {"llama": 8, "gemma3": 64}  # tokens at a reply's end a next turn may prefill again (64: the cache's block)
# A long name, arguments from an enum: a forced reply of ~80 tokens, all of them the grammar's, so the model's tokens
# are the text's own (a random string's bytes may be split otherwise than the tokenizer splits them when the reply
# comes back) and the reply crosses a block boundary past where a reply written back otherwise would diverge.
NAME = "get_the_weather_forecast_for_the_city_the_user_asks_about"
WEATHER = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"],
           "additionalProperties": False}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("tool_fallback")
    config = "[cache]\nssd = false\n"
    for arch in MODELS:
        subprocess.run([*MLXSUP, "make-model", str(root / arch), "--arch", arch, "--preset", "tiny"], check=True,
                       capture_output=True)
        config += f'\n[models.{arch}]\npath = "{root / arch}"\n'
    (root / "c.toml").write_text(config)
    d = start_daemon(root / "state", "--config", str(root / "c.toml"))
    yield d
    pids = d.children()
    assert d.stop() == 0
    assert_gone(pids)


@pytest.mark.parametrize("model", MODELS)
def test_a_required_call_comes_back_valid_through_the_openai_sdk(daemon: Daemon, model: str) -> None:
    client = openai.OpenAI(base_url=daemon.v1, api_key="unused", max_retries=0, timeout=120)
    tool = {"type": "function", "function": {"name": NAME, "description": "The weather in a city",
                                             "parameters": WEATHER}}
    resp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[tool],  # type: ignore[list-item]
        tool_choice="required", parallel_tool_calls=False, max_tokens=256,
        temperature=0)
    calls = resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "tool_calls" and calls and len(calls) == 1, resp
    assert calls[0].type == "function" and calls[0].function.name == NAME  # type: ignore[union-attr]
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)  # type: ignore[union-attr]
    assert not resp.choices[0].message.content  # the call's markup is not answer text


@pytest.mark.parametrize("model", MODELS)
def test_a_forced_tool_use_then_its_result_reads_the_first_turn_from_the_cache(daemon: Daemon, model: str) -> None:
    client = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0, timeout=120)
    system = f"You are {model}'s weather agent. " + " ".join(f"rule{i * 7919 % 9973} holds" for i in range(40))
    tools = [{"name": NAME, "description": "The weather in a city", "input_schema": WEATHER}]
    turn: list = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.messages.create(model=model, system=system, messages=turn, tools=tools,  # type: ignore[arg-type]
                                   tool_choice={"type": "tool", "name": NAME}, max_tokens=256,
                                   extra_body={"temperature": 0})  # this SDK takes no temperature argument
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == NAME, first
    jsonschema.validate(uses[0].input, WEATHER)
    u = first.usage
    prompt = u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)

    turn += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "18 C"}]}]
    second = client.messages.create(model=model, system=system, messages=turn, tools=tools,  # type: ignore[arg-type]
                                    max_tokens=4)
    # the second prompt begins with the first one and the reply as the model wrote it: all read from the cache, but
    # for the reply's last few tokens (llama's plain KV is reused to any token; gemma3's sliding window, to a
    # snapshot at the block boundary before the reply's end)
    assert (second.usage.cache_read_input_tokens or 0) >= prompt + u.output_tokens - SLACK[model], (u, second.usage)
