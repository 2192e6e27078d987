"""A model family's output format, as the worker needs it: which parser reads its output, and the grammar
that forces a call or a JSON answer in it. Pure: no MLX, no grammar library (the grammar is Lark text
for llguidance, compiled in worker/mlx_engine/guided.py).

The format comes from the tokenizer: harmony when its vocabulary has harmony's markers (gpt-oss);
else think markers (mlx-lm's think_start/think_end) and tool markers with mlx-lm's parser for the
family (`TokenizerWrapper.tool_call_start`, `tool_parser`). A forced call is written in the family's own
call format, with its arguments constrained by the function's JSON schema: Qwen3's
`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, harmony's
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>`. A family whose
call format no grammar here writes gets ConstraintError (a 400), never an unconstrained answer. A model whose chat
template writes no tools gets the worker's own format (worker/tool_fallback.py: Qwen3's JSON calls, whatever its
tokenizer says), since that is the format its prompt asks for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from worker import tool_fallback
from worker.output_parser import HARMONY_MARKERS, HarmonyParser, MarkupParser, OutputParser, PlainParser, ToolFormat
from worker.template_input import renders_tools

# JSON written compactly and in one way: a forced answer has no whitespace to wander in.
_JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


class ConstraintError(ValueError):
    """A constraint this model cannot be held to (a schema that does not compile, a call format no grammar writes)."""


@dataclass(frozen=True)
class Family:
    harmony: dict[str, int] | None = None  # marker -> token id, for gpt-oss
    think: tuple[str, str] | None = None
    tool: ToolFormat | None = None
    marker_ids: dict[str, int] | None = None  # think and tool markers that are one token each: a grammar names the token

    @property
    def visible_specials(self) -> frozenset[int]:
        """Special tokens the parser must see as text (harmony's markers; the end tokens stop generation)."""
        return frozenset(self.harmony.values()) if self.harmony else frozenset()


def family_of(tokenizer: Any) -> Family:
    vocab = tokenizer.get_vocab()
    if all(m in vocab for m in HARMONY_MARKERS):
        return Family(harmony={m: vocab[m] for m in HARMONY_MARKERS})
    think = (tokenizer.think_start, tokenizer.think_end) if getattr(tokenizer, "has_thinking", False) else None
    tool = None
    if getattr(tokenizer, "has_tool_calling", False) and tokenizer.tool_parser is not None:
        parse = tokenizer.tool_parser
        json_call = parse.__module__.endswith(".json_tools")
        tool = ToolFormat(tokenizer.tool_call_start, tokenizer.tool_call_end, lambda text: parse(text, None), json_call)
    if not renders_tools(tokenizer):
        tool = tool_fallback.FORMAT
    markers = [*(think or ()), *((tool.start, tool.end) if tool else ())]
    return Family(think=think, tool=tool, marker_ids={m: vocab[m] for m in markers if m in vocab})


def starts_in_think(family: Family, prompt_tail: str) -> bool:
    """The generation prompt opened a think block (Qwen3.5 does unless thinking is off)."""
    return bool(family.think) and prompt_tail.rstrip().endswith(family.think[0])  # type: ignore[index]


def parser_for(family: Family, chat: bool, tools: bool, in_think: bool) -> OutputParser:
    if not chat:
        return PlainParser()
    if family.harmony:
        return HarmonyParser()
    if not family.think and not (tools and family.tool):
        return PlainParser()
    return MarkupParser(family.think, in_think, family.tool if tools else None)


def _lark_str(text: str) -> str:
    return json.dumps(text)


def _marker(family: Family, marker: str) -> str:
    """A marker in a grammar: its token when it is one (llguidance matches added tokens only by id), else its text."""
    token = (family.marker_ids or {}).get(marker)
    return f"<[{token}]>" if token is not None else _lark_str(marker)


def _json_rule(schema: dict | None) -> str:
    body = {"type": "object"} if schema is None else dict(schema)
    if not isinstance(body, dict):
        raise ConstraintError("the schema must be a JSON object")
    body["x-guidance"] = {**_JSON_STYLE, **(body.get("x-guidance") or {})}
    return "%json " + json.dumps(body)


def grammar_for(family: Family, constraint: dict, tools: list[dict] | None, in_think: bool) -> str:
    """The Lark grammar (llguidance's dialect) of a constrained answer in this family's format."""
    if constraint.get("type") == "json":
        return _json_grammar(family, constraint.get("schema"), in_think)
    if constraint.get("type") == "tool":
        by_name = {t["name"]: t for t in tools or []}
        names = [n for n in constraint.get("names") or [] if n in by_name]
        if not names:
            raise ConstraintError("the tool constraint names no function in 'tools'")
        return _tool_grammar(family, [by_name[n] for n in names], bool(constraint.get("parallel")), in_think)
    raise ConstraintError(f"unknown constraint type {constraint.get('type')!r}")


def _json_grammar(family: Family, schema: dict | None, in_think: bool) -> str:
    if family.harmony:
        h = family.harmony
        return f'start: <[{h["<|channel|>"]}]> "final" <[{h["<|message|>"]}]> answer\nanswer: {_json_rule(schema)}\n'
    prefix = f'{_marker(family, family.think[1])} "\\n\\n" ' if in_think and family.think else ""
    return f"start: {prefix}answer\nanswer: {_json_rule(schema)}\n"


def _tool_grammar(family: Family, tools: list[dict], parallel: bool, in_think: bool) -> str:
    rules = []
    alternatives = []
    for i, fn in enumerate(tools):
        rules.append(f"args{i}: {_json_rule(fn.get('parameters') or {'type': 'object'})}")
        alternatives.append(i)
    if family.harmony:
        h = family.harmony
        calls = " | ".join(f'<[{h["<|channel|>"]}]> {_lark_str("commentary to=functions." + tools[i]["name"] + " ")} '
                           f'<[{h["<|constrain|>"]}]> "json" <[{h["<|message|>"]}]> args{i} <[{h["<|call|>"]}]>'
                           for i in alternatives)
        return f"start: {calls}\n" + "\n".join(rules) + "\n"  # <|call|> ends the turn: one call per turn
    tool = family.tool
    if tool is None:
        raise ConstraintError("this model has no tool-call format (its chat template and tokenizer define none), "
                              "so a call cannot be required of it")
    if not tool.json_call:
        raise ConstraintError("this model's tool-call format cannot be forced (only JSON calls and harmony can)")
    calls = " | ".join(f'{_marker(family, tool.start)} '
                       f'{_lark_str(chr(10) + "{" + chr(34) + "name" + chr(34) + ": ")} '
                       f'{_lark_str(json.dumps(tools[i]["name"]) + ", " + chr(34) + "arguments" + chr(34) + ": ")} '
                       f'args{i} {_lark_str("}" + chr(10))} {_marker(family, tool.end)}' for i in alternatives)
    prefix = f'{_marker(family, family.think[1])} "\\n\\n" ' if in_think and family.think else ""
    repeat = ' ("\\n" call)*' if parallel else ""
    return f"start: {prefix}call{repeat}\ncall: {calls}\n" + "\n".join(rules) + "\n"
