"""Mutated request bodies for the gateway fuzz test: valid bodies, changed by a seeded random source.

Each case is (path, body bytes). Mutations: drop, add or rename a field, swap a value for any
other JSON value (odd numbers, odd unicode, lone surrogates, long strings, deep nesting), wrap a
value in nesting, repeat list items, and, on the encoded text, truncate, flip bytes, insert tokens
that are not JSON. Generation stays cheap: a body that would be valid never asks for more than
`MAX_TOKENS_CAP` tokens.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from typing import Any

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MAX_TOKENS_CAP = 3


class Raw:
    """JSON text put into a body as is (what json.dumps cannot write: NaN, 5,000 digits, 100,000 brackets)."""

    def __init__(self, text: str) -> None:
        self.text = text


ODD_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 4096, 2**31, 2**63, 2**64, 10**30, -(10**30), 0.5, -0.0, 1e-300, 1e308, -1e308,
    "", " ", "x" * 20_000, "\x00\x01\x1f\x7f", "\u202eevil", "😀" * 8, "\ud800", "a\udfffb", "\ufeff", "\uffff",
    "NaN", "tiny", "../../etc/passwd", "<|bos|>", [], {}, [1, "a", None], {"a": {"b": []}}, [[[[[[[[]]]]]]]],
    {"type": "text", "text": 1}, [{"type": "text", "text": "\ud800"}], ["x"] * 5,
    Raw("9" * 5000), Raw("-" + "1" * 400), Raw("1e999"), Raw("NaN"), Raw("-Infinity"),
    Raw("[" * 100_000 + "]" * 100_000),
    Raw('{"a":' * 120 + "1" + "}" * 120), Raw('"\\ud800\\udc00"'), Raw('"\\u0000"'),
]

BASES: list[tuple[str, dict, int]] = [  # (path, valid body, weight)
    (CHAT, {"model": "tiny", "max_tokens": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "stop": ["\n"],
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "seed": 1, "user": "u", "stream": False}, 5),
    (COMP, {"model": "tiny", "prompt": "Once", "max_tokens": 2, "temperature": 0, "stop": "x", "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}, 4),
    ("/api/models/nope/evict", {"mode": "drain", "timeout": 1}, 1),  # an unknown model: nothing is evicted
    ("/api/models/nope/load", {"stream": True}, 1),
    ("/api/hot-cache/clear", {"model": "nope"}, 1),
    ("/api/ssd-cache/clear", {"model": "nope"}, 1),
]


def encode(body: Any) -> bytes:
    raws: list[str] = []

    def placeholder(obj: Any) -> str:
        if isinstance(obj, Raw):
            raws.append(obj.text)
            return f"@@RAW{len(raws) - 1}@@"
        raise TypeError(type(obj))

    text = json.dumps(body, default=placeholder)  # ensure_ascii: a lone surrogate goes out as its \\u escape
    for i, raw in enumerate(raws):
        text = text.replace(f'"@@RAW{i}@@"', raw)
    return text.encode()


def _places(node: Any, here: tuple = ()) -> Iterator[tuple]:
    """Every place in a body: the path of keys and indices from the root."""
    if isinstance(node, dict):
        items: Any = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return
    for key, child in items:
        yield (*here, key)
        yield from _places(child, (*here, key))


def _parent(body: Any, place: tuple) -> Any:
    for key in place[:-1]:
        body = body[key]
    return body


def cap_generation(path: str, body: Any) -> Any:
    """A body that would generate asks for at most MAX_TOKENS_CAP tokens (none given means the whole context)."""
    if path not in (CHAT, COMP) or not isinstance(body, dict):
        return body
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS_CAP:
            body[key] = MAX_TOKENS_CAP
    if body.get("max_completion_tokens") is None and body.get("max_tokens") is None:
        body["max_tokens"] = MAX_TOKENS_CAP
    return body


def sweep() -> Iterator[tuple[str, bytes]]:
    """Every place of every base body, dropped and set to every odd value, one at a time."""
    for path, base, _ in BASES:
        for place in list(_places(base)):
            dropped = copy.deepcopy(base)
            del _parent(dropped, place)[place[-1]]
            yield path, encode(cap_generation(path, dropped))
            for value in ODD_VALUES:
                body = copy.deepcopy(base)
                _parent(body, place)[place[-1]] = value
                yield path, encode(cap_generation(path, body))


def _mutate_tree(rng: random.Random, body: Any) -> Any:
    places = list(_places(body))
    op = rng.randrange(6)
    if op == 0 or not places:  # a new field
        target = rng.choice([body] + [_parent(body, p)[p[-1]] for p in places])
        if isinstance(target, dict):
            value = rng.choice(ODD_VALUES)  # drawn before the key, as the seeded cases always were
            target[rng.choice(["model", "x", "messages", "stream", "\ud800", "", "n", "tools"])] = value
        return body
    place = rng.choice(places)
    parent, key = _parent(body, place), place[-1]
    if op == 1:
        del parent[key]
    elif op == 2:
        parent[key] = rng.choice(ODD_VALUES)
    elif op == 3:  # nesting
        for _ in range(rng.choice([1, 3, 40, 99, 101])):
            parent[key] = [parent[key]] if rng.random() < 0.5 else {"x": parent[key]}
    elif op == 4 and isinstance(parent[key], list) and parent[key]:
        parent[key] = parent[key] * rng.choice([2, 50])
    elif op == 5 and isinstance(parent, dict):  # rename a field
        parent[rng.choice(["content", "role", "text", "type", "prompt", "mode", "Model"])] = parent.pop(key)
    return body


def _mutate_text(rng: random.Random, raw: bytes) -> bytes:
    op = rng.randrange(4)
    at = rng.randrange(len(raw) + 1)
    if op == 0:
        return raw[:at]
    if op == 1 and raw:
        at = min(at, len(raw) - 1)
        return raw[:at] + bytes([rng.randrange(256)]) + raw[at + 1:]
    if op == 2:
        token = rng.choice([b"NaN", b"Infinity", b",", b"}", b'"\\ud800"', b"1e999", b"9" * 5000, b"\xff", b"\x00"])
        return raw[:at] + token + raw[at:]
    return raw.replace(b"{", b'{"model": 1, ', 1)  # a duplicate key, the first of two


def random_cases(seed: int, count: int) -> Iterator[tuple[str, bytes]]:
    rng = random.Random(seed)
    weighted = [(p, b) for p, b, w in BASES for _ in range(w)]
    for _ in range(count):
        path, base = rng.choice(weighted)
        body = copy.deepcopy(base)
        for _ in range(rng.choice([1, 1, 2, 3])):
            body = _mutate_tree(rng, body)
        raw = encode(cap_generation(path, body))
        if rng.random() < 0.2:
            raw = _mutate_text(rng, raw)
        yield path, raw
