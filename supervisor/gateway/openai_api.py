"""OpenAI-compatible request validation and response shapes. Pure: no I/O, no state.

parse_chat / parse_completion turn a JSON body into a `Parsed` (the protocol Submit plus the
HTTP-side options) or raise InvalidRequest naming the offending parameter. Unknown parameters
are rejected, like OpenAI's API does, so a client never silently loses an option it relies on.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from protocol.messages import Finished, Submit
from supervisor.errors import InvalidRequest
from supervisor.units import is_number

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4
MAX_STOP_LEN = 256
MAX_TOKENS_LIMIT = 1_000_000

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stream", "stream_options",
           "n", "user", "seed", "ignore_eos", "presence_penalty", "frequency_penalty"}
CHAT_PARAMS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                         "response_format", "parallel_tool_calls", "metadata", "store"}
COMPLETION_PARAMS = _COMMON | {"prompt", "echo", "best_of", "logprobs", "suffix"}


@dataclass
class Parsed:
    model: str
    submit: Submit
    stream: bool
    include_usage: bool


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not is_number(value):
        raise InvalidRequest(f"'{key}' must be a number", param=key)
    if not lo <= value <= hi:
        raise InvalidRequest(f"'{key}' must be between {lo} and {hi}, got {value}", param=key)
    return float(value)


def _integer(body: dict, key: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if not is_number(value, integer=True):
        raise InvalidRequest(f"'{key}' must be an integer", param=key)
    if not lo <= value <= hi:
        raise InvalidRequest(f"'{key}' must be between {lo} and {hi}, got {value}", param=key)
    return value


def _common(body: Any, allowed: set[str]) -> tuple[str, bool, bool, list[str]]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InvalidRequest(f"unrecognized request argument(s): {', '.join(unknown)}", param=unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a non-empty string", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise InvalidRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise InvalidRequest("'stream_options' must be an object with a boolean 'include_usage'",
                                 param="stream_options")
        include_usage = options.get("include_usage", False)
    if body.get("n", 1) not in (1, None):
        raise InvalidRequest("only n=1 is supported", param="n")
    for key in ("presence_penalty", "frequency_penalty"):
        if _number(body, key, 0.0, -2.0, 2.0) != 0.0:
            raise InvalidRequest(f"'{key}' is not supported", param=key)
    if body.get("seed") is not None and not is_number(body["seed"], integer=True):
        raise InvalidRequest("'seed' must be an integer", param="seed")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise InvalidRequest("'user' must be a string", param="user")
    return model, bool(stream), include_usage, _stop(body.get("stop"))


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise InvalidRequest("'stop' must be a string or a list of strings", param="stop")
    if len(stop) > MAX_STOP:
        raise InvalidRequest(f"'stop' may hold at most {MAX_STOP} sequences", param="stop")
    if any(len(s) > MAX_STOP_LEN for s in stop):
        raise InvalidRequest(f"each stop sequence may be at most {MAX_STOP_LEN} characters", param="stop")
    return [s for s in stop if s]


def _sampling(body: dict) -> dict:
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise InvalidRequest("'ignore_eos' must be a boolean", param="ignore_eos")
    return {
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0),
        "top_k": _integer(body, "top_k", 0, 0, MAX_TOKENS_LIMIT),
        "min_p": _number(body, "min_p", 0.0, 0.0, 1.0),
        "ignore_eos": ignore_eos,
    }


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"messages[{i}].content: only text parts are supported",
                                     param=f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts",
                         param=f"messages[{i}].content")


def parse_chat(body: Any) -> Parsed:
    model, stream, include_usage, stop = _common(body, CHAT_PARAMS)
    for key in ("tools", "tool_choice"):
        if body.get(key):
            raise InvalidRequest(f"'{key}' is not supported", param=key)
    if body.get("logprobs") or body.get("top_logprobs"):
        raise InvalidRequest("'logprobs' is not supported", param="logprobs")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise InvalidRequest("only response_format {'type': 'text'} is supported", param="response_format")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object", param=f"messages[{i}]")
        if m.get("role") not in ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}", param=f"messages[{i}].role")
        clean.append({"role": m["role"], "content": _content(m, i)})
    max_tokens = _integer(body, "max_completion_tokens", None, 1, MAX_TOKENS_LIMIT)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 0, 1, MAX_TOKENS_LIMIT) or 0  # 0: up to the context
    submit = Submit(rid=new_id("chatcmpl"), max_tokens=max_tokens, messages=clean, stop=stop, **_sampling(body))
    return Parsed(model, submit, stream, include_usage)


def parse_completion(body: Any) -> Parsed:
    model, stream, include_usage, stop = _common(body, COMPLETION_PARAMS)
    for key in ("echo", "logprobs", "suffix"):
        if body.get(key):
            raise InvalidRequest(f"'{key}' is not supported", param=key)
    if body.get("best_of", 1) not in (1, None):
        raise InvalidRequest("only best_of=1 is supported", param="best_of")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidRequest("'prompt' must be a string (batched and token prompts are not supported)",
                             param="prompt")
    if not prompt:
        raise InvalidRequest("'prompt' must not be empty", param="prompt")
    max_tokens = _integer(body, "max_tokens", 16, 1, MAX_TOKENS_LIMIT) or 16
    submit = Submit(rid=new_id("cmpl"), max_tokens=max_tokens, prompt=prompt, stop=stop, **_sampling(body))
    return Parsed(model, submit, stream, include_usage)


# --- responses ----------------------------------------------------------------------------


def usage(fin: Finished) -> dict:
    return {
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": fin.completion_tokens,
        "total_tokens": fin.prompt_tokens + fin.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": fin.cached_tokens},
    }


class Shaper:
    """Builds the response objects of one request, chat or completion, streamed or whole."""

    def __init__(self, parsed: Parsed, model: str) -> None:
        self.chat = parsed.submit.messages is not None
        self.id = parsed.submit.rid
        self.model = model
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False) -> dict:
        if self.chat:
            delta: dict = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, fin: Finished) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage(fin)}

    def whole(self, text: str, fin: Finished) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": fin.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": fin.finish_reason}
        return {**self._envelope(self.object, [choice]), "usage": usage(fin)}
