"""Request bodies: bytes to the JSON value a client may send, or InvalidRequest naming what is wrong.

Pure: no HTTP, no state. Every body of every route passes through `decode_json`, so every way a
body can fail is a 400 here, not a 500 somewhere after it. Invariants of a value it returns:
- it is plain JSON (no NaN or infinities, integers of at most MAX_INT_DIGITS digits), nested at
  most MAX_DEPTH levels, so later code that walks or re-encodes it (validation, error messages,
  msgpack to the worker, a chat template) cannot run out of stack or meet Python's
  integer-conversion limit;
- every string in it, keys included, encodes to UTF-8: a JSON `\\ud800` escape decodes to a lone
  surrogate, which would otherwise blow up wherever the string is next encoded (the response
  echoing it, msgpack to the worker, the tokenizer).
A body past OFF_LOOP_BYTES is decoded in a thread (`decode_json_off_loop`): decoding megabytes of
JSON takes long enough to stall every other request and /health if it ran on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from supervisor.errors import InvalidRequest

MAX_DEPTH = 100  # OpenAI bodies nest a few levels; JSON schemas of tools a few dozen at most
MAX_INT_DIGITS = 100
OFF_LOOP_BYTES = 1 << 20  # a body this large is decoded in a thread, off the event loop

# A lone surrogate can only come from a \uD800-\uDFFF escape (the UTF-8 decoder refuses encoded ones),
# so a body without one needs no string check.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

# A node's place in the body, as a linked list back to the root: (parent, key or index).
_Where = tuple["_Where | None", "str | int"] | None


def decode_json(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text, parse_int=_integer, parse_float=_finite_float, parse_constant=_constant)
    except RecursionError:
        raise InvalidRequest(f"the request body is nested too deeply (at most {MAX_DEPTH} levels)") from None
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    check_value(value, strings=_SURROGATE_ESCAPE.search(raw) is not None)
    return value


async def decode_json_off_loop(raw: bytes) -> Any:
    """decode_json, in a thread when `raw` is large enough to stall the event loop."""
    if len(raw) < OFF_LOOP_BYTES:
        return decode_json(raw)
    return await asyncio.to_thread(decode_json, raw)


def _integer(digits: str) -> int:
    count = len(digits.lstrip("-"))
    if count > MAX_INT_DIGITS:
        raise InvalidRequest(f"the request body holds an integer of {count} digits (at most {MAX_INT_DIGITS})")
    return int(digits)


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise InvalidRequest(f"the request body holds a number out of range: {text[:40]}")
    return value


def _constant(name: str) -> Any:
    raise InvalidRequest(f"the request body is not valid JSON: {name} is not a JSON value")


def check_value(root: Any, strings: bool = True) -> None:
    """Refuse nesting past MAX_DEPTH and, with `strings`, any string that does not encode to UTF-8.

    Iterative, so a deep value cannot overflow the stack here either.
    """
    stack: list[tuple[Any, int, _Where]] = [(root, 1, None)]
    while stack:
        node, depth, where = stack.pop()
        if isinstance(node, dict):
            children: Any = node.items()
        elif isinstance(node, list):
            children = enumerate(node)
        else:
            if strings and isinstance(node, str):
                _check_text(node, where, "")
            continue
        if depth > MAX_DEPTH:
            raise InvalidRequest(f"the request body is nested too deeply (at most {MAX_DEPTH} levels) at "
                                 f"{path(where)}", param=path(where))
        for key, child in children:
            if strings and isinstance(key, str):
                _check_text(key, where, "a key in ")
            if strings or isinstance(child, (dict, list)):
                stack.append((child, depth + 1, (where, key)))


def _check_text(text: str, where: _Where, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = ord(text[exc.start])
        place = path(where)
        raise InvalidRequest(f"{what}{place or 'the body'} holds a lone surrogate (U+{char:04X}), which is not "
                             "valid Unicode", param=place or None) from None


def path(where: _Where, limit: int = 80) -> str:
    """`messages[0].content` for the linked place `where` ('' for the root), cut to `limit` characters."""
    parts: list[str] = []
    while where is not None:
        where, key = where
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    text = "".join(reversed(parts)).lstrip(".")
    return text if len(text) <= limit else text[:limit] + "..."
