"""Turn one request's tokens into text deltas, honouring stop strings.

Invariants: a delta never splits a UTF-8 character (the streaming detokenizer only releases
whole characters); text that could still become the start of a stop string is held back
until it is either completed (generation stops, the stop string and what follows are cut)
or ruled out (it is released); special tokens (`skip`: padding, BOS, turn markers) are not
text and never reach it, though they still count as generated tokens.
"""

from __future__ import annotations

from typing import Protocol


class Detokenizer(Protocol):
    last_segment: str

    def add_token(self, token: int) -> None: ...

    def finalize(self) -> None: ...


class TextStream:
    def __init__(self, detokenizer: Detokenizer, stop: list[str], skip: frozenset[int] = frozenset()) -> None:
        self._detok = detokenizer
        self._skip = skip
        self._stop = [s for s in stop if s]
        self._pending = ""
        self.stopped = False
        self.stop_hit: str | None = None  # the stop string that ended the text

    def push(self, token: int) -> str:
        """Add a token; return the text that is now safe to emit. Sets `stopped` on a stop string."""
        if token in self._skip:
            return ""
        self._detok.add_token(token)
        self._pending += self._detok.last_segment
        return self._release(final=False)

    def flush(self) -> str:
        """End of generation: return whatever is still held back."""
        if self.stopped:
            return ""
        self._detok.finalize()
        self._pending += self._detok.last_segment
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        pending = self._pending
        if not self._stop:
            self._pending = ""
            return pending
        hits = [(i, s) for s in self._stop if (i := pending.find(s)) >= 0]
        if hits:
            at, self.stop_hit = min(hits)
            self.stopped = True
            self._pending = ""
            return pending[:at]
        hold = 0 if final else self._partial_stop_suffix(pending)
        cut = len(pending) - hold
        self._pending = pending[cut:]
        return pending[:cut]

    def _partial_stop_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = min(len(text), max(len(s) for s in self._stop) - 1)
        for k in range(longest, 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0
