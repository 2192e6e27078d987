"""The coding agents' APIs as pure logic: Anthropic Messages and OpenAI Responses requests to the neutral Submit,
the worker's typed deltas to each API's events and whole response, and the bounded response store.
A sweep of odd values through every place of a valid body proves the parsers answer a 4xx, never a crash."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from protocol.messages import Finished
from supervisor.errors import InvalidRequest, MlxsupError, ModelEvicted, NotFound
from supervisor.gateway.anthropic_api import AnthropicInvalid, anthropic_error_body, parse_messages
from supervisor.gateway.anthropic_shape import MessageShaper
from supervisor.gateway.response_store import ResponseStore
from supervisor.gateway.responses_api import parse_responses
from supervisor.gateway.responses_shape import ResponseShaper
from tests.integration.bodyfuzz import ODD_VALUES, Raw, _parent, _places

TOOL = {"name": "get_weather", "description": "weather", "input_schema": {"type": "object", "properties": {
    "city": {"type": "string"}}, "required": ["city"]}}
CALL_TURN = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                               {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                "input": {"city": "Oslo"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                           "content": [{"type": "text", "text": "down"}]},
                                          {"type": "text", "text": "and now?"}]}]


def fin(reason: str = "stop", extra: dict | None = None, cached: int = 0) -> Finished:
    return Finished(rid="r", text="", finish_reason=reason, prompt_tokens=50, completion_tokens=7,
                    cached_tokens=cached, extra=extra)


def test_a_messages_request_becomes_the_chat_api_s_submit() -> None:
    parsed = parse_messages({"model": "claude-x", "max_tokens": 9, "system": [{"type": "text", "text": "Be brief."}],
                             "messages": [{"role": "system", "content": "Be kind."}, *CALL_TURN],
                             "tools": [TOOL, {"type": "web_search_20250305", "name": "web_search"}],
                             "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                             "thinking": {"type": "disabled"}, "stop_sequences": ["END"],
                             "cache_control": {"type": "ephemeral"}, "brand_new": 1})
    sub = parsed.submit
    assert sub.messages == [
        {"role": "system", "content": "Be brief.\n\nBe kind."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "hmm", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: down"},
        {"role": "user", "content": "and now?"}]
    assert [t["name"] for t in sub.tools or []] == ["get_weather"]  # the server tool is skipped
    assert sub.constraint == {"type": "tool", "names": ["get_weather"], "parallel": False}
    assert sub.template_kwargs == {"enable_thinking": False} and sub.stop == ["END"] and sub.max_tokens == 9


@pytest.mark.parametrize("body, says", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "role"),
    ({"max_tokens": 5, "messages": CALL_TURN[2:]}, "toolu_1"),
    ({"max_tokens": 5, "messages": [], "system": "x"}, "messages"),
    ({"max_tokens": 5, "messages": CALL_TURN, "thinking": {"type": "enabled", "budget_tokens": 9}}, "budget_tokens"),
])
def test_what_matters_is_refused_with_anthropic_s_error(body: dict, says: str) -> None:
    with pytest.raises(AnthropicInvalid) as refused:
        parse_messages({"model": "m", **body})
    error = anthropic_error_body(refused.value)
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert says in error["error"]["message"]
    assert anthropic_error_body(ModelEvicted("gone"))["error"]["type"] == "overloaded_error"


def test_message_events_and_the_whole_message_say_the_same() -> None:
    shaper = MessageShaper("msg_1", "claude-x")
    events = shaper.start()
    events += shaper.feed("", {"reasoning": "let me"})
    events += shaper.feed("", {"reasoning": " see"})
    events += shaper.feed("\n\n", None)  # between the thought and the call: no text block
    events += shaper.feed("", {"calls": [[0, "call_1", "get_weather", '{"city": ']]})
    events += shaper.feed("", {"calls": [[0, "", "", '"Oslo"}']]})
    events += shaper.finish(fin("tool_calls", cached=20))
    assert [e["type"] for e in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    assert events[2]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert events[6]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"] == {"input_tokens": 30, "output_tokens": 7, "cache_creation_input_tokens": 0,
                                   "cache_read_input_tokens": 20}
    whole = shaper.whole(fin("tool_calls"))
    assert whole["content"] == [{"type": "thinking", "thinking": "let me see", "signature": ""},
                                {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Oslo"}}]
    assert MessageShaper("m", "x").whole(fin("stop", {"stop_sequence": "END"}))["stop_reason"] == "stop_sequence"
    assert MessageShaper("m", "x").whole(fin("length"))["stop_reason"] == "max_tokens"


def test_responses_input_items_and_the_history_become_one_conversation() -> None:
    history = [{"role": "user", "content": "Weather?"}]
    body = {"model": "gpt-5-codex", "instructions": "Be brief.", "previous_response_id": "resp_1",
            "input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
                      {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                      {"role": "developer", "content": [{"type": "input_text", "text": "Rules."}]}],
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
                      {"type": "web_search"}],
            "tool_choice": "required", "parallel_tool_calls": False, "reasoning": {"effort": "none"},
            "store": False, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k"}
    wanted = parse_responses(body, lambda rid: history if rid == "resp_1" else [])
    assert wanted.parsed.submit.messages == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "think", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "system", "content": "Rules."}]
    assert wanted.conversation == wanted.parsed.submit.messages[1:] and not wanted.store
    assert wanted.parsed.submit.constraint == {"type": "tool", "names": ["get_weather"], "parallel": False}
    assert wanted.parsed.submit.template_kwargs == {"enable_thinking": False}
    with pytest.raises(InvalidRequest, match="c9"):
        parse_responses({"model": "m", "input": [{"type": "function_call_output", "call_id": "c9", "output": ""}]},
                        lambda rid: [])
    with pytest.raises(InvalidRequest, match="frobnicate"):
        parse_responses({"model": "m", "input": "x", "frobnicate": 1}, lambda rid: [])


def test_response_events_and_the_whole_response_say_the_same() -> None:
    shaper = ResponseShaper("resp_1", "gpt-5-codex", {"store": True})
    events = shaper.start() + shaper.feed("", {"reasoning": "hm"}) + shaper.feed("Hi", None)
    events += shaper.feed("", {"calls": [[0, "call_1", "f", "{}"]]}) + shaper.finish(fin("tool_calls"))
    kinds = [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    assert "response.function_call_arguments.done" in kinds and "response.output_text.done" in kinds
    output = events[-1]["response"]["output"]
    assert [i["type"] for i in output] == ["reasoning", "message", "function_call"]
    assert output[1]["content"][0]["text"] == "Hi" and output[2]["call_id"] == "call_1"
    assert shaper.turn() == {"role": "assistant", "content": "Hi", "reasoning_content": "hm", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    failed = ResponseShaper("r", "m", {}).failed(ModelEvicted("evicted"))
    assert [e["type"] for e in failed] == ["error", "response.failed"]
    assert failed[1]["response"]["status"] == "failed"
    assert ResponseShaper("r", "m", {}).whole(fin("length"))["status"] == "incomplete"


def test_the_store_keeps_the_most_recently_used_within_its_count_and_bytes() -> None:
    store = ResponseStore(max_count=2, max_bytes=300)
    for rid in ("a", "b"):
        assert store.put({"id": rid}, [{"role": "user", "content": rid}])
    assert store.get("a") is not None  # a is now the most recently used
    store.put({"id": "c"}, [])
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    store.put({"id": "big"}, [{"role": "user", "content": "x" * 250}])  # within the bytes only alone
    assert store.get("big") is not None and store.get("a") is None and store.get("c") is None
    assert not store.put({"id": "huge"}, [{"content": "x" * 500}]) and store.get("huge") is None
    assert store.delete("big") and not store.delete("big") and store.bytes == 0


def _odd_bodies(base: dict) -> list[Any]:
    out = []
    for place in list(_places(base)):
        dropped = copy.deepcopy(base)
        del _parent(dropped, place)[place[-1]]
        out.append(dropped)
        for value in ODD_VALUES:
            if isinstance(value, Raw):
                continue
            body = copy.deepcopy(base)
            _parent(body, place)[place[-1]] = value
            out.append(body)
    return out


@pytest.mark.parametrize("parse, base", [
    (lambda b: parse_messages(b), {"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "s"}],
                                   "messages": CALL_TURN, "tools": [TOOL], "tool_choice": {"type": "tool",
                                   "name": "get_weather"}, "thinking": {"type": "enabled", "budget_tokens": 2},
                                   "stop_sequences": ["x"], "temperature": 0.5, "output_config": {"effort": "low"}}),
    (lambda b: parse_messages(b, counting=True), {"model": "m", "messages": CALL_TURN}),
    (lambda b: parse_responses(b, lambda rid: [{"role": "user", "content": "hi"}]), {
        "model": "m", "instructions": "i", "previous_response_id": "r", "max_output_tokens": 5, "temperature": 1,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}]},
                  {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c", "output": "o"}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"}, "text": {"format": {"type": "json_schema", "name": "n",
                                                                              "schema": {"type": "object"}}},
        "reasoning": {"effort": "low"}}),
])
def test_odd_values_anywhere_get_a_4xx_never_a_crash(parse: Any, base: dict) -> None:
    parse(copy.deepcopy(base))  # the base itself is valid
    for body in _odd_bodies(base):
        try:
            parse(body)
        except MlxsupError as exc:
            assert 400 <= exc.status < 500 and exc.message
        except Exception as exc:  # any other exception is the bug this test looks for
            pytest.fail(f"{type(exc).__name__}: {exc} for {json.dumps(body, default=str)[:300]}")
    with pytest.raises(NotFound):
        parse_responses({"model": "m", "input": "x", "previous_response_id": "gone"}, _not_found)


def _not_found(rid: str) -> list[dict]:
    raise NotFound(f"no {rid}")


