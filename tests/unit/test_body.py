"""Request-body decoding: every body that is not JSON we take is an InvalidRequest naming the problem."""

from __future__ import annotations

import asyncio
import threading

import pytest
from starlette.requests import Request

from protocol.codec import ProtocolError, encode
from protocol.messages import Evict, Submit
from supervisor.errors import InvalidRequest
from supervisor.gateway import body
from supervisor.gateway.body import MAX_DEPTH, OFF_LOOP_BYTES, decode_json, decode_json_off_loop
from supervisor.gateway.http import read_json


@pytest.mark.parametrize("raw, says, param", [
    (b"[" * 200_000 + b"]" * 200_000, "nested too deeply", None),
    (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), "nested too deeply", "[0][0]"),
    (b'{"messages": [{"content": "\\ud800"}]}', "lone surrogate (U+D800)", "messages[0].content"),
    (b'{"stop": ["ok", "\\udc00x"]}', "lone surrogate (U+DC00)", "stop[1]"),
    (b'{"a": {"\\ud800": 1}}', "a key in a holds", "a"),
    (b'"\\udfff"', "the body holds a lone surrogate", None),
    (b'{"max_tokens": ' + b"9" * 5000 + b"}", "integer of 5000 digits", None),
    (b'{"t": NaN}', "NaN is not a JSON value", None),
    (b'{"t": -Infinity}', "-Infinity is not a JSON value", None),
    (b'{"t": 1e400}', "out of range", None),
    (b'{"t": 1', "not valid JSON", None),
    (b"\xff", "not valid UTF-8", None),
    (b"", "not valid JSON", None),
])
def test_bad_bodies_are_invalid_requests(raw: bytes, says: str, param: str | None) -> None:
    with pytest.raises(InvalidRequest) as err:
        decode_json(raw)
    assert says in err.value.message
    assert err.value.param == param or (param is not None and err.value.param.startswith(param))
    assert err.value.status == 400


def test_good_bodies_decode_unchanged() -> None:
    nested = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert decode_json(nested) is not None
    assert decode_json(b'{"s": "\\ud83d\\ude00 \\u0000", "n": -' + b"9" * 100 + b', "f": 1e308}') == \
        {"s": "😀 \x00", "n": -int("9" * 100), "f": 1e308}


def test_what_the_wire_cannot_carry_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="submit: cannot encode"):
        encode(Submit(rid="r", max_tokens=1, prompt="\ud800"))
    with pytest.raises(ProtocolError, match="evict: cannot encode"):
        encode(Evict(deadline_s=10**30))


def test_a_large_body_is_decoded_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoding 8 MB of JSON on the loop stalled every request and /health for seconds. Here the decode,
    once started, asks the loop to run a callback (what /health does) and waits for it: on the loop, the
    callback could not run until the decode returned, and the wait gives up."""
    loop_answered: list[bool] = []

    def decode_waiting_for_the_loop(raw: bytes) -> object:
        answered = threading.Event()
        loop.call_soon_threadsafe(answered.set)
        loop_answered.append(answered.wait(timeout=10))
        return decode_json(raw)

    monkeypatch.setattr(body, "decode_json", decode_waiting_for_the_loop)
    raw = b'{"pad": "' + b"x" * OFF_LOOP_BYTES + b'"}'

    async def receive() -> dict:
        return {"type": "http.request", "body": raw, "more_body": False}

    request = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}, receive)
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(read_json(request, 2 * OFF_LOOP_BYTES)) == {"pad": "x" * OFF_LOOP_BYTES}
    finally:
        loop.close()
    assert loop_answered == [True]


def test_a_small_body_is_decoded_on_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    monkeypatch.setattr(body, "decode_json", lambda raw: threads.append(threading.current_thread().name) or {})
    asyncio.run(decode_json_off_loop(b"{}"))
    assert threads == [threading.main_thread().name]
