"""OpenAI Responses request validation (`POST /v1/responses`). Pure: no I/O, no state.

parse_responses turns a body into a `ResponsesRequest`: a `Parsed` whose Submit is the chat API's
API-neutral one (openai_api.py), and what the response echoes. `input` items become the chat
template's messages: `message` items by role (`developer` as `system`), `function_call` items an
assistant's `tool_calls`, `function_call_output` items `tool` messages, `reasoning` items the
assistant's `reasoning_content`; consecutive assistant items make one assistant turn. Function tools
become {"name", "description", "parameters"}; tool_choice and `text.format` a decoding constraint;
`reasoning.effort` the template's reasoning_effort ("none": thinking off); `prompt_cache_key` (Codex sends one every
request) the chat API's cache mark (openai_api.prompt_cache_marks). A user message's `input_image`
parts (by `image_url`) become image parts (images.py), kept in the stored turn so a follow-up sees them again.

With `previous_response_id`, the stored conversation (response_store.py, looked up by the caller's
`history`) comes first and only the new turn is in `input`; `instructions` are the new request's
only, as OpenAI does. A `function_call_output` must answer a call made earlier in the conversation.
Every field OpenAI's API takes is accepted (IGNORED: those that mean nothing here; `background`,
`conversation` and `prompt` only when unset: ignoring them would answer something else); an unknown
field is ignored with a warning, or refused with `strict` (unknown_fields.py).

What the response echoes is kept by the store, so it is held to the API's limits: `metadata` is at
most 16 string pairs (keys up to 64 characters, values up to 512); function names, of tools and of
calls in `input`, match openai_api.NAME (they reach the chat template unescaped).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol.messages import Submit
from supervisor.errors import InvalidRequest
from supervisor.gateway import unknown_fields
from supervisor.gateway.images import content as content_of
from supervisor.gateway.images import image_part, url_source
from supervisor.gateway.openai_api import (
    MAX_TOKENS_LIMIT,
    Parsed,
    given,
    new_id,
    prompt_cache_marks,
    speculative,
    valid_name,
)
from supervisor.gateway.tools import ToolDialect, parse_tool_choice, parse_tools
from supervisor.units import is_number

log = logging.getLogger(__name__)

# client_metadata is not OpenAI's: Codex sends it on every request
IGNORED = {"user", "include", "truncation", "service_tier", "safety_identifier", "max_tool_calls", "top_logprobs",
           "stream_options", "context_management", "client_metadata"}
UNSUPPORTED = ("background", "conversation", "prompt")  # accepted when unset (null or false)
PARAMS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text", "reasoning",
          "max_output_tokens", "temperature", "top_p", "stream", "store", "previous_response_id",
          "metadata", "prompt_cache_key", "prompt_cache_retention", "speculative", *UNSUPPORTED} | IGNORED
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


@dataclass
class ResponsesRequest:
    parsed: Parsed
    turn: list[dict]  # this request's own `input` as messages (the store keeps it, not the history before it)
    store: bool
    previous_id: str | None
    echo: dict = field(default_factory=dict)  # request fields the response object repeats


def _bad(message: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=param)


def _name(name: Any, where: str) -> str:
    if not valid_name(name):
        raise _bad(f"'{where}' must match the pattern '^[a-zA-Z0-9_-]{{1,64}}$' (letters, digits, underscores "
                   "and dashes, at most 64)", where)
    return name


def metadata(value: Any) -> dict:
    """`metadata` as the API defines it: at most 16 pairs of strings, keys up to 64 characters, values 512."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS:
        raise _bad(f"'metadata' must be an object of at most {MAX_METADATA_PAIRS} key-value pairs", "metadata")
    for key, text in value.items():
        if len(key) > MAX_METADATA_KEY or not isinstance(text, str) or len(text) > MAX_METADATA_VALUE:
            raise _bad(f"'metadata' keys must be strings of at most {MAX_METADATA_KEY} characters and its values "
                       f"strings of at most {MAX_METADATA_VALUE}", "metadata")
    return value


def _text(content: Any, where: str, images: bool = False) -> Any:
    """Content parts' text; with `images` (a user message), its text and `input_image` parts (images.content)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of content parts", where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise _bad(f"{where}[{j}] must be a content part with a 'type'", where)
        if kind == "input_image" and images and part.get("file_id") is None:
            parts.append(image_part(url_source(part.get("image_url"), f"{where}[{j}].image_url")))
        elif kind in ("input_image", "input_file", "input_audio"):
            what = "an image in a user message, by 'image_url'" if kind == "input_image" else "no files or audio"
            raise _bad(f"{where}[{j}]: '{kind}' is not supported here (this server takes {what})", where)
        elif kind in TEXT_PARTS and isinstance(part.get("text", part.get("refusal")), str):
            parts.append({"type": "text", "text": part.get("text", part.get("refusal"))})
        else:
            log.warning("[responses] skipped a content part of type=%.40r at=%s[%d]", kind, where, j)
    return content_of(parts)


def _messages(items: Any, known_calls: set[str]) -> list[dict]:
    """`input` as chat messages; the ids of the calls it makes are added to `known_calls`."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise _bad("'input' must be a string or a list of items", "input")
    out: list[dict] = []

    def assistant() -> dict:
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        return out[-1]

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if not isinstance(kind, str):
            raise _bad(f"{where}.type must be a string", f"{where}.type")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role must be one of user, system, developer, assistant", f"{where}.role")
            text = _text(item.get("content", ""), f"{where}.content", images=role == "user")
            if role == "assistant":
                assistant()["content"] += text
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, str):
                raise _bad(f"{where}: a function_call needs string 'call_id', 'name' and 'arguments'", where)
            _name(name, f"{where}.name")
            known_calls.add(call_id)
            assistant().setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in known_calls:
                raise _bad(f"{where}: no tool call found for function call output with call_id {call_id!r}",
                           f"{where}.call_id")
            output = item.get("output", "")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            text = _text(item.get("content") or item.get("summary") or [], f"{where}.content")
            if text:
                message = assistant()
                message["reasoning_content"] = message.get("reasoning_content", "") + text
        else:
            log.warning("[responses] skipped an input item of type=%.40r at=%s", kind, where)
    return out


