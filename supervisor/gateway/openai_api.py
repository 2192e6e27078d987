"""OpenAI-compatible request validation. Pure: no I/O, no state.

parse_chat / parse_completion turn a JSON body into a `Parsed` (one protocol Submit per choice
plus the HTTP-side options) or raise InvalidRequest naming the offending parameter. Every field
OpenAI's API takes is accepted: used where it means something here, else (IGNORED) dropped, so its
clients work unchanged; an unknown field is dropped with a warning, or refused with `strict`
(unknown_fields.py). Wrong types and values of the fields used are refused. A `prompt_cache_key` keeps its
prompt cached with priority for a while, as an Anthropic `cache_control` breakpoint does (`prompt_cache_marks`). The Submit is API-neutral: tools as
{"name", "description", "parameters"}, tool_choice and response_format as a decoding
`constraint`; the response shapes live in openai_shape.py. A user message's `image_url` parts become image parts
(images.py), checked by the route once the model is known.

What reaches the chat template as text it does not escape is held to the vendors' own rules, so a
client cannot write template markup through it: function and message names match NAME
(`^[a-zA-Z0-9_-]{1,64}$`, OpenAI's); logit_bias keys are decimal ASCII token ids within int32.
Seeds are int64 values, each its own random stream (never wrapped onto another's); a request asks
for at most MAX_SEQUENCES sequences in all (prompts x n).
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from protocol.messages import Submit
from supervisor.errors import InvalidRequest
from supervisor.gateway import unknown_fields
from supervisor.gateway.images import content as content_of
from supervisor.gateway.images import image_part, url_source
from supervisor.gateway.tools import ToolDialect, parse_tool_choice, parse_tools
from supervisor.units import is_number

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4
MAX_STOP_LEN = 256
MAX_TOKENS_LIMIT = 1_000_000
MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_PROMPTS = 64
MAX_SEQUENCES = MAX_PROMPTS  # prompts x n of one request: each a sequence in the worker's batch
MAX_TOKEN_ID = 2**31 - 1
SEED_RANGE = (-(2**63), 2**63 - 1)  # int64; mapped one-to-one onto the worker's uint64 seeds
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # function and message names (OpenAI's rule), by fullmatch
_TOKEN_ID = re.compile(r"[0-9]{1,10}")  # ASCII digits only: str.isdigit() also takes "²" and "٣"

# Accepted and ignored: OpenAI fields with no meaning for a local server, which clients (the openai SDK's
# defaults, LangChain, litellm, openai-agents) send anyway. Refusing them breaks those clients.
IGNORED = {"user", "store", "metadata", "service_tier", "safety_identifier", "verbosity", "modalities", "prediction",
           "web_search_options", "audio"}
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # unset: the model's defaults
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stream", "stream_options",
           "n", "seed", "ignore_eos", "speculative", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "logit_bias", "logprobs"} | IGNORED
CHAT_PARAMS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                         "function_call", "response_format", "parallel_tool_calls", "chat_template_kwargs",
                         "reasoning_effort", "prompt_cache_key", "prompt_cache_retention"}
COMPLETION_PARAMS = _COMMON | {"prompt", "echo", "best_of", "suffix",
                                "prompt_cache_key", "prompt_cache_retention"}  # ignored here: clients send them
REASONING_EFFORTS = ("minimal", "low", "medium", "high")
MAX_CACHE_KEY = 1024  # characters of a prompt_cache_key
# how long a prompt_cache_key keeps its prefix, in seconds: OpenAI's in-memory retention (5-10 minutes) as
# Anthropic's default ttl, and its "24h" capped at Anthropic's longest (a local cache's memory is the user's)
CACHE_RETENTIONS = {"in_memory": 300.0, "in-memory": 300.0, "24h": 3600.0}  # "in-memory": older SDKs' spelling


@dataclass
class Parsed:
    model: str
    submit: Submit  # the first choice's; `choices` holds one per choice (n, prompts)
    stream: bool
    include_usage: bool
    choices: list[Submit] = field(default_factory=list)
    logprobs: bool = False
    n: int = 1  # choices per prompt
    # the sampling fields (SAMPLING) the body set; the rest take the model's defaults once it is known
    # (gateway/sampling.py fills them into every choice and keeps what applies, with its sources, in `sampling`)
    sampling_given: frozenset[str] = frozenset()
    sampling: dict[str, dict] | None = None

    def __post_init__(self) -> None:
        if not self.choices:
            self.choices = [self.submit]


def given(body: dict, keys: tuple[str, ...]) -> frozenset[str]:
    """The keys of `body` that it sets (null is unset, as the parsers read it)."""
    return frozenset(k for k in keys if body.get(k) is not None)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def valid_name(name: Any, rule: re.Pattern[str] = NAME) -> bool:
    """A function or participant name by `rule`: ASCII letters, digits, `_` and `-` only, so it cannot
    hold a chat template's special tokens (`<|end|>`), quotes or newlines."""
    return isinstance(name, str) and rule.fullmatch(name) is not None


