"""Ollama's request bodies as the same API-neutral request the other APIs build (openai_api.Parsed, one
protocol Submit). Pure: no I/O.

`parse_chat` (`POST /api/chat`) and `parse_generate` (`POST /api/generate`) map Ollama's fields onto the Submit:
`messages` (with `images` as base64 image parts, checked by images.attach once the model is known; an assistant's
`tool_calls` with their arguments as objects and its `thinking`; a `tool` message's `tool_name`), `tools` (OpenAI's
shape, openai_api.TOOLS), `format` ("json" or a JSON schema: the decoding constraint the other APIs use), `think`
(true/false: the template's enable_thinking; "low"/"medium"/"high": its reasoning_effort), `system` and `raw`
(generate: `raw` sends the prompt as it is, else the prompt is a user turn under the chat template, as Ollama
applies the model's template), and `options` (num_predict, temperature, top_k, top_p, min_p, stop, seed,
repeat_penalty, presence_penalty, frequency_penalty; num_ctx and the llama.cpp-only options are accepted and
have no effect here: the worker's context is the model's). `keep_alive` is parsed to seconds (`keep_alive`).
As Ollama's own server does, a field it does not know is ignored; a known field of the wrong type or value is a
400. `stream` defaults to true, as in Ollama.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from protocol.messages import Submit
from supervisor.errors import InvalidRequest
from supervisor.gateway.images import content as content_of
from supervisor.gateway.images import image_part
from supervisor.gateway.openai_api import (
    MAX_STOP_LEN,
    MAX_TOKENS_LIMIT,
    NAME,
    SAMPLING,
    TOOLS,
    Parsed,
    new_id,
    valid_name,
)
from supervisor.gateway.openai_api import _sampling as sampling_fields
from supervisor.gateway.tools import parse_tools
from supervisor.units import is_number

ROLES = ("system", "user", "assistant", "tool")
MAX_STOP = 16  # Anthropic's limit, which the worker holds too; Ollama's clients send more than OpenAI's 4
THINK_LEVELS = ("low", "medium", "high")
# options -> the openai parser's names for the same sampling fields (so both are checked by one rule)
OPTION_NAMES = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "seed": "seed",
                "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                "frequency_penalty": "frequency_penalty", "speculative": "speculative"}
_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
MAX_KEEP_ALIVE_S = 10 * 365 * 86400  # past ten years a duration is "for ever" (the negative values' meaning)


@dataclass
class OllamaRequest:
    parsed: Parsed | None  # None: nothing to generate (an empty prompt or messages: load, or unload, the model)
    model: str  # the name as asked (the responses echo it)
    keep_alive: float | None  # seconds; < 0: kept loaded; None: unset (the server's TTL)
    think: bool | str | None = None  # as asked, for the capability check


def bad(message: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=param)


def keep_alive(value: Any) -> float | None:
    """Ollama's keep_alive: a number of seconds, or a Go duration string ("5m", "1h30m", "-1", "0"); None: unset."""
    if value is None:
        return None
    if is_number(value):
        seconds = float(value)
    elif isinstance(value, str) and value.strip():
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        text = text.lstrip("+-")
        try:
            seconds = sign * float(text)  # a bare number is seconds, as Ollama reads it
        except ValueError:
            parts = _DURATION.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise bad(f"keep_alive: {value[:40]!r} is no duration (e.g. \"5m\", \"1h\", \"30s\", \"-1\", \"0\")",
                          "keep_alive") from None
            seconds = sign * sum(float(n) * _UNITS[u] for n, u in parts)
    else:
        raise bad("keep_alive must be a number of seconds or a duration string such as \"5m\"", "keep_alive")
    if seconds != seconds or abs(seconds) > MAX_KEEP_ALIVE_S:  # NaN, or past any TTL: for ever
        return -1.0
    return seconds


def _model(body: Any) -> str:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model", body.get("name"))
    if not isinstance(model, str) or not model:
        raise bad("model is required", "model")
    return model


def _stream(body: dict) -> bool:
    stream = body.get("stream")
    if stream is None:
        return True
    if not isinstance(stream, bool):
        raise bad("stream must be a boolean", "stream")
    return stream