TOOLS = ToolDialect(
    api="responses", path="tools[{j}]", function=lambda tool: tool, at="", schema="parameters",
    default_schema={"type": "object", "properties": {}}, check_name=_name, bad=_bad,
    said={"list": "'tools' must be a list", "object": "{where} must be an object", "name": "{where} is required",
          "schema": "{where} must be a JSON schema object", "needs": "'tool_choice' needs function 'tools'",
          "choice": "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}"},
    skips=lambda tool: tool.get("type") != "function",
    choice_name=lambda choice: choice.get("name") if choice.get("type") == "function" else None)


def _text_format(body: dict) -> tuple[dict | None, dict]:
    """(the decoding constraint, the `text` the response echoes) of `text.format`."""
    text = body.get("text") or {}
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or (fmt is not None and not isinstance(fmt, dict)):
        raise _bad("'text' must be an object with a 'format' object", "text")
    kind = (fmt or {}).get("type", "text")
    echo = {"format": fmt or {"type": "text"}}
    if kind == "text":
        return None, echo
    if kind == "json_object":
        return {"type": "json", "schema": None}, echo
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):  # type: ignore[union-attr]
            raise _bad("text.format.schema must be a JSON schema object", "text.format.schema")
        return {"type": "json", "schema": fmt["schema"], "name": str(fmt.get("name") or "")}, echo  # type: ignore
    raise _bad("text.format.type must be 'text', 'json_object' or 'json_schema'", "text.format.type")


def _reasoning(body: dict) -> tuple[dict, dict | None]:
    reasoning = body.get("reasoning")
    if reasoning is None:
        return {}, None
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else "?"
    if effort is None:
        return {}, reasoning
    if effort not in EFFORTS:
        raise _bad(f"reasoning.effort must be one of {', '.join(EFFORTS)}", "reasoning.effort")
    if effort == "none":
        return {"enable_thinking": False}, reasoning
    return {"reasoning_effort": {"minimal": "low", "xhigh": "high"}.get(effort, effort)}, reasoning


def _number(body: dict, key: str, default: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not is_number(value) or not 0 <= value <= hi:
        raise _bad(f"'{key}' must be a number from 0 to {hi}", key)
    return float(value)


def parse_responses(body: Any, history: Callable[[str], list[dict]], strict: bool = False) -> ResponsesRequest:
    """A Responses request; `history(id)` is a stored response's conversation (or raises NotFound); `strict`: an
    unknown field is a 400, not ignored."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    unknown_fields.check(body, PARAMS, strict, "responses")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required and must be a non-empty string", "model")
    for key in ("stream", "store", "background"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise _bad(f"'{key}' must be a boolean", key)
    for key in UNSUPPORTED:
        if body.get(key):
            raise _bad(f"'{key}' is not supported", key)
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise _bad("'previous_response_id' must be a string", "previous_response_id")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("'instructions' must be a string", "instructions")
    if body.get("input") is None:
        raise _bad("'input' is required", "input")
    earlier = history(previous) if previous else []
    known = {c["id"] for m in earlier for c in m.get("tool_calls") or []}
    turn = _messages(body["input"], known)
    conversation = earlier + turn
    tools, constraint = parse_tool_choice(body.get("tool_choice", "auto"), body.get("parallel_tool_calls", True),
                                          parse_tools(body.get("tools"), TOOLS), TOOLS)
    json_format, text_echo = _text_format(body)
    kwargs, reasoning_echo = _reasoning(body)
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None and (not is_number(max_tokens, integer=True) or not 1 <= max_tokens <= MAX_TOKENS_LIMIT):
        raise _bad(f"'max_output_tokens' must be an integer from 1 to {MAX_TOKENS_LIMIT}", "max_output_tokens")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    if not messages:
        raise _bad("'input' must not be empty", "input")
    submit = Submit(rid=new_id("resp"), max_tokens=max_tokens or 0, messages=messages, tools=tools,
                    constraint=constraint or json_format, template_kwargs=kwargs,
                    cache_mark=prompt_cache_marks(body, len(messages)),
                    temperature=_number(body, "temperature", 1.0, 2.0), top_p=_number(body, "top_p", 1.0, 1.0),
                    speculative=speculative(body))
    echo = {"instructions": instructions, "max_output_tokens": max_tokens, "previous_response_id": previous,
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "temperature": submit.temperature, "top_p": submit.top_p,
            "text": text_echo, "reasoning": reasoning_echo or {"effort": None, "summary": None},
            "metadata": metadata(body.get("metadata")), "store": body.get("store", True), "truncation": "disabled"}
    sampled = given(body, ("temperature", "top_p"))  # unset: the model's defaults (the echo says them once known)
    return ResponsesRequest(Parsed(model, submit, bool(body.get("stream")), False, sampling_given=sampled), turn,
                            body.get("store", True) is not False, previous, echo)

