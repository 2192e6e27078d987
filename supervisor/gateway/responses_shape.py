"""OpenAI Responses shapes: the `response` object, its output items and the stream's events. Pure.

The worker's typed deltas become output items in order: `reasoning` (its text as reasoning_text),
`message` (one `output_text` part), `function_call` (call_id, name, arguments as a JSON string,
streamed as `response.function_call_arguments.delta`). One `ResponseShaper` writes both the events
and the whole response from the same transcript (transcript.py: an item is one of its parts, added
before its deltas and done before the next is added; whitespace-only text makes none), so they say
the same. A stream that waits (queued, loading, prefilling, a slow step) gets `response.in_progress` again every keep-alive:
an event the API defines, which Codex counts as activity (SSE comments it does not).
Invariants: every event has the next `sequence_number`; a stream ends with `response.completed` (or `response.incomplete` at max_output_tokens), or with
`error` and `response.failed`. The context window ending a request (its output limit clamped to it) is
`incomplete` with reason `max_output_tokens` too, as OpenAI reports it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from protocol.messages import CONTEXT_WINDOW, Finished
from supervisor.errors import MlxsupError
from supervisor.gateway.transcript import PIECE, START, Part, Step, Transcript

TAGS = {"reasoning": "rs", "text": "msg", "call": "fc"}  # a transcript part's item id prefix


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def usage(fin: Finished) -> dict:
    return {"input_tokens": fin.prompt_tokens, "input_tokens_details": {"cached_tokens": fin.cached_tokens},
            "output_tokens": fin.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": fin.prompt_tokens + fin.completion_tokens}


class ResponseShaper:
    def __init__(self, response_id: str, model: str, echo: dict) -> None:
        self.id = response_id
        self.model = model
        self.echo = echo
        self.created = int(time.time())
        self.said = Transcript()
        self._seq = 0

    def _event(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def response(self, status: str, fin: Finished | None = None, error: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": error,
                "incomplete_details": incomplete, "model": self.model,
                "output": [self._item(p) for p in self.said.parts] if status != "in_progress" else [],
                "usage": usage(fin) if fin else None, "user": None, **self.echo}

    def _item(self, part: Part, status: str | None = None, text: str | None = None) -> dict:
        """A part as an output item; `text`: what its content says so far (all of it when None)."""
        status = status or ("in_progress" if part is self.said.open else "completed")
        text = part.text if text is None else text
        if part.kind == "call":
            return {"type": "function_call", "id": part.tag, "call_id": part.call_id, "name": part.name,
                    "arguments": text, "status": status}
        if part.kind == "reasoning":
            return {"type": "reasoning", "id": part.tag, "status": status, "summary": [],
                    "content": [{"type": "reasoning_text", "text": text}]}
        return {"type": "message", "id": part.tag, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    # --- events -------------------------------------------------------------------------------

    def start(self) -> list[dict]:
        response = self.response("in_progress")
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def in_progress(self) -> list[dict]:
        """A keep-alive while nothing else is said: `response.in_progress` again, with the next sequence number
        (its response says the status; the output so far is in the item events already sent)."""
        return [self._event("response.in_progress", response=self.response("in_progress"))]

    def _events(self, step: Step) -> list[dict]:
        what, part, piece = step
        where = {"item_id": part.tag, "output_index": part.index}
        if what == START:
            part.tag = _item_id(TAGS[part.kind])
            where["item_id"] = part.tag
            item = self._item(part, "in_progress", "")
            events = [self._event("response.output_item.added", output_index=part.index, item=item)]
            if part.kind != "call":
                events.append(self._event("response.content_part.added", **where, content_index=0,
                                          part=item["content"][0]))
            return events
        if what == PIECE:
            if part.kind == "call":
                return [self._event("response.function_call_arguments.delta", **where, delta=piece)]
            name = "response.output_text.delta" if part.kind == "text" else "response.reasoning_text.delta"
            extra: dict[str, list] = {"logprobs": []} if part.kind == "text" else {}
            return [self._event(name, **where, content_index=0, delta=piece, **extra)]
        item = self._item(part, "completed")
        if part.kind == "call":
            events = [self._event("response.function_call_arguments.done", **where, name=part.name,
                                  arguments=item["arguments"])]
        else:
            content = item["content"][0]
            kind = "output_text" if part.kind == "text" else "reasoning_text"
            events = [self._event(f"response.{kind}.done", **where, content_index=0, text=content["text"]),
                      self._event("response.content_part.done", **where, content_index=0, part=content)]
        return events + [self._event("response.output_item.done", output_index=part.index, item=item)]

    def feed(self, text: str, extra: dict | None) -> list[dict]:
        return [e for step in self.said.feed(text, extra) for e in self._events(step)]

    def status(self, fin: Finished) -> str:
        return "incomplete" if fin.finish_reason in ("length", CONTEXT_WINDOW) else "completed"

    def finish(self, fin: Finished) -> list[dict]:
        status = self.status(fin)
        closing = [e for step in self.said.close() for e in self._events(step)]
        return closing + [self._event(f"response.{status}", response=self.response(status, fin))]

    def failed(self, exc: MlxsupError) -> list[dict]:
        error = {"code": "server_error", "message": exc.message}
        return [self._event("error", code=exc.code, message=exc.message, param=None),
                self._event("response.failed", response=self.response("failed", error=error))]

    def whole(self, fin: Finished) -> dict:
        self.said.close()
        return self.response(self.status(fin), fin)

    def turn(self) -> dict:
        """The response's output as the assistant's chat message, for a follow-up's conversation."""
        message: dict = {"role": "assistant", "content": self.said.joined("text")}
        if reasoning := self.said.joined("reasoning"):
            message["reasoning_content"] = reasoning
        calls = [{"id": p.call_id, "type": "function", "function": {"name": p.name, "arguments": p.text}}
                 for p in self.said.parts if p.kind == "call"]
        if calls:
            message["tool_calls"] = calls
        return message