def _name(name: Any, where: str) -> str:
    if not valid_name(name):
        raise InvalidRequest(f"'{where}' must match the pattern '^[a-zA-Z0-9_-]{{1,64}}$' (letters, digits, "
                             "underscores and dashes, at most 64)", param=where)
    return name


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


def _common(body: Any, allowed: set[str], strict: bool, api: str) -> tuple[str, bool, bool, list[str]]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    unknown_fields.check(body, allowed, strict, api)
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


def _logit_bias(value: Any) -> list | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest("'logit_bias' must be an object mapping token ids to biases", param="logit_bias")
    pairs = []
    for key, bias in value.items():
        token_id = int(key) if _TOKEN_ID.fullmatch(key) else MAX_TOKEN_ID + 1
        if token_id > MAX_TOKEN_ID or not is_number(bias) or not -100 <= bias <= 100:
            raise InvalidRequest(f"'logit_bias' maps token ids (decimal strings from 0 to {MAX_TOKEN_ID}) to "
                                 "numbers from -100 to 100", param="logit_bias")
        pairs.append([token_id, float(bias)])
    return pairs or None


def speculative(body: dict, where: str = "") -> bool:
    """The request's `speculative` (false: it never drafts, whatever its model's mode; the default: as the model
    does). `where`: the field's path before its name in errors ("options.")."""
    value = body.get("speculative", True)
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{where}speculative' must be a boolean", param=f"{where}speculative")
    return value


def _sampling(body: dict) -> dict:
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise InvalidRequest("'ignore_eos' must be a boolean", param="ignore_eos")
    seed = _integer(body, "seed", None, *SEED_RANGE)
    return {
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0),
        "top_k": _integer(body, "top_k", 0, 0, MAX_TOKENS_LIMIT),
        "min_p": _number(body, "min_p", 0.0, 0.0, 1.0),
        "ignore_eos": ignore_eos,
        "speculative": speculative(body),
        "seed": None if seed is None else seed % 2**64,  # one-to-one: -1 is 2**64 - 1, no other seed's
        "presence_penalty": _number(body, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0, 0.01, 10.0),
        "logit_bias": _logit_bias(body.get("logit_bias")),
    }


def _n(body: dict, prompts: int = 1) -> int:
    n = _integer(body, "n", 1, 1, MAX_N) or 1
    if n * prompts > MAX_SEQUENCES:
        raise InvalidRequest(f"{prompts} prompts x n={n} asks for {n * prompts} sequences; one request may ask "
                             f"for at most {MAX_SEQUENCES}", param="n")
    return n


def fan_out(first: Submit, n: int, prompts: int = 1) -> list[Submit]:
    """One Submit per choice: `first` and its copies, each its own request id and, when seeded, its own seed."""
    out = []
    for i in range(n * prompts):
        seed = None if first.seed is None else (first.seed + i % n) % 2**64
        out.append(dataclasses.replace(first, rid=f"{first.rid}-{i}" if i else first.rid, seed=seed))
    return out


# --- chat ----------------------------------------------------------------------------------