def _options(body: dict) -> tuple[dict, int, list[str], frozenset[str]]:
    """(the Submit's sampling fields, max_tokens, stop, the sampling fields set)."""
    options = body.get("options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise bad("options must be an object", "options")
    mapped = {OPTION_NAMES[k]: v for k, v in options.items() if k in OPTION_NAMES and v is not None}
    sampling = sampling_fields(mapped)
    given = frozenset(k for k in SAMPLING if k in mapped)
    predict = options.get("num_predict")
    if predict is None or predict in (-1, -2):  # -1: no limit, -2: the context's: up to the context here
        max_tokens = 0
    elif is_number(predict, integer=True) and 0 <= predict <= MAX_TOKENS_LIMIT:
        max_tokens = predict or 0
    else:
        raise bad(f"options.num_predict must be an integer from -2 to {MAX_TOKENS_LIMIT}", "options.num_predict")
    num_ctx = options.get("num_ctx")
    if num_ctx is not None and (not is_number(num_ctx, integer=True) or num_ctx < 0):
        raise bad("options.num_ctx must be a non-negative integer", "options.num_ctx")
    stop = options.get("stop")
    if stop is None:
        stop = []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("options.stop must be a list of strings", "options.stop")
    if len(stop) > MAX_STOP or any(len(s) > MAX_STOP_LEN for s in stop):
        raise bad(f"options.stop may hold at most {MAX_STOP} sequences of at most {MAX_STOP_LEN} characters",
                  "options.stop")
    return sampling, max_tokens, [s for s in stop if s], given


def _format(fmt: Any) -> dict | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json", "schema": None}
    if isinstance(fmt, dict):
        return {"type": "json", "schema": fmt}
    raise bad('format must be "json" or a JSON schema object', "format")


def _think(value: Any) -> tuple[bool | str | None, dict]:
    """`think` as asked and as template arguments."""
    if value is None:
        return None, {}
    if isinstance(value, bool):
        return value, {"enable_thinking": value}
    if isinstance(value, str) and value in THINK_LEVELS:
        return value, {"enable_thinking": True, "reasoning_effort": value}
    raise bad('think must be true, false, "low", "medium" or "high"', "think")


def _images(images: Any, where: str) -> list[dict]:
    """Ollama's images: base64 strings (no media type: it is read from the bytes, images.check)."""
    if images is None:
        return []
    if not isinstance(images, list):
        raise bad(f"{where} must be a list of base64-encoded images", where)
    parts = []
    for j, image in enumerate(images):
        if not isinstance(image, str) or not image:
            raise bad(f"{where}[{j}] must be a base64-encoded image", f"{where}[{j}]")
        if image.startswith("data:"):  # a data URL, as some clients send it
            image = image.partition(",")[2]
        parts.append(image_part({"data": image, "where": f"{where}[{j}]"}))
    return parts


def _tool_calls(calls: Any, where: str, start: int) -> list[dict]:
    if not isinstance(calls, list):
        raise bad(f"{where} must be a list", where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not valid_name(fn.get("name")):
            raise bad(f"{where}[{j}].function.name must match '^[a-zA-Z0-9_-]{{1,64}}$'", f"{where}[{j}]")
        args = fn.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise bad(f"{where}[{j}].function.arguments must be an object", f"{where}[{j}]") from None
        if not isinstance(args, dict):
            raise bad(f"{where}[{j}].function.arguments must be an object", f"{where}[{j}]")
        out.append({"id": f"call_{start + j}", "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list):
        raise bad("messages must be a list", "messages")
    out: list[dict] = []
    calls = 0  # calls made so far: a tool message answers the oldest one not yet answered
    answered = 0
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", where)
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}", f"{where}.role")
        text = m.get("content")
        if text is None:
            text = ""
        if not isinstance(text, str):
            raise bad(f"{where}.content must be a string", f"{where}.content")
        images = _images(m.get("images"), f"{where}.images")
        if images and role != "user":
            raise bad(f"{where}.images: only a user message's images are read", f"{where}.images")
        msg: dict = {"role": role,
                     "content": content_of([*images, {"type": "text", "text": text}]) if images else text}
        if role == "assistant":
            if m.get("tool_calls"):
                msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls", calls)
                calls += len(msg["tool_calls"])
            thinking = m.get("thinking")
            if thinking is not None and not isinstance(thinking, str):
                raise bad(f"{where}.thinking must be a string", f"{where}.thinking")
            if thinking:
                msg["reasoning_content"] = thinking
        if role == "tool":
            name = m.get("tool_name", m.get("name"))
            if name is not None:
                if not valid_name(name, NAME):
                    raise bad(f"{where}.tool_name must match '^[a-zA-Z0-9_-]{{1,64}}$'", f"{where}.tool_name")
                msg["name"] = name
            if answered < calls:
                msg["tool_call_id"] = f"call_{answered}"
                answered += 1
        out.append(msg)
    return out


def _logprobs(body: dict) -> int:
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise bad("logprobs must be a boolean", "logprobs")
    if top is not None and (not is_number(top, integer=True) or not 0 <= top <= 20):
        raise bad("top_logprobs must be an integer from 0 to 20", "top_logprobs")
    return (top or 0) if wanted else -1


def _request(body: dict, submit_fields: dict, model: str) -> tuple[Parsed, bool | str | None]:
    sampling, max_tokens, stop, given = _options(body)
    think, kwargs = _think(body.get("think"))
    submit = Submit(rid=new_id("ollama"), max_tokens=max_tokens, stop=stop, template_kwargs=kwargs,
                    constraint=_format(body.get("format")), logprobs=_logprobs(body), **submit_fields, **sampling)
    return Parsed(model, submit, _stream(body), False, sampling_given=given, logprobs=submit.logprobs >= 0), think


def parse_chat(body: Any) -> OllamaRequest:
    model = _model(body)
    messages = _messages(body.get("messages") or [])
    tools = parse_tools(body.get("tools"), TOOLS) if body.get("tools") else None
    alive = keep_alive(body.get("keep_alive"))
    if not messages:
        _stream(body)
        return OllamaRequest(None, model, alive)
    parsed, think = _request(body, {"messages": messages, "tools": tools}, model)
    return OllamaRequest(parsed, model, alive, think)


def parse_generate(body: Any) -> OllamaRequest:
    model = _model(body)
    prompt, system, raw, suffix = (body.get(k) for k in ("prompt", "system", "raw", "suffix"))
    for key, value in (("prompt", prompt), ("system", system), ("suffix", suffix)):
        if value is not None and not isinstance(value, str):
            raise bad(f"{key} must be a string", key)
    if raw is not None and not isinstance(raw, bool):
        raise bad("raw must be a boolean", "raw")
    if body.get("template") not in (None, ""):
        raise bad("template: a Go template is Ollama's own; mlxsup applies the model's chat template (or send "
                  "raw: true with the prompt as the model should read it)", "template")
    images = _images(body.get("images"), "images")
    alive = keep_alive(body.get("keep_alive"))
    if not prompt and not images:
        _stream(body)
        return OllamaRequest(None, model, alive)
    if suffix:
        raise bad("suffix: this model does not support insert (fill-in-the-middle)", "suffix")
    if raw:
        if images:
            raise bad("images need the chat template: send raw: false", "images")
        parsed, think = _request(body, {"prompt": prompt}, model)
        return OllamaRequest(parsed, model, alive, think)
    turns = [{"role": "system", "content": system}] if system else []
    text = prompt or ""
    turns.append({"role": "user", "content": content_of([*images, {"type": "text", "text": text}]) if images
                  else text})
    parsed, think = _request(body, {"messages": turns}, model)
    return OllamaRequest(parsed, model, alive, think)


# --- embeddings --------------------------------------------------------------------------------


@dataclass
class EmbedRequest:
    model: str
    inputs: list[str]
    truncate: int | None  # Embed.truncate: 0 cuts an input to the window, None refuses one over it
    dimensions: int | None
    keep_alive: float | None
    old: bool  # /api/embeddings: one `prompt`, answered as {"embedding": [...]}


def parse_embed(body: Any, old: bool = False) -> EmbedRequest:
    model = _model(body)
    value = body.get("prompt") if old else body.get("input")
    if isinstance(value, str):
        inputs = [value]
    elif not old and isinstance(value, list) and all(isinstance(v, str) for v in value):
        inputs = list(value)
    else:
        raise bad("prompt must be a string" if old else "input must be a string or a list of strings",
                  "prompt" if old else "input")
    if not old and (not inputs or any(not s for s in inputs)):
        raise bad("input must hold at least one non-empty string", "input")
    if len(inputs) > 2048:
        raise bad("input may hold at most 2048 strings", "input")
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise bad("truncate must be a boolean", "truncate")
    dims = body.get("dimensions")
    if dims is not None and (not is_number(dims, integer=True) or not 1 <= dims <= 2**31 - 1):
        raise bad("dimensions must be a positive integer", "dimensions")
    options = body.get("options")
    if options is not None and not isinstance(options, dict):
        raise bad("options must be an object", "options")
    return EmbedRequest(model, inputs, 0 if truncate else None, dims, keep_alive(body.get("keep_alive")), old)
