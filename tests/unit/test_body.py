"""Request-body decoding: every body that is not JSON we take is an InvalidRequest naming the problem."""

from __future__ import annotations

import pytest

from protocol.codec import ProtocolError, encode
from protocol.messages import Evict, Submit
from supervisor.errors import InvalidRequest
from supervisor.gateway.body import MAX_DEPTH, decode_json


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
