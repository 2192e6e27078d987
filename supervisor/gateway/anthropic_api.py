"""Anthropic Messages request validation (`POST /v1/messages`, `/v1/messages/count_tokens`). Pure: no I/O.

parse_messages turns a body into a `Parsed` whose Submit is the same API-neutral one the chat API
builds (openai_api.py): messages in the chat template's shape (`tool_use` blocks become an assistant's
`tool_calls`, `tool_result` blocks `tool` messages, `thinking` blocks `reasoning_content`), tools as
{"name", "description", "parameters"}, tool_choice as a decoding constraint, thinking as the
template's `enable_thinking` (and `budget_tokens` as Submit.reasoning_budget, which the worker holds the
reasoning to). A final assistant message is a prefill: the template's `continue_final_message`, so the model
continues its text (and the response holds only the continuation); an empty one is no prefill and is dropped.
So a Messages request differs from a chat one only in shape.

Tolerant where Anthropic's own API is, because Claude Code and the SDKs evolve faster than this
server: top-level fields it has no use for (`metadata`, `service_tier`, betas' new fields) are ignored; a `system`
message inside `messages` is folded into the system prompt when it comes before the first turn and otherwise kept in
its place (the worker writes it as the model's template can: template_input.py); a content
block of a type it does not know is skipped with a logged warning. What matters is still refused with
Anthropic's error body (`anthropic_error_body`): a missing `max_tokens`, a bad role, a `tool_result`
whose `tool_use` no earlier assistant turn made, a document block, a `metadata` that is not
an object with an optional string `user_id`, an empty stop sequence, and a tool name (of a tool or a
`tool_use` block) outside Anthropic's `^[a-zA-Z0-9_-]{1,128}$`: names reach the chat template
unescaped, so that rule is what keeps template markup out of them. An `image` block (in a user turn or a
tool_result) becomes an image part (images.py), checked once the model is known.
`cache_control` breakpoints (on tools, system blocks, message content blocks, or top-level for the whole
prompt) become Submit.cache_mark: the prefix through each is kept ahead of others in the worker's hot cache for
its `ttl` ("5m" or "1h"); any other `type` or `ttl` is refused, as Anthropic refuses it.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from protocol.messages import Submit
from supervisor.errors import MlxsupError
from supervisor.gateway.images import base64_source, image_part, url_source
from supervisor.gateway.images import content as content_of
from supervisor.gateway.openai_api import MAX_STOP_LEN, MAX_TOKENS_LIMIT, Parsed, given, new_id, speculative, valid_name
from supervisor.gateway.tools import ToolDialect, parse_tools
from supervisor.units import is_number

log = logging.getLogger(__name__)

MAX_STOP_SEQUENCES = 16
TOOL_CHOICES = ("auto", "any", "tool", "none")
MEDIA_BLOCKS = ("document", "search_result")
IGNORED_BLOCKS = ("redacted_thinking",)
CACHE_TTLS = {"5m": 300.0, "1h": 3600.0}  # cache_control.ttl, in seconds
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")  # Anthropic's rule for tool names, by fullmatch
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}  # kept by Anthropic for its own models; nothing to give a local one

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                507: "overloaded_error"}


class AnthropicInvalid(MlxsupError):
    """A Messages request refused (400), with Anthropic's error type."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


