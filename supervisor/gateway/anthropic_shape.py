"""Anthropic Messages response shapes: the whole `message` and the stream's events. Pure.

The worker's typed deltas (answer text; reasoning and tool-call pieces in a chunk's extras, as for
the chat API) become content blocks: `thinking`, `text`, `tool_use` (its input streamed as
`input_json_delta` pieces, an object in the whole message). One `MessageShaper` builds both the
events and the whole message from the same deltas, so a stream and a whole response say the same.
Invariants: a block is started before its deltas and stopped before the next starts; text that is
only whitespace (the blank line between a thought and a call) opens no block; `usage.input_tokens`
counts the prompt tokens not read from the prompt caches, `cache_read_input_tokens` those that were.
"""

from __future__ import annotations

import json
from typing import Any

from protocol.messages import Finished

STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


def sse_event(event: dict) -> bytes:
    """An event as Anthropic writes it: its type as the SSE event name, the object as data."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()


def stop_reason(fin: Finished) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished generation."""
    hit = (fin.extra or {}).get("stop_sequence")
    if fin.finish_reason == "stop" and isinstance(hit, str):
        return "stop_sequence", hit
    return STOP_REASONS.get(fin.finish_reason, "end_turn"), None


def usage(fin: Finished | None) -> dict:
    prompt = fin.prompt_tokens if fin else 0
    cached = min(fin.cached_tokens, prompt) if fin else 0
    return {"input_tokens": prompt - cached, "output_tokens": fin.completion_tokens if fin else 0,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _tool_input(arguments: str) -> Any:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageShaper:
    """One response's content blocks, as stream events (`feed`, `finish`) and as the whole `message`."""

    def __init__(self, message_id: str, model: str) -> None:
        self.id = message_id
        self.model = model
        self.blocks: list[dict] = []
        self._open: int | None = None  # index of the block being written
        self._blank = ""  # whitespace held until text that is not

    def _envelope(self, content: list, fin: Finished | None) -> dict:
        reason, sequence = stop_reason(fin) if fin else (None, None)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence, "usage": usage(fin)}

    def start(self) -> list[dict]:
        return [{"type": "message_start", "message": self._envelope([], None)}, {"type": "ping"}]

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        return [{"type": "content_block_stop", "index": index}]

    def _begin(self, block: dict) -> list[dict]:
        events = self._close()
        self.blocks.append(block)
        self._open = len(self.blocks) - 1
        start = {k: ({} if k == "input" else v) for k, v in block.items() if not k.startswith("_")}
        if block["type"] in ("text", "thinking"):
            start[block["type"]] = ""
        return events + [{"type": "content_block_start", "index": self._open, "content_block": start}]

    def _append(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open is None or self.blocks[self._open]["type"] != kind:
            events += self._begin({"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})})
        self.blocks[self._open][kind] += text  # type: ignore[index]
        delta = {"type": f"{kind}_delta", kind: text}
        return events + [{"type": "content_block_delta", "index": self._open, "delta": delta}]

    def feed(self, text: str, extra: dict | None) -> list[dict]:
        """The events of one delta: reasoning, then answer text, then tool-call pieces."""
        events: list[dict] = []
        extra = extra or {}
        if extra.get("reasoning"):
            events += self._append("thinking", extra["reasoning"])
        if text:
            text, self._blank = self._blank + text, ""
            if text.strip():
                events += self._append("text", text)
            else:
                self._blank = text
        for _, call_id, name, args in extra.get("calls") or []:
            if call_id:
                self._blank = ""
                events += self._begin({"type": "tool_use", "id": call_id, "name": name, "input": {}, "_args": ""})
            block = self.blocks[self._open] if self._open is not None else None
            if block is None or block["type"] != "tool_use" or not args:
                continue
            block["_args"] += args
            events.append({"type": "content_block_delta", "index": self._open,
                           "delta": {"type": "input_json_delta", "partial_json": args}})
        return events

    def finish(self, fin: Finished) -> list[dict]:
        reason, sequence = stop_reason(fin)
        return self._close() + [
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
             "usage": usage(fin)},
            {"type": "message_stop"}]

    def content(self) -> list[dict]:
        out = []
        for block in self.blocks:
            block = dict(block)
            if block["type"] == "tool_use":
                block["input"] = _tool_input(block.pop("_args"))
            out.append(block)
        return out

    def whole(self, fin: Finished) -> dict:
        return self._envelope(self.content(), fin)
