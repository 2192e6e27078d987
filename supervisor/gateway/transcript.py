"""What one choice has said so far, shared by the three APIs' shapers. Pure.

The worker's typed deltas (answer text; reasoning and tool-call pieces in a chunk's extras) become
parts in order: `reasoning`, `text`, `call` (id, name, arguments in pieces). `feed` records a
delta and says what it did as steps (a part started, a piece added to it, a part stopped), which
each API's shaper writes as its own events; the whole response reads the same parts, so a stream
and a whole response say the same.
Invariants: every piece is kept in a list and joined once, when read (an answer of n deltas costs
O(n), never the O(n^2) of growing a string); one part is open at a time, started before its pieces
and stopped before the next starts; text that is only whitespace (the blank line between a thought
and a call) opens no part; `answer` keeps every piece of answer text as sent, blanks included (the
OpenAI APIs' `content`). Deltas queued together may be merged into one first (`span`, `merged`):
`feed` reads the merged delta as it would read them in turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["reasoning", "text", "call"]
START, PIECE, STOP = "start", "piece", "stop"
Step = tuple[str, "Part", str]  # (START | PIECE | STOP, the part, the piece added: "" but for PIECE)
Delta = tuple[str, int, dict | None]  # answer text, tokens, typed extras (reasoning, tool-call pieces, logprobs)
@dataclass(eq=False)
class Part:
    """One block of the answer (Anthropic's content block, a Responses output item)."""

    kind: Kind
    index: int  # its position in the transcript
    call_id: str = ""  # a call's id, name and index among the choice's calls
    name: str = ""
    call_index: int = 0
    tag: str = ""  # an id the API gives it (a Responses item's id)
    pieces: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The pieces joined (and kept joined: reading again costs nothing)."""
        if len(self.pieces) > 1:
            self.pieces[:] = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""


class Transcript:
    """One choice's parts, the open one, and what the whole response needs besides (answer text, logprobs)."""

    def __init__(self) -> None:
        self.parts: list[Part] = []
        self.open: Part | None = None
        self.answer: list[str] = []  # every piece of answer text, blanks included
        self.logprobs: list[list] = []
        self._blank = ""  # whitespace held until text that is not

    def feed(self, text: str, extra: dict | None) -> list[Step]:
        """Record one delta: reasoning, then answer text, then tool-call pieces; the steps it took."""
        steps: list[Step] = []
        if extra and extra.get("reasoning"):
            self._add("reasoning", extra["reasoning"], steps)
        if text:
            self.answer.append(text)
            if self._blank:
                text, self._blank = self._blank + text, ""
            if not text.isspace():
                self._add("text", text, steps)
            else:
                self._blank = text
        if not extra:
            return steps
        for call_index, call_id, name, args in extra.get("calls") or []:
            if call_id:
                self._blank = ""
                self._start(Part("call", len(self.parts), call_id, name, call_index), steps)
            part = self.open
            if part is not None and part.kind == "call" and args:
                part.pieces.append(args)
                steps.append((PIECE, part, args))
        if extra.get("logprobs"):
            self.logprobs.extend(extra["logprobs"])
        return steps

    def close(self) -> list[Step]:
        """Stop the open part (at the end of the response)."""
        if self.open is None:
            return []
        part, self.open = self.open, None
        return [(STOP, part, "")]

    def _start(self, part: Part, steps: list[Step]) -> None:
        steps += self.close()
        self.parts.append(part)
        self.open = part
        steps.append((START, part, ""))

    def _add(self, kind: Kind, piece: str, steps: list[Step]) -> None:
        if self.open is None or self.open.kind != kind:
            self._start(Part(kind, len(self.parts)), steps)
        part = self.open
        assert part is not None
        part.pieces.append(piece)
        steps.append((PIECE, part, piece))

    # --- reading ----------------------------------------------------------------------------

    def joined(self, kind: Kind) -> str:
        """All the text of one kind's parts, in order."""
        return "".join(p.text for p in self.parts if p.kind == kind)

    def calls(self) -> list[Part]:
        """The tool calls, by their index among the choice's calls."""
        return sorted((p for p in self.parts if p.kind == "call"), key=lambda p: p.call_index)


# --- deltas queued together, merged into one ----------------------------------------------------

ORDER = {"reasoning": 0, "text": 1, "calls": 2}  # the order in which `Transcript.feed` reads a delta's parts
NOTHING = (len(ORDER), -1)  # the span of a delta that says none of them (its tokens' logprobs only): it goes anywhere
TEXT = (ORDER["text"], ORDER["text"])
MERGEABLE = {*ORDER, "logprobs"}  # the extras a merge knows how to join


def span(delta: Delta) -> tuple[int, int] | None:
    """The first and last (in ORDER) of the parts a delta says. A delta can join the deltas before it
    when its first comes no earlier than their last: `feed` then reads the merged delta as it would
    read them in turn. None: it joins nothing and nothing joins it (an extra of another kind, or
    whitespace-only text, which `feed` holds back until it knows what follows)."""
    text, _, extra = delta
    if text.isspace():
        return None
    if not extra:  # the common case: plain answer text
        return TEXT if text else NOTHING
    if not extra.keys() <= MERGEABLE:
        return None
    said = [ORDER[k] for k in ORDER if (text if k == "text" else extra.get(k))]
    return (said[0], said[-1]) if said else NOTHING


def merged(run: list[Delta]) -> Delta:
    """Deltas that join (see `span`) as one: texts joined once, tokens summed, consecutive pieces of one
    call's arguments joined into one piece, logprobs in order."""
    text, tokens = "".join(d[0] for d in run), sum(d[1] for d in run)
    if not any(d[2] for d in run):
        return text, tokens, None
    calls: list[list] = []
    logprobs: list = []
    for _, _, extra in run:
        for piece in (extra or {}).get("calls") or []:
            if calls and not piece[1] and calls[-1][0] == piece[0]:
                calls[-1][3].append(piece[3])
            else:
                calls.append([piece[0], piece[1], piece[2], [piece[3]]])
        logprobs.extend((extra or {}).get("logprobs") or [])
    extras: dict = {}
    if reasoning := "".join(d[2].get("reasoning") or "" for d in run if d[2]):
        extras["reasoning"] = reasoning
    if calls:
        extras["calls"] = [[index, call_id, name, "".join(args)] for index, call_id, name, args in calls]
    if logprobs:
        extras["logprobs"] = logprobs
    return text, tokens, extras or None
