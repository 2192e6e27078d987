"""Output parsing over recorded outputs of each family: whole, split at every character boundary, and one
character at a time, the joined answer, reasoning and calls are the same; markup never reaches the text."""

from __future__ import annotations

import itertools
import json

import pytest
from mlx_lm.tool_parsers import json_tools, qwen3_coder

from worker.output_parser import HarmonyParser, MarkupParser, Out, OutputParser, ToolFormat

QWEN3_TOOL = ToolFormat(json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call, json_call=True)
QWEN3_5_TOOL = ToolFormat(qwen3_coder.tool_call_start, qwen3_coder.tool_call_end,
                          lambda text: qwen3_coder.parse_tool_call(text, None))
THINK = ("<think>", "</think>")

# Outputs as the families write them (after the generation prompt), each with what it must parse to:
# (answer, reasoning, [(name, arguments as parsed JSON)]).
QWEN3 = [
    ("<think>\nThe user wants weather.\nCall the tool.\n</think>\n\n<tool_call>\n"
     '{"name": "get_weather", "arguments": {"city": "Paris", "days": {"n": 2}}}\n</tool_call>',
     "", "The user wants weather.\nCall the tool.", [("get_weather", {"city": "Paris", "days": {"n": 2}})]),
    ("<think>\n\n</think>\n\nIt is sunny.\n\nBye.", "It is sunny.\n\nBye.", "", []),
    ("Sure.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n"
     '{"name": "b", "arguments": {"x": "}"}}\n</tool_call>', "Sure.", "", [("a", {}), ("b", {"x": "}"})]),
    ("<tool_call>\n{\"arguments\": {\"q\": 1}, \"name\": \"late_name\"}\n</tool_call>", "", "", [("late_name", {"q": 1})]),
    ("<tool_call>\nnot json\n</tool_call> after", "<tool_call>\nnot json\n</tool_call> after", "", []),
    ("plain text <thin and more", "plain text <thin and more", "", []),
]
QWEN3_5 = [
    ("Let me look.\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
     "</parameter>\n</function>\n</tool_call>", "Checking.", "Let me look.", [("get_weather", {"city": "Paris"})]),
]
HARMONY = [
    ("<|channel|>analysis<|message|>Need weather; call it.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
     "", "Need weather; call it.", [("get_weather", {"city": "Paris"})]),
    ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>The answer.",
     "The answer.", "Think.", []),
    ('<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": "x"}',
     "", "", [("lookup", {"q": "x"})]),
    ("no harmony here at all", "no harmony here at all", "", []),
]


def joined(outs: list[Out], raw: bool = False) -> tuple[str, str, list[tuple]]:
    content = "".join(o.content for o in outs)
    reasoning = "".join(o.reasoning for o in outs)
    calls: dict[int, list] = {}
    for o in outs:
        for index, call_id, name, args in o.calls:
            if call_id:
                assert index not in calls, "a call's id and name come once, in its first piece"
                calls[index] = [name, ""]
            calls[index][1] += args
    return content, reasoning, [(name, args if raw else json.loads(args)) for name, args in (calls[i] for i in sorted(calls))]


def run(make: type | object, pieces: list[str], raw: bool = False) -> tuple[str, str, list[tuple]]:
    parser: OutputParser = make()  # type: ignore[operator]
    return joined([parser.feed(p) for p in pieces] + [parser.finish()], raw)


def splits(text: str):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def qwen3() -> MarkupParser:
    ids = itertools.count()
    return MarkupParser(THINK, False, QWEN3_TOOL, call_id=lambda: f"call_{next(ids)}")


def qwen3_5() -> MarkupParser:
    return MarkupParser(THINK, True, QWEN3_5_TOOL)


@pytest.mark.parametrize("make, case", [(qwen3, c) for c in QWEN3] + [(qwen3_5, c) for c in QWEN3_5]
                         + [(HarmonyParser, c) for c in HARMONY])
def test_every_split_parses_like_the_whole(make, case) -> None:
    text, content, reasoning, calls = case
    assert run(make, [text]) == (content, reasoning, calls)
    whole = run(make, [text], raw=True)  # the arguments' very characters, not only their JSON value
    for pieces in splits(text):
        assert run(make, pieces, raw=True) == whole, pieces


def test_json_call_arguments_stream_before_the_call_closes() -> None:
    parser = qwen3()
    head = parser.feed('<tool_call>\n{"name": "f", "arguments": {"city": "Par')
    assert [c[2] for c in head.calls if c[2]] == ["f"]
    assert "".join(c[3] for c in head.calls) == '{"city": "Par'
    assert head.content == "" and head.reasoning == ""


def test_harmony_call_arguments_stream_and_markers_never_leak() -> None:
    parser = HarmonyParser()
    out = parser.feed('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1')
    assert out.calls[0][2] == "f" and "".join(c[3] for c in out.calls) == '{"a": 1'
    rest = parser.feed("}<|call|>")
    assert "".join(c[3] for c in rest.calls) == "}" and parser.calls_made == 1
    assert "<|" not in out.content + rest.content
