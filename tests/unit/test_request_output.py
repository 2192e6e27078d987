"""A request's output, token by token (worker/request_output.py), and its OpenAI shapes (gateway/openai_shape.py):
chunks carry typed extras, logprobs come one per token, a call finishes with "tool_calls", and a streamed
response's pieces join to the whole one's message."""

from __future__ import annotations

import itertools

from mlx_lm.tool_parsers import json_tools

from protocol.messages import Finished, Submit
from supervisor.gateway.openai_api import Parsed
from supervisor.gateway.openai_shape import Shaper
from supervisor.gateway.transcript import Transcript
from worker.output_parser import MarkupParser, PlainParser, ToolFormat
from worker.request_output import RequestOutput
from worker.textstream import TextStream

PIECES = ["<think>", "\nhm\n", "</think>", "\n\n", "Ok", "<tool_call>", '\n{"name": "f", ', '"arguments": {"a": ',
          "1}}\n", "</tool_call>"]


class Detok:
    """A detokenizer over a fixed list of pieces: token i is PIECES[i]."""

    def __init__(self) -> None:
        self.last_segment = ""

    def add_token(self, token: int) -> None:
        self.last_segment = PIECES[token]

    def finalize(self) -> None:
        self.last_segment = ""


def output(logprobs: bool = True) -> RequestOutput:
    ids = itertools.count()
    parser = MarkupParser(("<think>", "</think>"), False,
                          ToolFormat("<tool_call>", "</tool_call>", json_tools.parse_tool_call, json_call=True),
                          call_id=lambda: f"call_{next(ids)}")
    return RequestOutput(TextStream(Detok(), []), parser,
                         (lambda token, _: [PIECES[token], -0.5, []]) if logprobs else None)


def run(out: RequestOutput, tokens: list[int], reason: str = "stop") -> tuple[list[list], tuple]:
    chunks = []
    for t in tokens:
        out.push(t)
        if (chunk := out.take()) is not None:
            chunks.append(chunk)
    return chunks, out.finish(reason)


def test_chunks_carry_reasoning_calls_and_one_logprob_per_token() -> None:
    chunks, (text, extra, reason) = run(output(), list(range(len(PIECES))))
    assert reason == "tool_calls"
    every = [*chunks, [text, 0, extra or {}]]
    assert sum(c[1] for c in every) == len(PIECES)  # every token counted once
    extras = [c[2] for c in every if len(c) > 2]
    assert [e[0] for x in extras for e in x.get("logprobs", [])] == PIECES
    assert "".join(x.get("reasoning", "") for x in extras) == "hm"
    assert "".join(c[0] for c in every) == "Ok"
    calls = [c for x in extras for c in x.get("calls", [])]
    assert calls[0][:3] == [0, "call_0", "f"] and "".join(c[3] for c in calls) == '{"a": 1}'


def test_a_call_cut_by_the_length_limit_finishes_with_length() -> None:
    _, (_, _, reason) = run(output(logprobs=False), list(range(8)), reason="length")
    assert reason == "length"
    plain = RequestOutput(TextStream(Detok(), []), PlainParser())
    assert run(plain, [4], "stop")[1] == ("", None, "stop")


def test_streamed_pieces_join_to_the_whole_message() -> None:
    chunks, (text, extra, reason) = run(output(), list(range(len(PIECES))))
    fin = Finished("r", text, reason, 3, len(PIECES), 0, extra)
    submit = Submit(rid="chatcmpl-x", max_tokens=9, messages=[{"role": "user", "content": "hi"}], logprobs=0)
    shaper = Shaper(Parsed("m", submit, True, False, logprobs=True), "m")
    said = Transcript()
    for c in chunks:
        said.feed(c[0], c[2] if len(c) > 2 else None)
    said.feed(fin.text, fin.extra)
    whole = shaper.whole([said], [fin])["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == "Ok"
    assert whole["message"]["reasoning_content"] == "hm"
    assert whole["message"]["tool_calls"] == [{"id": "call_0", "type": "function",
                                                "function": {"name": "f", "arguments": '{"a": 1}'}}]
    assert len(whole["logprobs"]["content"]) == len(PIECES)

    deltas = [shaper.chunk(0, c[0], c[2] if len(c) > 2 else None, first=i == 0)["choices"][0]["delta"]
              for i, c in enumerate(chunks)]
    pieces = [p for d in deltas for p in d.get("tool_calls", [])]
    assert pieces[0] == {"index": 0, "id": "call_0", "type": "function", "function": {"name": "f", "arguments": ""}}
    assert all(set(p) == {"index", "function"} for p in pieces[1:])  # id and name only in the first piece
    assert deltas[0]["role"] == "assistant" and "".join(d.get("reasoning_content", "") for d in deltas) == "hm"


def test_streamed_completion_logprobs_count_text_offsets_across_chunks() -> None:
    submit = Submit(rid="cmpl-x", max_tokens=4, prompt="hi", logprobs=0)
    shaper = Shaper(Parsed("m", submit, True, False, logprobs=True), "m")
    first = shaper.chunk(0, "ab", {"logprobs": [["a", -1.0, []], ["b", -1.0, []]]})["choices"][0]["logprobs"]
    second = shaper.chunk(0, "c", {"logprobs": [["c", -1.0, []]]})["choices"][0]["logprobs"]
    assert first["text_offset"] == [0, 1] and second["text_offset"] == [2]
