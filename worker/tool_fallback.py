"""Tools for a chat template that writes none (Llama's minimal ChatML here, Gemma 3's real template): the worker
writes them into the messages itself, in the Hermes/Qwen JSON format, as LM Studio does for such models. Pure: no MLX.

What the template is given instead of `tools` and tool-shaped messages (`fallback_messages`):
- the tool list (name, description, JSON-schema parameters, one compact JSON object a line) and an instruction to
  call one as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, at the end of the one system message
  that comes first (the client's leading system messages merged into it): Gemma's template folds only a first system
  message into the first user turn;
- an assistant message's tool calls as that same text after its content, written as the model writes a call under
  the grammar (worker/chat_format.py's `_tool_grammar` with `FORMAT`), so a reply comes back to the template as the
  model produced it;
- a tool result as user text `<tool_response>\\n...\\n</tool_response>`, consecutive user-side messages merged into
  one (Gemma's template raises unless roles alternate user/assistant).

Invariants: deterministic, and prefix-stable: the rendering of a conversation is a prefix of the rendering of that
conversation extended by the model's reply and what follows it (so the prompt caches keep hitting turn after turn);
a request with neither tools nor tool history is not touched (`needed`); nothing a client sent is dropped.
"""

from __future__ import annotations

import json

from worker.output_parser import ToolFormat, arguments_json

START, END = "<tool_call>", "</tool_call>"
SYSTEM_ROLES = ("system", "developer")


def _parse(text: str) -> object:
    return json.loads(text.strip())


FORMAT = ToolFormat(START, END, _parse, json_call=True)  # the parser's and the grammar's view of a call

INSTRUCTION = ("# Tools\n\nYou may call one or more functions to help with the user's request. The functions, one "
               "JSON object a line:\n<tools>\n{tools}\n</tools>\n\nTo call a function, reply with its name and its "
               "arguments as a JSON object within <tool_call></tool_call> tags:\n" + START
               + '\n{{"name": <function-name>, "arguments": <args-json-object>}}\n' + END
               + "\nThe result comes back within <tool_response></tool_response> tags. If no function fits, answer "
               "directly.")


def needed(messages: list[dict], tools: list | None) -> bool:
    """Whether a request has anything for the fallback to write: tools, earlier calls or tool results."""
    return bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def tools_text(tools: list[dict]) -> str:
    """The tool list as the system message shows it: each function one compact JSON line, in the client's order."""
    lines = []
    for t in tools:
        fn = {"name": t.get("name"), "description": t.get("description") or "",
              "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        lines.append(json.dumps(fn, ensure_ascii=False, separators=(",", ":")))
    return "\n".join(lines)


def call_text(call: dict) -> str:
    """One earlier call, as the grammar makes the model write it (json.dumps' separators are the grammar's)."""
    fn = call.get("function") or {}
    args = arguments_json(fn.get("arguments", {}))
    return f'{START}\n{{"name": {json.dumps(fn.get("name"))}, "arguments": {args}}}\n{END}'


def _join(a: str | list, b: str | list, sep: str) -> str | list:
    """Two message contents as one: text joined by `sep`; when either holds images, their parts in order."""
    if isinstance(a, str) and isinstance(b, str):
        return a + sep + b if a else b
    parts = [*_parts(a), {"type": "text", "text": sep}, *_parts(b)] if a else _parts(b)
    out: list[dict] = []
    for p in parts:  # adjacent texts as one part, as the gateway gives them
        if p.get("type") == "text" and out and out[-1].get("type") == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + p["text"]}
        else:
            out.append(p)
    return out


def _parts(content: str | list) -> list[dict]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def _content(m: dict) -> str | list:
    content = m.get("content")
    return content if isinstance(content, str | list) else ""


def _system_text(content: str | list) -> str:
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content if isinstance(p, dict))


def alternated(messages: list[dict], system_turns: bool = False, user_runs: bool = False) -> list[dict]:
    """The messages for a template that cannot write a system message inside the conversation (`system_turns`
    False: each one after the first message that is not a system message becomes user text where it stands) or two
    user messages in a row (`user_runs` False: they are joined into one; Gemma's template raises unless roles
    alternate, and opencode's title request sends two). Leading system messages are left as they are."""
    out: list[dict] = []
    began = False  # the conversation began: a system message from here on is inside it
    for m in messages:
        role = m.get("role")
        if not began and role in SYSTEM_ROLES:
            out.append(m)
            continue
        began = True
        if role in SYSTEM_ROLES and not system_turns:
            m = {"role": "user", "content": _system_text(_content(m))}
        if m.get("role") == "user" and not user_runs and out and out[-1].get("role") == "user":
            out[-1] = {**out[-1], "content": _join(_content(out[-1]), _content(m), "\n\n")}
        else:
            out.append(m)
    return out


def fallback_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The messages as the template is given them in place of `tools` (the module docstring says how)."""
    head = 0
    while head < len(messages) and messages[head].get("role") in SYSTEM_ROLES:
        head += 1
    texts = [_system_text(_content(m)) for m in messages[:head]]
    if tools:
        texts.append(INSTRUCTION.format(tools=tools_text(tools)))
    out: list[dict] = [{"role": "system", "content": "\n\n".join(t for t in texts if t)}] if texts else []
    for m in messages[head:]:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(call_text(c) for c in m["tool_calls"])
            text = _join(_content(m), calls, "\n")
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text}
        elif role == "tool":
            m = {"role": "user", "content": _join(_join("<tool_response>\n", _content(m), ""), "\n</tool_response>",
                                                  "")}
        if m.get("role") == "user" and out and out[-1].get("role") == "user":
            out[-1] = {**out[-1], "content": _join(_content(out[-1]), _content(m), "\n")}
        else:
            out.append(m)
    return out
