"""Request validation: every bad input names its parameter; good input becomes the right Submit."""

from __future__ import annotations

import pytest

from supervisor.errors import InvalidRequest
from supervisor.gateway.openai_api import parse_chat, parse_completion

MSGS = [{"role": "user", "content": "hi"}]


def chat(**kw) -> dict:
    return {"model": "m", "messages": MSGS, **kw}


def test_chat_defaults_and_options() -> None:
    p = parse_chat(chat(max_tokens=5, temperature=0, top_p=0.5, stop="x", stream=True,
                        stream_options={"include_usage": True}))
    s = p.submit
    assert (p.model, p.stream, p.include_usage) == ("m", True, True)
    assert (s.max_tokens, s.temperature, s.top_p, s.stop) == (5, 0.0, 0.5, ["x"])
    assert s.messages == MSGS and s.prompt is None and s.rid.startswith("chatcmpl-")
    assert parse_chat(chat()).submit.max_tokens == 0  # up to the context
    assert parse_chat(chat(max_completion_tokens=7)).submit.max_tokens == 7


def test_text_parts_are_joined() -> None:
    body = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert parse_chat(body).submit.messages[0]["content"] == "ab"


def test_completion_defaults() -> None:
    s = parse_completion({"model": "m", "prompt": ["hello"]}).submit
    assert (s.prompt, s.max_tokens, s.messages) == ("hello", 16, None)


@pytest.mark.parametrize("body, param", [
    ([], None),
    ({"messages": MSGS}, "model"),
    (chat(model=""), "model"),
    (chat(messages=[]), "messages"),
    (chat(messages="hi"), "messages"),
    (chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages[0].content"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(max_tokens=-1), "max_tokens"),
    (chat(max_tokens=10**9), "max_tokens"),
    (chat(max_tokens="5"), "max_tokens"),
    (chat(temperature=2.5), "temperature"),
    (chat(temperature="hot"), "temperature"),
    (chat(top_p=1.5), "top_p"),
    (chat(top_k=-1), "top_k"),
    (chat(min_p=2), "min_p"),
    (chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    (chat(stop=[1]), "stop"),
    (chat(n=2), "n"),
    (chat(stream="yes"), "stream"),
    (chat(stream_options={"include_usage": True}), "stream_options"),
    (chat(logprobs=True), "logprobs"),
    (chat(tools=[{"type": "function"}]), "tools"),
    (chat(frequency_penalty=1.0), "frequency_penalty"),
    (chat(wibble=1), "wibble"),
    (chat(ignore_eos="no"), "ignore_eos"),
])
def test_chat_rejections(body, param) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_chat(body)
    assert err.value.param == param
    assert err.value.status == 400 and err.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": ""}, "prompt"),
    ({"model": "m", "prompt": [1, 2, 3]}, "prompt"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": "x", "echo": True}, "echo"),
    ({"model": "m", "prompt": "x", "best_of": 3}, "best_of"),
])
def test_completion_rejections(body, param) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_completion(body)
    assert err.value.param == param
