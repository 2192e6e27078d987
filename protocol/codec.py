"""msgpack encoding of protocol messages, with validation at the decoder.

Wire form: one msgpack map per ZeroMQ frame, {"v": PROTOCOL_VERSION, "k": kind, **fields}.
Invariant: decode() either returns a fully typed message or raises ProtocolError; nothing
malformed, oversized, of another version or of an unknown kind gets past it. No pickle,
no ext types.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import msgpack

from protocol.messages import ALL_MESSAGES, PROTOCOL_VERSION, Message

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


class VersionMismatch(ProtocolError):
    def __init__(self, version: object) -> None:
        super().__init__(f"peer speaks protocol version {version!r}, this side speaks {PROTOCOL_VERSION}")
        self.version = version


_KINDS: dict[str, type[Message]] = {cls.KIND: cls for cls in ALL_MESSAGES}


def _field_specs(cls: type[Message]) -> list[tuple[str, Any, bool]]:
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        specs.append((f.name, hints[f.name], required))
    return specs


_SPECS = {kind: _field_specs(cls) for kind, cls in _KINDS.items()}
_NAMES = {kind: tuple(name for name, _, _ in specs) for kind, specs in _SPECS.items()}


def _type_ok(value: object, hint: Any) -> bool:
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    return isinstance(value, hint)


def encode(msg: Message) -> bytes:
    """The frame of `msg`; ProtocolError when a value cannot go on the wire (a string that is not
    valid Unicode, an integer past 64 bits, nesting past msgpack's limit)."""
    body = {"v": PROTOCOL_VERSION, "k": msg.KIND}
    for name in _NAMES[msg.KIND]:
        body[name] = getattr(msg, name)
    try:
        return msgpack.packb(body, use_bin_type=True)
    except (ValueError, OverflowError, TypeError) as exc:  # UnicodeEncodeError is a ValueError
        raise ProtocolError(f"{msg.KIND}: cannot encode: {exc}") from None


def decode(frame: bytes) -> Message:
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(frame)} bytes exceeds the limit of {MAX_MESSAGE_BYTES}")
    try:
        body = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable frame: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"message is a {type(body).__name__}, not a map")
    version = body.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(version)
    kind = body.pop("k", None)
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    kwargs = {}
    for name, hint, required in _SPECS[kind]:
        if name not in body:
            if required:
                raise ProtocolError(f"{kind}: missing field {name!r}")
            continue
        value = body.pop(name)
        if not _type_ok(value, hint):
            raise ProtocolError(f"{kind}.{name}: expected {hint}, got {type(value).__name__}")
        kwargs[name] = value
    if body:
        raise ProtocolError(f"{kind}: unknown fields {sorted(map(str, body))}")
    return cls(**kwargs)
