"""The one parser of a request's `tools`, for the three APIs that take them (chat, Anthropic Messages,
Responses), and of the OpenAI-style `tool_choice` (chat's and Responses'). Pure.

Each API writes a function tool its own way (OpenAI `{"type": "function", "function": {name,
description, parameters}}`, Anthropic `{name, description, input_schema}`, Responses `{"type":
"function", name, description, parameters}`) and words its errors its own way; a `ToolDialect`
says both, and `parse_tools` does the rest. Invariants: the result is the neutral list the Submit
carries (`{"name", "description", "parameters"}`), or None for no tools; every name passed the
API's name rule (so none can carry a chat template's special tokens); a tool of a kind that does not
run here (a server tool) is skipped with a warning where the API has such kinds, refused where not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from supervisor.errors import MlxsupError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolDialect:
    """How one API writes its tools and its errors about them."""

    api: str  # the log's phase
    path: str  # a tool's path in the body, with {j} its index: "tools.{j}", "tools[{j}]"
    function: Callable[[dict], Any]  # the object holding a tool's name, description and schema (None: malformed)
    at: str  # that object's path in the tool, "" or "function."
    schema: str  # the schema's key there: "parameters", "input_schema"
    default_schema: dict | None  # a tool without a schema gets this one (None: the schema is required)
    check_name: Callable[[Any, str], object]  # the API's name rule: raises its error for a bad name at a path
    bad: Callable[[str, str], MlxsupError]  # the API's error for (message, param)
    said: dict[str, str]  # the messages by what is wrong ("list", "object", "name", "schema" with {where};
    # "needs" and "choice" for tool_choice)
    skips: Callable[[dict], bool] = lambda tool: False  # a kind that does not run here: skipped, with a warning
    runs_here: str = "function"  # the kind that does, for that warning
    choice_name: Callable[[dict], Any] = lambda choice: None  # the function a `tool_choice` object names


def parse_tools(tools: Any, dialect: ToolDialect) -> list[dict] | None:
    """A body's `tools` as the Submit's neutral function definitions (None: no tools)."""
    if tools is None:
        return None
    d = dialect
    if not isinstance(tools, list):
        raise d.bad(d.said["list"].format(where="tools"), "tools")
    out = []
    for j, tool in enumerate(tools):
        where = d.path.format(j=j)
        if isinstance(tool, dict) and d.skips(tool):
            log.warning("[%s] skipped tool of type=%.40r name=%.40r: only %s tools run here", d.api,
                        tool.get("type"), tool.get("name"), d.runs_here)
            continue
        fn = d.function(tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict):
            raise d.bad(d.said["object"].format(where=where), where)
        name = fn.get("name")
        at = f"{where}.{d.at}"
        if not isinstance(name, str) or not name:
            raise d.bad(d.said["name"].format(where=f"{at}name"), f"{at}name")
        d.check_name(name, f"{at}name")
        schema = fn.get(d.schema)
        if d.default_schema is not None:
            schema = schema or d.default_schema
        if not isinstance(schema, dict):
            raise d.bad(d.said["schema"].format(where=f"{at}{d.schema}"), f"{at}{d.schema}")
        out.append({"name": name, "description": str(fn.get("description") or ""), "parameters": schema})
    return out or None


def parse_tool_choice(choice: Any, parallel: Any, tools: list[dict] | None,
                      dialect: ToolDialect) -> tuple[list[dict] | None, dict | None]:
    """An OpenAI-style `tool_choice` ("none", "auto", "required" or one named function; chat's and Responses')
    as (the tools the template and parser get, the decoding constraint)."""
    d = dialect
    if not isinstance(parallel, bool):
        raise d.bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if choice is None or choice == "auto":
        return tools, None
    if choice == "none":
        return None, None
    if not tools:
        raise d.bad(d.said["needs"], "tool_choice")
    names = [t["name"] for t in tools]
    if choice == "required":
        return tools, {"type": "tool", "names": names, "parallel": parallel}
    name = d.choice_name(choice) if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise d.bad(d.said["choice"], "tool_choice")
    if name not in names:
        raise d.bad(f"'tool_choice' names function {name[:64]!r}, which is not in 'tools'", "tool_choice")
    return tools, {"type": "tool", "names": [name], "parallel": False}
