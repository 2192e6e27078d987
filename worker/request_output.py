"""One request's output, token by token: text (worker/textstream.py), then typed deltas (worker/output_parser.py),
then the chunks the worker sends. Pure: no MLX (the engine passes a function for a token's logprobs).

A chunk is [text, n_tokens] or [text, n_tokens, extras] (protocol.messages.Tokens): `text` is answer
text; extras hold reasoning, tool-call pieces and logprobs, present only when there are some. Invariants:
every token pushed counts once; a request that made a tool call and stopped on its own finishes with
"tool_calls"; logprobs come one entry per counted token, in order, whatever text the token released.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from worker.output_parser import Out, OutputParser
from worker.textstream import TextStream

LogprobEntry = list  # [token_text, logprob, [[alt_text, alt_logprob], ...]]


class RequestOutput:
    def __init__(self, text: TextStream, parser: OutputParser,
                 logprobs: Callable[[int, Any], LogprobEntry] | None = None) -> None:
        self.text = text
        self.parser = parser
        self._logprobs = logprobs
        self._pending = Out()
        self._entries: list[LogprobEntry] = []
        self._tokens = 0

    @property
    def stopped(self) -> bool:
        """A stop string ended the text."""
        return self.text.stopped

    @property
    def threadable(self) -> bool:
        """Its pushes may run on another thread (worker/text_thread.py): no logprobs, which read MLX arrays."""
        return self._logprobs is None

    def push(self, token: int, logprobs: Any = None) -> None:
        """One generated (counted) token and, when the request asked for them, its logprobs vector."""
        self._tokens += 1
        if self._logprobs is not None:
            self._entries.append(self._logprobs(token, logprobs))
        delta = self.text.push(token)
        if delta:
            self._pending.extend(self.parser.feed(delta))

    def replay(self, tokens: list[int]) -> None:
        """A resumed request's earlier tokens (their output was sent): through the text stream and the parser,
        so that what they hold back, and the parser's state, are what they were; nothing is said or counted."""
        for token in tokens:
            delta = self.text.push(token)
            if delta:
                self.parser.feed(delta)

    def take(self) -> list | None:
        """What the tokens pushed since the last take say, as a chunk; None when they say nothing yet."""
        chunk = self._chunk(self._pending)
        self._pending = Out()
        return chunk

    def finish(self, reason: str) -> tuple[str, dict | None, str]:
        """The end: (answer text, extras, finish reason) of what is still held."""
        tail = self._pending
        rest = self.text.flush()
        if rest:
            tail.extend(self.parser.feed(rest))
        tail.extend(self.parser.finish())
        self._pending = Out()
        chunk = self._chunk(tail, always=True)
        assert chunk is not None
        if self.parser.calls_made and reason == "stop":
            reason = "tool_calls"
        extra = chunk[2] if len(chunk) > 2 else None
        if self.text.stop_hit is not None:  # which stop string ended it (Anthropic's stop_sequence)
            extra = {**(extra or {}), "stop_sequence": self.text.stop_hit}
        return chunk[0], extra, reason

    def _chunk(self, out: Out, always: bool = False) -> list | None:
        extra: dict = {}
        if out.reasoning:
            extra["reasoning"] = out.reasoning
        if out.calls:
            extra["calls"] = out.calls
        if self._entries:
            extra["logprobs"] = self._entries
            self._entries = []
        n, self._tokens = self._tokens, 0
        if not (out.content or extra or always):
            self._tokens = n  # nothing to say yet: the tokens count with the next chunk
            return None
        return [out.content, n, extra] if extra else [out.content, n]
