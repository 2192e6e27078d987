"""The coding agents' APIs end to end through their unmodified SDKs: Anthropic Messages (`anthropic`, as Claude
Code talks) and OpenAI Responses (`openai`'s responses.create, as Codex talks), with the tiny random-weight qwen3.

One daemon for the module, with an API key (the anthropic SDK sends it as x-api-key, openai's as a Bearer
token), Claude and Codex model names mapped onto qwen3 by `model_aliases` and `default_model`, and a response
store of 3. Random weights say nothing sensible: what is checked is what the shapes, constrained decoding and
the store must guarantee whatever the weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.conftest import Daemon, start_daemon, wait_for

KEY = "sk-local-test"
WEATHER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                  "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                 "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
A_TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA},
           {"name": "get_time", "description": "The time", "input_schema": {"type": "object", "properties": {}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # the anthropic SDK of 2026 no longer has the argument; the API still takes it
CLAUDE = "claude-sonnet-5-5"  # mapped by the pattern
MARKUP = ("<tool_call>", "</tool_call>", "<think>", "</think>")
# A long agent prefix (well past two cache blocks) that a second turn repeats.
PREFIX = "You are a coding agent. Rules: " + " ".join(f"rule{i * 7919 % 997} applies" for i in range(120))


@pytest.fixture(scope="module")
def coding_daemon(family_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    state = tmp_path_factory.mktemp("coding-state")
    config = state / "mlxsup.toml"
    config.write_text(f'[server]\napi_key = "{KEY}"\ndefault_model = "qwen3"\nresponse_store_count = 3\n'
                      '[server.model_aliases]\n"claude-*" = "qwen3"\n')
    d = start_daemon(state, "--model-dir", str(family_models), "--config", str(config))
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def claude(coding_daemon: Daemon) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=coding_daemon.url, api_key=KEY, max_retries=0, timeout=120)


def text_of(message: anthropic.types.Message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_a_plain_message_and_its_stream_say_the_same(claude: anthropic.Anthropic) -> None:
    whole = claude.messages.create(model=CLAUDE, max_tokens=12, messages=ASK, extra_body=GREEDY,
                                   system="Answer briefly.")
    assert whole.type == "message" and whole.role == "assistant" and whole.model == CLAUDE
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.usage.output_tokens > 0
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens > 10
    assert not any(m in text_of(whole) for m in MARKUP)

    kinds = []
    with claude.messages.stream(model=CLAUDE, max_tokens=12, messages=ASK, extra_body=GREEDY,
                                system="Answer briefly.") as stream:
        for event in stream:
            kinds.append(event.type)
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    assert (streamed.stop_reason, streamed.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)


def test_a_forced_tool_call_validates_streams_alike_and_its_result_goes_back(claude: anthropic.Anthropic) -> None:
    forced = {"type": "tool", "name": "get_weather"}
    first = claude.messages.create(model=CLAUDE, max_tokens=80, messages=ASK, tools=A_TOOLS, tool_choice=forced,
                                   extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    calls = [b for b in first.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id
    jsonschema.validate(calls[0].input, WEATHER_SCHEMA)
    assert not any(m in text_of(first) for m in MARKUP)

    with claude.messages.stream(model=CLAUDE, max_tokens=80, messages=ASK, tools=A_TOOLS, tool_choice=forced,
                                extra_body=GREEDY) as stream:
        pieces = [e.delta.partial_json for e in stream if e.type == "content_block_delta"
                  and e.delta.type == "input_json_delta"]
        streamed = stream.get_final_message()
    assert json.loads("".join(pieces)) == calls[0].input
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [calls[0].input]

    turn = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                          "content": [{"type": "text", "text": "Sunny, 21 C, light wind"}]}]}]
    after = claude.messages.create(model=CLAUDE, max_tokens=4, messages=turn, tools=A_TOOLS, extra_body=GREEDY)
    prompt = lambda m: m.usage.input_tokens + m.usage.cache_read_input_tokens  # noqa: E731
    assert prompt(after) > prompt(first) + 10  # the call and its result are in the prompt

    any_call = claude.messages.create(model=CLAUDE, max_tokens=80, messages=ASK, tools=A_TOOLS, extra_body=GREEDY,
                                      tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert any_call.stop_reason == "tool_use" and [b.type for b in any_call.content][-1] == "tool_use"


def test_count_tokens_and_the_tolerant_cases(claude: anthropic.Anthropic) -> None:
    counted = claude.messages.count_tokens(model=CLAUDE, messages=ASK, system="Answer briefly.")
    made = claude.messages.create(model=CLAUDE, max_tokens=2, messages=ASK, system="Answer briefly.")
    assert counted.input_tokens == made.usage.input_tokens + made.usage.cache_read_input_tokens > 10

    # Claude Code's newer habits: a system message inside `messages`, cache_control, fields this server has no
    # use for, a block type it does not know in an old turn. All accepted; the system message is folded.
    folded = [{"role": "system", "content": "Answer briefly."}, *ASK]
    assert claude.messages.count_tokens(model=CLAUDE, messages=folded).input_tokens == counted.input_tokens
    tolerant = claude.messages.create(
        model=CLAUDE, max_tokens=3,
        system=[{"type": "text", "text": "Answer briefly.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]},
                  {"role": "assistant", "content": [{"type": "server_tool_use_v9", "id": "x", "whatever": 1},
                                                    {"type": "text", "text": "Hello."}]},
                  {"role": "system", "content": "Be kind."}, *ASK],
        metadata={"user_id": "u1"}, extra_body={"context_management": {"edits": []}, "brand_new_field": True})
    assert tolerant.stop_reason in ("end_turn", "max_tokens")


@pytest.mark.parametrize("body, says", [
    ({"model": CLAUDE, "messages": ASK}, "max_tokens"),
    ({"model": CLAUDE, "max_tokens": 5, "messages": [{"role": "robot", "content": "hi"}]}, "role"),
    ({"model": CLAUDE, "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]},
     "tool_use"),
    ({"model": CLAUDE, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "image"),
    ({"model": CLAUDE, "max_tokens": 5, "messages": ASK, "tool_choice": {"type": "tool", "name": "nope"},
      "tools": A_TOOLS}, "nope"),
])
def test_bad_requests_get_anthropic_s_error_body(coding_daemon: Daemon, body: dict, says: str) -> None:
    r = httpx.post(coding_daemon.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert says in error["error"]["message"]


def test_an_api_key_by_x_api_key_or_bearer(coding_daemon: Daemon) -> None:
    wrong = anthropic.Anthropic(base_url=coding_daemon.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model=CLAUDE, max_tokens=2, messages=ASK)
    assert refused.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=coding_daemon.url, auth_token=KEY, max_retries=0, timeout=120)
    assert bearer.messages.count_tokens(model=CLAUDE, messages=ASK).input_tokens > 0
    unknown = httpx.post(coding_daemon.url + "/v1/messages/count_tokens", headers={"x-api-key": KEY}, timeout=30,
                         json={"model": "claude-haiku-4-5", "messages": ASK})  # the pattern's, not the default's
    assert unknown.status_code == 200


def test_a_stop_sequence_is_reported(claude: anthropic.Anthropic) -> None:
    plain = text_of(claude.messages.create(model=CLAUDE, max_tokens=16, messages=ASK, extra_body=GREEDY,
                                           thinking={"type": "disabled"}))
    stop = plain.strip()[3:6]
    assert len(stop) == 3, plain
    cut = claude.messages.create(model=CLAUDE, max_tokens=16, messages=ASK, extra_body=GREEDY, stop_sequences=[stop],
                                 thinking={"type": "disabled"})
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert stop not in text_of(cut) and plain.startswith(text_of(cut))


def test_a_repeated_long_prefix_reads_the_prompt_cache(claude: anthropic.Anthropic) -> None:
    first = claude.messages.create(model=CLAUDE, max_tokens=2, system=PREFIX, messages=ASK, extra_body=GREEDY)
    again = claude.messages.create(model=CLAUDE, max_tokens=2, system=PREFIX, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": "And in Oslo?"}])
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens > 200
    assert again.usage.cache_read_input_tokens > 128


def test_thinking_comes_as_thinking_blocks_and_reasoning_items_and_switches_off(claude: anthropic.Anthropic,
                                                                              codex: openai.OpenAI) -> None:
    """Qwen3.5's generation prompt opens a think block: a random model's output is all thought until it closes it."""
    thinking = {"type": "enabled", "budget_tokens": 8}  # Anthropic's floor of 1024 is not enforced here
    whole = claude.messages.create(model="qwen3_5", max_tokens=12, messages=ASK, extra_body=GREEDY,
                                   thinking=thinking)
    assert whole.content[0].type == "thinking" and whole.content[0].thinking
    assert not any(m in whole.content[0].thinking for m in MARKUP)
    with claude.messages.stream(model="qwen3_5", max_tokens=12, messages=ASK, extra_body=GREEDY,
                                thinking=thinking) as stream:
        pieces = [e.delta.thinking for e in stream if e.type == "content_block_delta" and e.delta.type ==
                  "thinking_delta"]
    assert "".join(pieces) == whole.content[0].thinking
    off = claude.messages.create(model="qwen3_5", max_tokens=8, messages=ASK, extra_body=GREEDY,
                                 thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]

    reasoned = codex.responses.create(model="qwen3_5", input="Weather?", max_output_tokens=8, temperature=0)
    assert reasoned.output[0].type == "reasoning" and reasoned.output[0].content[0].text
    plain = codex.responses.create(model="qwen3_5", input="Weather?", max_output_tokens=8, temperature=0,
                                   reasoning={"effort": "none"})
    assert [item.type for item in plain.output] == ["message"]


# --- OpenAI Responses ------------------------------------------------------------------------------------------

CODEX = "gpt-5-codex"  # no such model here: `default_model` answers it
R_TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
            "parameters": WEATHER_SCHEMA, "strict": True},
           {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}]


@pytest.fixture(scope="module")
def codex(coding_daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=coding_daemon.v1, api_key=KEY, max_retries=0, timeout=120)


def test_a_plain_response_streams_alike_and_is_stored(codex: openai.OpenAI) -> None:
    whole = codex.responses.create(model=CODEX, input="What is the weather in Paris?", instructions="Be brief.",
                                   max_output_tokens=12, temperature=0, reasoning={"effort": "none"})
    assert whole.object == "response" and whole.model == CODEX and whole.status in ("completed", "incomplete")
    assert whole.output_text and whole.usage.output_tokens > 0 and whole.usage.input_tokens > 10
    assert codex.responses.retrieve(whole.id).output_text == whole.output_text

    events = list(codex.responses.create(model=CODEX, input="What is the weather in Paris?", instructions="Be brief.",
                                         max_output_tokens=12, temperature=0, reasoning={"effort": "none"},
                                         stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text

    codex.responses.delete(whole.id)
    with pytest.raises(openai.NotFoundError):
        codex.responses.retrieve(whole.id)


def test_a_forced_function_call_then_a_follow_up_by_previous_response_id(codex: openai.OpenAI) -> None:
    forced = {"type": "function", "name": "get_weather"}
    first = codex.responses.create(model=CODEX, input="Weather in Paris?", tools=R_TOOLS, tool_choice=forced,
                                   max_output_tokens=80, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_SCHEMA)

    events = list(codex.responses.create(model=CODEX, input="Weather in Paris?", tools=R_TOOLS, tool_choice=forced,
                                         max_output_tokens=80, temperature=0, stream=True, store=False))
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert pieces == calls[0].arguments
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added[-1] == "function_call"
    with pytest.raises(openai.NotFoundError):  # store=False: not kept
        codex.responses.retrieve(events[-1].response.id)

    follow = codex.responses.create(model=CODEX, previous_response_id=first.id, tools=R_TOOLS, max_output_tokens=4,
                                    temperature=0, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                           "output": "Sunny, 21 C, light wind"}])
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens > first.usage.input_tokens + 10  # the earlier turn and the call are in it
    with pytest.raises(openai.BadRequestError):  # without the earlier turn, the output answers no call
        codex.responses.create(model=CODEX, max_output_tokens=4, input=[
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny"}])

    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER_SCHEMA, "strict": True}
    answer = codex.responses.create(model=CODEX, input="Weather?", text={"format": fmt}, max_output_tokens=40,
                                    temperature=0, reasoning={"effort": "none"})
    jsonschema.validate(json.loads(answer.output_text), WEATHER_SCHEMA)


def test_the_store_is_bounded_and_forgets_the_least_recently_used(codex: openai.OpenAI) -> None:
    made = [codex.responses.create(model=CODEX, input=f"Say {i}", max_output_tokens=1) for i in range(4)]
    with pytest.raises(openai.NotFoundError):  # the store holds 3
        codex.responses.retrieve(made[0].id)
    with pytest.raises(openai.NotFoundError) as gone:
        codex.responses.create(model=CODEX, previous_response_id=made[0].id, input="And?", max_output_tokens=1)
    assert gone.value.body["param"] == "previous_response_id" and "not found" in gone.value.body["message"]
    assert [codex.responses.retrieve(m.id).id for m in made[1:]] == [m.id for m in made[1:]]


def test_a_repeated_long_prefix_reads_the_prompt_cache_in_responses(codex: openai.OpenAI) -> None:
    first = codex.responses.create(model=CODEX, instructions=PREFIX, input="Hello", max_output_tokens=2, store=False)
    again = codex.responses.create(model=CODEX, instructions=PREFIX, input="Hi there", max_output_tokens=2,
                                   store=False)
    assert first.usage.input_tokens > 200 and again.usage.input_tokens_details.cached_tokens > 128


def _admin(daemon: Daemon, path: str) -> httpx.Response:
    return httpx.get(daemon.url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)


def _disconnected(daemon: Daemon, endpoint: str) -> float:
    lines = dict(line.rsplit(" ", 1) for line in _admin(daemon, "/metrics").text.splitlines()
                 if line and not line.startswith("#"))
    return float(lines.get(f'mlxsup_requests_total{{endpoint="{endpoint}",model="qwen3",outcome="disconnected"}}', 0))


def test_a_client_that_leaves_aborts_its_generation(coding_daemon: Daemon) -> None:
    """Streamed (Messages and Responses) and whole (Responses): the lease goes back and the worker stops, at once,
    not after the 4000 tokens asked for. Greedy: sampled, this random-weight model sometimes ends its reply at once."""
    headers = {"x-api-key": KEY}
    streams = [("/v1/messages", {"model": CLAUDE, "max_tokens": 4000, "messages": ASK, "stream": True, **GREEDY,
                                 "thinking": {"type": "disabled"}}, "content_block_delta"),
               ("/v1/responses", {"model": CODEX, "max_output_tokens": 4000, "input": ASK, "stream": True, **GREEDY,
                                  "reasoning": {"effort": "none"}}, "response.output_text.delta")]

    def idle() -> bool:
        model = next(m for m in _admin(coding_daemon, "/api/status").json()["models"] if m["id"] == "qwen3")
        return model["in_flight"] == 0 and model["leases"] == 0 and model["batch_size"] == 0

    for endpoint, body, first_delta in streams:
        before = _disconnected(coding_daemon, endpoint)
        with httpx.stream("POST", coding_daemon.url + endpoint, json=body, headers=headers, timeout=60) as resp:
            assert next(line for line in resp.iter_lines() if first_delta in line)
        wait_for(lambda e=endpoint, n=before + 1: _disconnected(coding_daemon, e) == n, 10, what=f"{endpoint} to end")
        wait_for(idle, 10, what="the worker to stop generating for it")

    before = _disconnected(coding_daemon, "/v1/responses")
    with pytest.raises(httpx.ReadTimeout):  # a whole response the client stops waiting for
        httpx.post(coding_daemon.url + "/v1/responses", json={**streams[1][1], "stream": False}, headers=headers,
                   timeout=httpx.Timeout(60, read=2))
    wait_for(lambda: _disconnected(coding_daemon, "/v1/responses") == before + 1, 10, what="the response to end")
    wait_for(idle, 10, what="the worker to stop generating for it")


def test_an_eviction_mid_stream_is_an_error_event_not_a_cut_stream(claude: anthropic.Anthropic, codex: openai.OpenAI,
                                                                   coding_daemon: Daemon) -> None:
    """Last in the module: the model is evicted under a long stream (the next request loads it again)."""
    seen = []
    with pytest.raises(anthropic.APIStatusError) as failed:
        with claude.messages.stream(model=CLAUDE, max_tokens=4000, messages=ASK, extra_body=GREEDY,
                                    thinking={"type": "disabled"}) as stream:
            for event in stream:
                seen.append(event.type)
                if event.type == "content_block_delta" and seen.count("content_block_delta") == 1:
                    httpx.post(f"{coding_daemon.url}/api/models/qwen3/evict", json={"mode": "now"},
                               headers={"Authorization": f"Bearer {KEY}"}, timeout=30).raise_for_status()
    assert failed.value.body["type"] == "error" and failed.value.body["error"]["type"] == "overloaded_error"
    assert "message_stop" not in seen and "content_block_delta" in seen

    kinds = []  # the same under a Responses stream: `error`, then `response.failed`
    for event in codex.responses.create(model=CODEX, input="Weather in Paris?", max_output_tokens=4000,
                                        temperature=0, reasoning={"effort": "none"}, stream=True):
        kinds.append(event.type)
        if kinds.count("response.output_text.delta") == 1 and event.type == "response.output_text.delta":
            httpx.post(f"{coding_daemon.url}/api/models/qwen3/evict", json={"mode": "now"},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=30).raise_for_status()
        if event.type == "response.failed":
            assert event.response.status == "failed" and event.response.error.code == "server_error"
    assert kinds[-2:] == ["error", "response.failed"] and "response.completed" not in kinds
