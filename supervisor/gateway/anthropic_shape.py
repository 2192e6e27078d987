"""Anthropic Messages response shapes: the whole `message` and the stream's events. Pure.

The worker's typed deltas (answer text; reasoning and tool-call pieces in a chunk's extras, as for
the chat API) become content blocks: `thinking`, `text`, `tool_use` (its input streamed as
`input_json_delta` pieces, an object in the whole message). One `MessageShaper` writes both the
events and the whole message from the same transcript (transcript.py: a block is one of its parts,
started before its deltas and stopped before the next starts; whitespace-only text opens none), so
a stream and a whole response say the same. Invariant: usage splits the prompt as Anthropic's does,
`cache_read_input_tokens + cache_creation_input_tokens + input_tokens` = the prompt's tokens: read from the
worker's prompt caches, written to them (computed here, up to the request's last `cache_control` breakpoint, and
kept for later requests: Finished.cache_written), and the rest (past the last breakpoint, or all of the computed
tokens of a request that marks none: the caches keep those too, but a client is billed no cache write for them,
as on Anthropic's API).
"""

from __future__ import annotations

import json
from typing import Any

from protocol.messages import CONTEXT_WINDOW, Finished
from supervisor.gateway.transcript import START, STOP, Part, Step, Transcript

# the context window ending a request whose max_tokens it clamped: what Anthropic's API answers then
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", CONTEXT_WINDOW: "model_context_window_exceeded"}
BLOCKS = {"reasoning": "thinking", "text": "text", "call": "tool_use"}  # a transcript part's block type


def stop_reason(fin: Finished) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished generation."""
    hit = (fin.extra or {}).get("stop_sequence")
    if fin.finish_reason == "stop" and isinstance(hit, str):
        return "stop_sequence", hit
    return STOP_REASONS.get(fin.finish_reason, "end_turn"), None


def usage(fin: Finished | None) -> dict:
    prompt = fin.prompt_tokens if fin else 0
    cached = min(fin.cached_tokens, prompt) if fin else 0
    written = min(fin.cache_written, prompt - cached) if fin else 0
    return {"input_tokens": prompt - cached - written, "output_tokens": fin.completion_tokens if fin else 0,
            "cache_creation_input_tokens": written, "cache_read_input_tokens": cached}


def _tool_input(arguments: str) -> Any:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _block(part: Part, whole: bool) -> dict:
    """A part as a content block: empty as it starts, with its text (a call's input parsed) in the whole message."""
    kind = BLOCKS[part.kind]
    if part.kind == "call":
        return {"type": kind, "id": part.call_id, "name": part.name, "input": _tool_input(part.text) if whole else {}}
    block = {"type": kind, kind: part.text if whole else ""}
    if kind == "thinking":
        block["signature"] = ""
    return block


class MessageShaper:
    """One response's content blocks, as stream events (`feed`, `finish`) and as the whole `message`."""

    def __init__(self, message_id: str, model: str) -> None:
        self.id = message_id
        self.model = model
        self.said = Transcript()

    def _envelope(self, content: list, fin: Finished | None) -> dict:
        reason, sequence = stop_reason(fin) if fin else (None, None)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence, "usage": usage(fin)}

    def start(self) -> list[dict]:
        return [{"type": "message_start", "message": self._envelope([], None)}, {"type": "ping"}]

    @staticmethod
    def _event(step: Step) -> dict:
        what, part, piece = step
        if what == STOP:
            return {"type": "content_block_stop", "index": part.index}
        if what == START:
            return {"type": "content_block_start", "index": part.index, "content_block": _block(part, whole=False)}
        kind = BLOCKS[part.kind]
        delta = ({"type": "input_json_delta", "partial_json": piece} if part.kind == "call"
                 else {"type": f"{kind}_delta", kind: piece})
        return {"type": "content_block_delta", "index": part.index, "delta": delta}

    def feed(self, text: str, extra: dict | None) -> list[dict]:
        """The events of one delta: reasoning, then answer text, then tool-call pieces."""
        return [self._event(step) for step in self.said.feed(text, extra)]

    def finish(self, fin: Finished) -> list[dict]:
        reason, sequence = stop_reason(fin)
        return [self._event(step) for step in self.said.close()] + [
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
             "usage": usage(fin)},
            {"type": "message_stop"}]

    def content(self) -> list[dict]:
        return [_block(part, whole=True) for part in self.said.parts]

    def whole(self, fin: Finished) -> dict:
        return self._envelope(self.content(), fin)
