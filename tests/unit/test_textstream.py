"""Incremental text with stop strings: nothing past a stop string escapes, nothing is held forever."""

from __future__ import annotations

from worker.textstream import TextStream


class CharDetok:
    """Each token is one character of a fixed alphabet; a stand-in for the streaming detokenizer."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces
        self.last_segment = ""

    def add_token(self, token: int) -> None:
        self.last_segment = self.pieces[token]

    def finalize(self) -> None:
        self.last_segment = ""


def run(pieces: list[str], stop: list[str]) -> tuple[list[str], bool, str]:
    ts = TextStream(CharDetok(pieces), stop)
    out = []
    for i in range(len(pieces)):
        out.append(ts.push(i))
        if ts.stopped:
            break
    tail = ts.flush()
    return out, ts.stopped, "".join(out) + tail


def test_no_stop_strings_passes_everything_through() -> None:
    out, stopped, text = run(["a", "b", "c"], [])
    assert out == ["a", "b", "c"] and not stopped and text == "abc"


def test_stop_string_split_across_tokens_is_cut() -> None:
    out, stopped, text = run(["he", "llo E", "N", "D more"], ["END"])
    assert stopped and text == "hello "
    assert "E" not in "".join(out)  # the partial 'E' was held back, never emitted


def test_held_text_is_released_when_the_match_fails() -> None:
    out, stopped, text = run(["ab", "E", "x", "y"], ["END"])
    assert not stopped and text == "abExy"
    assert out[1] == "" and out[2] == "Ex"


def test_earliest_of_several_stop_strings_wins() -> None:
    _, stopped, text = run(["one two three"], ["three", "two"])
    assert stopped and text == "one "


def test_flush_releases_a_held_partial_at_the_end() -> None:
    out, stopped, text = run(["abc", "EN"], ["END"])
    assert not stopped and text == "abcEN" and "".join(out) == "abc"