def anthropic_error_body(exc: MlxsupError) -> dict:
    """`{"type": "error", "error": {"type", "message"}}` for any of the server's errors."""
    kind = _ERROR_TYPES.get(exc.status, "invalid_request_error" if 400 <= exc.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def _bad(message: str) -> AnthropicInvalid:
    return AnthropicInvalid(message)


def _tool_name(name: Any, where: str) -> str:
    if not valid_name(name, TOOL_NAME):
        raise _bad(f"{where}: String should match pattern '^[a-zA-Z0-9_-]{{1,128}}$'")
    return name


def _number(body: dict, key: str, lo: float, hi: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not is_number(value) or not lo <= value <= hi:
        raise _bad(f"{key}: must be a number from {lo} to {hi}, got {value!r}")
    return float(value)


def _integer(value: Any, where: str, lo: int, hi: int) -> int:
    if not is_number(value, integer=True) or not lo <= value <= hi:
        raise _bad(f"{where}: must be an integer from {lo} to {hi}, got {value!r}")
    return int(value)


def _blocks(content: Any, where: str) -> list[dict]:
    """Content as a list of blocks (a string is one text block); blocks of unknown types skipped."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}: must be a string or a list of content blocks")
    out = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _bad(f"{where}.{j}: a content block must be an object with a 'type'")
        kind = block["type"]
        if kind in MEDIA_BLOCKS:
            raise _bad(f"{where}.{j}: '{kind}' blocks are not supported (this server reads text and images)")
        if kind == "image":
            out.append(_image(block, f"{where}.{j}"))
            continue
        if kind in IGNORED_BLOCKS:
            continue
        if kind not in ("text", "tool_use", "tool_result", "thinking"):
            log.warning("[anthropic] skipped a content block of unknown type=%.40r at=%s.%d", kind, where, j)
            continue
        if kind == "text" and not isinstance(block.get("text"), str):
            raise _bad(f"{where}.{j}.text: must be a string")
        out.append(block)
    return out


def _image(block: dict, where: str) -> dict:
    source = block.get("source")
    source = source if isinstance(source, dict) else {}
    kind = source.get("type")
    if kind == "base64":
        return image_part(base64_source(source.get("media_type"), source.get("data"), f"{where}.source"))
    if kind == "url":
        return image_part(url_source(source.get("url"), f"{where}.source.url"))
    raise _bad(f"{where}.source: must be {{'type': 'base64', 'media_type', 'data'}} or {{'type': 'url', 'url'}}")


def _parts(content: Any, where: str) -> list[dict]:
    """Content's text and image parts, in order."""
    return [b if b["type"] == "image" else {"type": "text", "text": b["text"]}
            for b in _blocks(content, where) if b["type"] in ("text", "image")]


def _text_of(content: Any, where: str) -> str:
    parts = _parts(content, where)
    if any(p["type"] == "image" for p in parts):
        raise _bad(f"{where}: an image belongs in a user turn or a tool_result")
    return "".join(p["text"] for p in parts)


def _tool_result(block: dict, where: str, known_calls: set[str]) -> dict:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or call_id not in known_calls:
        raise _bad(f"{where}: tool_result block(s) provided for tool_use id {call_id!r}, which no earlier "
                   "assistant turn's tool_use block has")
    content = block.get("content", "")
    parts = [] if content is None else _parts(content, f"{where}.content")
    if block.get("is_error"):
        parts.insert(0, {"type": "text", "text": "Error: "})
    return {"role": "tool", "tool_call_id": call_id, "content": content_of(parts)}


def _assistant(blocks: list[dict], where: str, known_calls: set[str]) -> dict:
    text, reasoning, calls = [], [], []
    for j, block in enumerate(blocks):
        if block["type"] == "text":
            text.append(block["text"])
        elif block["type"] == "thinking":
            if isinstance(block.get("thinking"), str):
                reasoning.append(block["thinking"])
        elif block["type"] == "tool_use":
            call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, dict):
                raise _bad(f"{where}.{j}: a tool_use block needs a string 'id' and 'name' and an object 'input'")
            _tool_name(name, f"{where}.{j}.name")
            known_calls.add(call_id)
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        else:
            raise _bad(f"{where}.{j}: an assistant turn cannot hold a '{block['type']}' block")
    out: dict = {"role": "assistant", "content": "".join(text)}
    if calls:
        out["tool_calls"] = calls
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    return out


def _user(blocks: list[dict], where: str, known_calls: set[str]) -> list[dict]:
    """A user turn: its tool results as `tool` messages (in order), then its text and images as one user message."""
    out, parts = [], []
    for j, block in enumerate(blocks):
        if block["type"] == "tool_result":
            out.append(_tool_result(block, f"{where}.{j}", known_calls))
        elif block["type"] == "text":
            parts.append({"type": "text", "text": block["text"]})
        elif block["type"] == "image":
            parts.append(block)
        else:
            raise _bad(f"{where}.{j}: a user turn cannot hold a '{block['type']}' block")
    if parts or not out:
        out.append({"role": "user", "content": content_of(parts)})
    return out


def _conversation(body: dict) -> list[dict]:
    """The chat template's messages: the system prompt first (with the system messages that come before the first
    turn folded in; a later one stays in its place, so a session's prompt only grows: moved to the top, it would
    change the prompt's head every time an agent adds one, and cost a re-prefill of the whole conversation)."""
    system = body.get("system")
    parts = [] if system is None else [_text_of(system, "system")]
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages: must be a non-empty list")
    out: list[dict] = []
    known_calls: set[str] = set()
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise _bad(f"{where}: must be an object with 'role' and 'content'")
        role = m.get("role")
        if role == "system":  # not in Anthropic's reference, but Claude Code sends it
            text = _text_of(m.get("content", ""), f"{where}.content")
            if out:  # inside the conversation: where it stands (the worker writes it as the template can)
                out.append({"role": "system", "content": text})
            else:  # before it: part of the system prompt
                parts.append(text)
            continue
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role: must be 'user' or 'assistant', got {role!r}")
        if "content" not in m:
            raise _bad(f"{where}.content: Field required")
        blocks = _blocks(m["content"], f"{where}.content")
        if role == "assistant":
            out.append(_assistant(blocks, f"{where}.content", known_calls))
        else:
            out.extend(_user(blocks, f"{where}.content", known_calls))
    system_text = "\n\n".join(p for p in parts if p)
    return ([{"role": "system", "content": system_text}] if system_text else []) + out


def _ttl(block: Any, where: str) -> float | None:
    """The ttl in seconds of a block's `cache_control` breakpoint; None: it has none."""
    control = block.get("cache_control") if isinstance(block, dict) else None
    if control is None:
        return None
    if not isinstance(control, dict) or control.get("type") != "ephemeral" \
            or control.get("ttl", "5m") not in CACHE_TTLS:
        raise _bad(f"{where}cache_control: must be {{'type': 'ephemeral'}} with an optional ttl of '5m' or '1h'")
    return CACHE_TTLS[control.get("ttl", "5m")]


def _cache_marks(body: dict, messages: list[dict]) -> list[list]:
    """The breakpoints as Submit.cache_mark: [[template messages through it, ttl_s], ...]. One on the tools or the
    system prompt covers the system message; one in a message, the template messages made through that one."""
    marks = []
    head = 1 if messages and messages[0]["role"] == "system" else 0
    for key in ("tools", "system"):
        blocks = body.get(key)
        for j, block in enumerate(blocks if isinstance(blocks, list) else []):
            if (ttl := _ttl(block, f"{key}.{j}.")) is not None:
                marks.append([head, ttl])
    for i, m in enumerate(body["messages"]):
        content = m.get("content")
        ttls = [t for j, b in enumerate(content if isinstance(content, list) else [])
                if (t := _ttl(b, f"messages.{i}.content.{j}.")) is not None]
        if ttls:
            marks.append([len(_conversation({**body, "messages": body["messages"][:i + 1]})), max(ttls)])
    if (ttl := _ttl(body, "")) is not None:  # top-level: Anthropic puts it on the last block
        marks.append([len(messages), ttl])
    return marks


def _branch_points(body: dict, messages: list[dict]) -> list[list[int]]:
    """Submit.branch_points: where the first user message's text blocks but the last end, in its joined text (Claude
    Code opens a session with system-reminder blocks, the same for every session in a project, then the task)."""
    first = next((m for m in body["messages"] if isinstance(m, dict) and m.get("role") == "user"), None)
    at = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    blocks = first.get("content") if first is not None else None
    if at is None or not isinstance(blocks, list) or not isinstance(messages[at]["content"], str) \
            or any(not isinstance(b, dict) or b.get("type") != "text" for b in blocks):
        return []  # one block, or tool results or images in it: nothing to branch at
    ends, chars = [], 0
    for b in blocks[:-1]:
        chars += len(b.get("text") or "")
        ends.append([at, chars])
    return ends


TOOLS = ToolDialect(
    api="anthropic", path="tools.{j}", function=lambda tool: tool, at="", schema="input_schema", default_schema=None,
    check_name=_tool_name, bad=lambda message, param: _bad(message),
    said={"list": "tools: must be a list", "object": "{where}: must be an object", "name": "{where}: Field required",
          "schema": "{where}: must be a JSON schema object"},
    skips=lambda tool: tool.get("type") not in (None, "custom"), runs_here="custom")  # not server tools (web_search...)


def _tool_choice(body: dict, tools: list[dict] | None) -> tuple[list[dict] | None, dict | None]:
    choice = body.get("tool_choice")
    if choice is None:
        return tools, None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in TOOL_CHOICES:
        raise _bad(f"tool_choice.type: must be one of {', '.join(TOOL_CHOICES)}")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind == "auto":
        return tools, None
    if kind == "none":
        return None, None
    if not tools:
        raise _bad(f"tool_choice: type '{kind}' needs 'tools'")
    names = [t["name"] for t in tools]
    if kind == "any":
        return tools, {"type": "tool", "names": names, "parallel": parallel}
    name = choice.get("name")
    if name not in names:
        raise _bad(f"tool_choice.name: {str(name)[:128]!r} is not one of the tools ({', '.join(names)[:1000]})")
    return tools, {"type": "tool", "names": [name], "parallel": False}


def _thinking(body: dict, max_tokens: int) -> tuple[dict, int | None]:
    """`thinking` as the chat template's switch and the reasoning budget; absent, the model's own default."""
    thinking = body.get("thinking")
    if thinking is None:
        return {}, None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        return {"enable_thinking": False}, None
    if kind in ("adaptive", "between_tools"):
        return {"enable_thinking": True}, None
    if kind != "enabled":
        raise _bad("thinking.type: must be 'enabled', 'adaptive', 'between_tools' or 'disabled'")
    budget = _integer(thinking.get("budget_tokens"), "thinking.budget_tokens", 1, MAX_TOKENS_LIMIT)
    if budget >= max_tokens:
        raise _bad("`max_tokens` must be greater than `thinking.budget_tokens`")
    return {"enable_thinking": True}, budget


def _prefill(messages: list[dict]) -> bool:
    """Whether the conversation ends in a prefill (a final assistant message with text and no calls) to continue;
    an empty final assistant message is dropped (no prefill). Anthropic's rule on its trailing whitespace holds."""
    last = messages[-1]
    if last["role"] != "assistant" or last.get("tool_calls"):
        return False
    if not last["content"] and not last.get("reasoning_content"):
        if len(messages) > 1:
            messages.pop()
        return False
    if last["content"] != last["content"].rstrip():
        raise _bad("messages: final assistant content cannot end with trailing whitespace")
    return bool(last["content"])


def _output_config(body: dict) -> tuple[dict | None, dict]:
    """`output_config`: a JSON-schema answer (`format`) as a decoding constraint, `effort` as reasoning_effort."""
    config = body.get("output_config")
    if config is None:
        return None, {}
    if not isinstance(config, dict):
        raise _bad("output_config: must be an object")
    kwargs = {}
    effort = config.get("effort")
    if effort is not None:
        if not isinstance(effort, str) or effort not in EFFORTS:
            raise _bad(f"output_config.effort: must be one of {', '.join(EFFORTS)}")
        kwargs["reasoning_effort"] = EFFORTS[effort]
    fmt = config.get("format")
    if fmt is None:
        return None, kwargs
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _bad("output_config.format: must be {'type': 'json_schema', 'schema': {...}}")
    return {"type": "json", "schema": fmt["schema"]}, kwargs


def _stop_sequences(body: dict) -> list[str]:
    stops = body.get("stop_sequences")
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop_sequences: must be a list of strings")
    if len(stops) > MAX_STOP_SEQUENCES or any(len(s) > MAX_STOP_LEN for s in stops):
        raise _bad(f"stop_sequences: at most {MAX_STOP_SEQUENCES}, each at most {MAX_STOP_LEN} characters")
    if "" in stops:
        raise _bad("stop_sequences: each stop sequence must be a non-empty string")
    return [s for s in stops if s.strip()]


def _check_metadata(body: dict) -> None:
    """`metadata`, which Anthropic defines as an object with an optional `user_id` (a string, at most 256)."""
    value = body.get("metadata")
    if value is None:
        return
    if not isinstance(value, dict):
        raise _bad("metadata: Input should be an object")
    user_id = value.get("user_id")
    if user_id is not None and (not isinstance(user_id, str) or len(user_id) > 256):
        raise _bad("metadata.user_id: must be a string of at most 256 characters")


def _model(body: Any) -> str:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model: Field required")
    return model


def parse_messages(body: Any, counting: bool = False) -> Parsed:
    """A Messages request as a Submit; `counting` (count_tokens) needs no max_tokens and never streams."""
    model = _model(body)
    if counting:
        max_tokens = 1  # count_tokens only encodes the prompt (a Tokenize, see agent_routes.py)
    elif "max_tokens" not in body:
        raise _bad("max_tokens: Field required")
    else:
        max_tokens = _integer(body["max_tokens"], "max_tokens", 1, MAX_TOKENS_LIMIT)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream: must be a boolean")
    _check_metadata(body)
    messages = _conversation(body)
    tools, constraint = _tool_choice(body, parse_tools(body.get("tools"), TOOLS))
    json_format, kwargs = _output_config(body)
    constraint = constraint or json_format
    thinking, budget = _thinking(body, MAX_TOKENS_LIMIT + 1 if counting else max_tokens)  # it shapes the prompt too
    kwargs.update(thinking)
    if _prefill(messages):
        kwargs["continue_final_message"] = True
    temperature = _number(body, "temperature", 0.0, 1.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    top_k = body.get("top_k")
    submit = Submit(rid=new_id("msg"), max_tokens=max_tokens, messages=messages, stop=_stop_sequences(body),
                    tools=tools, constraint=None if counting else constraint, template_kwargs=kwargs,
                    temperature=1.0 if temperature is None else temperature, top_p=1.0 if top_p is None else top_p,
                    top_k=0 if top_k is None else _integer(top_k, "top_k", 0, MAX_TOKENS_LIMIT),
                    reasoning_budget=budget, cache_mark=_cache_marks(body, messages),
                    branch_points=_branch_points(body, messages), speculative=speculative(body))
    return Parsed(model, submit, stream and not counting, False,
                  sampling_given=given(body, ("temperature", "top_p", "top_k")))  # unset: the model's defaults
