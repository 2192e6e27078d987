"""OpenAI Responses shapes: the `response` object, its output items and the stream's events. Pure.

The worker's typed deltas become output items in order: `reasoning` (its text as reasoning_text),
`message` (one `output_text` part), `function_call` (call_id, name, arguments as a JSON string,
streamed as `response.function_call_arguments.delta`). One `ResponseShaper` writes both the events
and the whole response from the same deltas, so they say the same. Invariants: every event has the
next `sequence_number`; an item is `added` before its deltas and `done` before the next item is
added; whitespace-only text (the blank line between a thought and a call) makes no message item; a
stream ends with `response.completed` (or `response.incomplete` at max_output_tokens), or with
`error` and `response.failed`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from protocol.messages import Finished
from supervisor.errors import MlxsupError


def sse_event(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()


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
        self.items: list[dict] = []
        self._open: int | None = None
        self._blank = ""
        self._seq = 0

    def _event(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def response(self, status: str, fin: Finished | None = None, error: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": error,
                "incomplete_details": incomplete, "model": self.model,
                "output": [self._public(i) for i in self.items] if status != "in_progress" else [],
                "usage": usage(fin) if fin else None, "user": None, **self.echo}

    @staticmethod
    def _public(item: dict) -> dict:
        item = {k: v for k, v in item.items() if not k.startswith("_")}
        if item["type"] == "message":
            item["content"] = [{"type": "output_text", "text": item.pop("text"), "annotations": [], "logprobs": []}]
        elif item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": item.pop("text")}]
        return item

    # --- events -------------------------------------------------------------------------------

    def start(self) -> list[dict]:
        response = self.response("in_progress")
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        item = self.items[index]
        item["status"] = "completed"
        public = self._public(item)
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            events = [self._event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=item["arguments"])]
        else:
            part = public["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            events = [self._event(f"response.{kind}.done", **where, content_index=0, text=part["text"]),
                      self._event("response.content_part.done", **where, content_index=0, part=part)]
        return events + [self._event("response.output_item.done", output_index=index, item=public)]

    def _begin(self, item: dict) -> list[dict]:
        events = self._close()
        self.items.append(item)
        self._open = len(self.items) - 1
        public = self._public(item)
        events.append(self._event("response.output_item.added", output_index=self._open, item=public))
        if item["type"] != "function_call":
            part = {**public["content"][0], "text": ""}
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=self._open,
                                      content_index=0, part=part))
        return events

    def _append(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open is None or self.items[self._open]["type"] != kind:
            fresh: dict[str, Any] = {"type": kind, "id": _item_id("rs" if kind == "reasoning" else "msg"),
                                     "status": "in_progress", "text": ""}
            if kind == "reasoning":
                fresh["summary"] = []
            else:
                fresh["role"] = "assistant"
            events += self._begin(fresh)
        item = self.items[self._open]  # type: ignore[index]
        item["text"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra: dict[str, list] = {"logprobs": []} if kind == "message" else {}
        return events + [self._event(name, item_id=item["id"], output_index=self._open, content_index=0,
                                     delta=text, **extra)]

    def feed(self, text: str, extra: dict | None) -> list[dict]:
        events: list[dict] = []
        extra = extra or {}
        if extra.get("reasoning"):
            events += self._append("reasoning", extra["reasoning"])
        if text:
            text, self._blank = self._blank + text, ""
            if text.strip():
                events += self._append("message", text)
            else:
                self._blank = text
        for _, call_id, name, args in extra.get("calls") or []:
            if call_id:
                self._blank = ""
                events += self._begin({"type": "function_call", "id": _item_id("fc"), "call_id": call_id,
                                       "name": name, "arguments": "", "status": "in_progress"})
            item = self.items[self._open] if self._open is not None else None
            if item is None or item["type"] != "function_call" or not args:
                continue
            item["arguments"] += args
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self._open, delta=args))
        return events

    def status(self, fin: Finished) -> str:
        return "incomplete" if fin.finish_reason == "length" else "completed"

    def finish(self, fin: Finished) -> list[dict]:
        status = self.status(fin)
        return self._close() + [self._event(f"response.{status}", response=self.response(status, fin))]

    def failed(self, exc: MlxsupError) -> list[dict]:
        error = {"code": "server_error", "message": exc.message}
        return [self._event("error", code=exc.code, message=exc.message, param=None),
                self._event("response.failed", response=self.response("failed", error=error))]

    def whole(self, fin: Finished) -> dict:
        self._close()
        return self.response(self.status(fin), fin)

    def turn(self) -> dict:
        """The response's output as the assistant's chat message, for a follow-up's conversation."""
        message: dict = {"role": "assistant", "content": ""}
        for item in self.items:
            if item["type"] == "message":
                message["content"] += item["text"]
            elif item["type"] == "reasoning":
                message["reasoning_content"] = message.get("reasoning_content", "") + item["text"]
            else:
                message.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}})
        return message
