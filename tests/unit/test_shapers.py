"""The shapers' accumulation is linear (issue 25): the transcript and every API's shaper take a long
answer piece by piece without growing a string per delta, and say it whole, joined once.

Counted by structure, not by the clock: each delta's pieces are `Counted` strings, which count every
concatenation they take part in (`a + b`, `a += b`); a shaper that grows a string per delta makes
one per delta, a linear one none at all."""

from __future__ import annotations

import json

from protocol.messages import Finished, Submit
from supervisor.gateway.anthropic_shape import MessageShaper
from supervisor.gateway.openai_api import Parsed
from supervisor.gateway.openai_shape import Shaper
from supervisor.gateway.responses_shape import ResponseShaper
from supervisor.gateway.transcript import PIECE, START, STOP, Transcript

N = 100_000


class Counted(str):
    """A piece of a delta that counts the concatenations it takes part in."""

    adds = 0

    def __add__(self, other: str) -> str:
        Counted.adds += 1
        return str.__add__(self, other)

    def __radd__(self, other: str) -> str:
        Counted.adds += 1
        return str.__add__(other, self)


def deltas(n: int = N) -> list[tuple[str, dict | None]]:
    """A long answer, one piece a delta: a quarter reasoning, half text, a quarter one call's arguments."""
    quarter = n // 4
    out: list[tuple[str, dict | None]] = [(Counted(""), {"reasoning": Counted("r")})] * quarter
    out += [(Counted("t"), None)] * (n - 2 * quarter)
    out.append((Counted(""), {"calls": [[0, "call_1", "f", Counted('{"a": "')]]}))
    out += [(Counted(""), {"calls": [[0, "", "", Counted("x")]]})] * (quarter - 2)
    out.append((Counted(""), {"calls": [[0, "", "", Counted('"}')]]}))
    return out


FIN = Finished(rid="r", text="", finish_reason="tool_calls", prompt_tokens=3, completion_tokens=N)
REASONING, TEXT, ARGS = "r" * (N // 4), "t" * (N - 2 * (N // 4)), {"a": "x" * (N // 4 - 2)}


def feed_all(feed: object) -> None:
    Counted.adds = 0
    for text, extra in deltas():
        feed(text, extra)  # type: ignore[operator]


def test_the_transcript_keeps_pieces_in_lists_and_joins_each_part_once() -> None:
    said = Transcript()
    steps = []
    Counted.adds = 0
    for text, extra in deltas():
        steps += said.feed(text, extra)
    assert Counted.adds == 0
    assert [(p.kind, len(p.pieces)) for p in said.parts] == [("reasoning", N // 4), ("text", N // 2),
                                                            ("call", N // 4)]
    assert [s[0] for s in steps].count(START) == 3 and [s[0] for s in steps].count(STOP) == 2
    assert [s[0] for s in steps].count(PIECE) == N
    assert said.joined("reasoning") == REASONING and said.joined("text") == TEXT
    assert said.calls()[0].call_id == "call_1" and json.loads(said.calls()[0].text) == ARGS
    assert all(len(p.pieces) == 1 for p in said.parts)  # read once: joined, and kept joined
    assert len(said.answer) == N // 2 and Counted.adds == 0


def test_a_blank_held_between_a_thought_and_a_call_opens_no_part() -> None:
    said = Transcript()
    said.feed("", {"reasoning": "hm"})
    said.feed("\n\n", None)
    said.feed("", {"calls": [[0, "c", "f", "{}"]]})
    said.feed("  ", None)
    said.feed("ok", None)
    assert [(p.kind, p.text) for p in said.parts] == [("reasoning", "hm"), ("call", "{}"), ("text", "  ok")]
    assert "".join(said.answer) == "\n\n  ok"  # the OpenAI APIs' content keeps every blank


def test_anthropic_shaper_is_linear() -> None:
    shaper = MessageShaper("msg_1", "m")
    feed_all(shaper.feed)
    content = shaper.whole(FIN)["content"]
    assert Counted.adds == 0
    assert content == [{"type": "thinking", "thinking": REASONING, "signature": ""}, {"type": "text", "text": TEXT},
                       {"type": "tool_use", "id": "call_1", "name": "f", "input": ARGS}]


def test_responses_shaper_is_linear() -> None:
    shaper = ResponseShaper("resp_1", "m", {})
    feed_all(shaper.feed)
    events = shaper.finish(FIN)
    turn = shaper.turn()
    assert Counted.adds == 0
    output = events[-1]["response"]["output"]
    assert [i["type"] for i in output] == ["reasoning", "message", "function_call"]
    assert output[0]["content"][0]["text"] == REASONING and output[1]["content"][0]["text"] == TEXT
    assert json.loads(output[2]["arguments"]) == ARGS and all(i["status"] == "completed" for i in output)
    assert turn["content"] == TEXT and turn["reasoning_content"] == REASONING


def test_openai_whole_response_is_linear() -> None:
    submit = Submit(rid="chatcmpl-1", max_tokens=N, messages=[{"role": "user", "content": "hi"}])
    shaper = Shaper(Parsed("m", submit, False, False), "m")
    said = Transcript()
    feed_all(said.feed)
    message = shaper.whole([said], [FIN])["choices"][0]["message"]
    assert Counted.adds == 0
    assert message["content"] == TEXT and message["reasoning_content"] == REASONING
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [ARGS]