def _text(content: Any, where: str, allow_none: bool, images: bool = False) -> str | list[dict]:
    """A message's content: its text, or (`images`: a user message) its text and image parts (images.content)."""
    if content is None and allow_none:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif images and kind == "image_url":
                url = part.get("image_url")
                parts.append(image_part(url_source(url.get("url") if isinstance(url, dict) else url,
                                                   f"{where}[{j}].image_url")))
            else:
                allowed = "text and image_url parts" if images else "text parts"
                raise InvalidRequest(f"{where}: only {allowed} are supported", param=where)
        return content_of(parts)
    raise InvalidRequest(f"{where} must be a string or a list of text parts", param=where)


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise InvalidRequest(f"{where} must be a list", param=where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(f"{where}[{j}] must have a function with a name", param=f"{where}[{j}]")
        _name(fn["name"], f"{where}[{j}].function.name")
        args = fn.get("arguments", "{}")
        if not isinstance(args, (str, dict)):
            raise InvalidRequest(f"{where}[{j}].function.arguments must be a JSON string",
                                 param=f"{where}[{j}].function.arguments")
        out.append({"id": str(call.get("id") or f"call_{j}"), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def _message(m: Any, i: int) -> dict:
    """One message as the chat template takes it: role, text content, and the tool fields kept."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    role = m.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"{where}.role must be one of {', '.join(ROLES)}", param=f"{where}.role")
    out: dict = {"role": role, "content": _text(m.get("content"), f"{where}.content", role == "assistant",
                                                images=role == "user")}
    if role == "assistant":
        if m.get("tool_calls"):
            out["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        if isinstance(reasoning, str) and reasoning:
            out["reasoning_content"] = reasoning
    if role == "tool":
        if m.get("tool_call_id") is not None:
            out["tool_call_id"] = str(m["tool_call_id"])
    if isinstance(m.get("name"), str) and m["name"]:
        out["name"] = _name(m["name"], f"{where}.name")
    return out


def _function(tool: dict) -> dict | None:
    """A chat tool's function, when it has one with a name."""
    fn = tool.get("function") if tool.get("type") == "function" else None
    return fn if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"] else None


def _choice_name(choice: dict) -> Any:
    """The function a tool_choice object names: {"type": "function", "function": {"name"}} (or the legacy {"name"})."""
    fn = choice.get("function") if choice.get("type", "function") == "function" else None
    return fn.get("name") if isinstance(fn, dict) else choice.get("name")


TOOLS = ToolDialect(
    api="openai", path="tools[{j}]", function=_function, at="function.", schema="parameters",
    default_schema={"type": "object", "properties": {}}, check_name=_name,
    bad=lambda message, param: InvalidRequest(message, param=param),
    said={"list": "'tools' must be a list of function tools",
          "object": "{where} must be {{'type': 'function', 'function': {{'name': ...}}}}",
          "name": "{where} is required", "schema": "{where} must be a JSON schema object",
          "needs": "'tool_choice' needs 'tools'",
          "choice": "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"},
    choice_name=_choice_name)


def _tools(body: dict) -> list[dict] | None:
    """`tools` (or the legacy `functions`) as neutral function definitions."""
    tools = body.get("tools")
    if tools is None and body.get("functions") is not None:
        tools = [{"type": "function", "function": f} for f in body["functions"]] \
            if isinstance(body["functions"], list) else body["functions"]
    return parse_tools(tools, TOOLS)


def _response_format(fmt: Any) -> dict | None:
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"type": "json", "schema": None}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
            raise InvalidRequest("response_format.json_schema must be an object with a 'name' and a 'schema'",
                                 param="response_format.json_schema")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise InvalidRequest("response_format.json_schema.schema must be a JSON schema object",
                                 param="response_format.json_schema.schema")
        return {"type": "json", "schema": schema, "name": spec.get("name", "")}
    raise InvalidRequest("'response_format' type must be 'text', 'json_object' or 'json_schema'",
                         param="response_format")


def _template_kwargs(body: dict) -> dict:
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise InvalidRequest("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    if "enable_thinking" in kwargs and not isinstance(kwargs["enable_thinking"], bool):
        raise InvalidRequest("chat_template_kwargs.enable_thinking must be a boolean",
                             param="chat_template_kwargs.enable_thinking")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise InvalidRequest(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}",
                                 param="reasoning_effort")
        kwargs = {"reasoning_effort": "low" if effort == "minimal" else effort, **kwargs}
    return kwargs


def prompt_cache_marks(body: dict, messages: int) -> list[list]:
    """A `prompt_cache_key` as Submit.cache_mark, as an Anthropic breakpoint on the last message: the prompt through
    its `messages` kept cached with priority for its retention (CACHE_RETENTIONS). One worker serves a model, so
    the key itself routes nothing: any key marks its request's prompt."""
    retention = body.get("prompt_cache_retention")
    if retention is not None and not (isinstance(retention, str) and retention in CACHE_RETENTIONS):
        raise InvalidRequest("'prompt_cache_retention' must be 'in_memory' or '24h'", param="prompt_cache_retention")
    key = body.get("prompt_cache_key")
    if key is not None and (not isinstance(key, str) or len(key) > MAX_CACHE_KEY):
        raise InvalidRequest(f"'prompt_cache_key' must be a string of at most {MAX_CACHE_KEY} characters",
                             param="prompt_cache_key")
    return [[messages, CACHE_RETENTIONS[retention or "in_memory"]]] if key else []


def _chat_logprobs(body: dict) -> int:
    top = _integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise InvalidRequest("'logprobs' must be a boolean", param="logprobs")
    if top is not None and not wanted:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if wanted else -1


def parse_chat(body: Any, strict: bool = False) -> Parsed:
    """`strict`: an unknown field is a 400, not ignored."""
    model, stream, include_usage, stop = _common(body, CHAT_PARAMS, strict, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    clean = [_message(m, i) for i, m in enumerate(messages)]
    tools, constraint = parse_tool_choice(body.get("tool_choice", body.get("function_call")),
                                          body.get("parallel_tool_calls", True), _tools(body), TOOLS)
    json_format = _response_format(body.get("response_format"))
    if constraint is None:
        constraint = json_format
    max_tokens = _integer(body, "max_completion_tokens", None, 1, MAX_TOKENS_LIMIT)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 0, 1, MAX_TOKENS_LIMIT) or 0  # 0: up to the context
    submit = Submit(rid=new_id("chatcmpl"), max_tokens=max_tokens, messages=clean, stop=stop, tools=tools,
                    template_kwargs=_template_kwargs(body), constraint=constraint, logprobs=_chat_logprobs(body),
                    cache_mark=prompt_cache_marks(body, len(clean)), **_sampling(body))
    n = _n(body)
    return Parsed(model, submit, stream, include_usage, fan_out(submit, n), submit.logprobs >= 0, n,
                  given(body, SAMPLING))


# --- completions ---------------------------------------------------------------------------


def _prompts(prompt: Any) -> list[str | list[int]]:
    """`prompt` as OpenAI allows it: a string, a list of strings, token ids, or a list of token-id lists."""
    def token_ids(p: Any) -> bool:
        return isinstance(p, list) and all(is_number(t, integer=True) and t >= 0 for t in p)

    if isinstance(prompt, str) or token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or token_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise InvalidRequest("'prompt' must be a string, a list of strings, a list of token ids or a list of "
                             "token-id lists", param="prompt")
    if not prompts or any(not p for p in prompts):
        raise InvalidRequest("'prompt' must not be empty", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequest(f"'prompt' may hold at most {MAX_PROMPTS} prompts", param="prompt")
    return prompts


def parse_completion(body: Any, strict: bool = False) -> Parsed:
    model, stream, include_usage, stop = _common(body, COMPLETION_PARAMS, strict, "completions")
    for key in ("echo", "suffix"):
        if body.get(key):
            raise InvalidRequest(f"'{key}' is not supported", param=key)
    if body.get("best_of", 1) not in (1, None):
        raise InvalidRequest("only best_of=1 is supported", param="best_of")
    logprobs = _integer(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
    prompts = _prompts(body.get("prompt"))
    max_tokens = _integer(body, "max_tokens", 16, 1, MAX_TOKENS_LIMIT) or 16
    n = _n(body, len(prompts))
    first = Submit(rid=new_id("cmpl"), max_tokens=max_tokens, stop=stop,
                   logprobs=-1 if logprobs is None else logprobs, **_sampling(body))
    choices = []
    for i, sub in enumerate(fan_out(first, n, len(prompts))):
        p = prompts[i // n]
        choices.append(dataclasses.replace(sub, prompt=p if isinstance(p, str) else None,
                                           prompt_ids=None if isinstance(p, str) else list(p)))
    return Parsed(model, choices[0], stream, include_usage, choices, logprobs is not None, n, given(body, SAMPLING))
