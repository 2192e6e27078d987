"""Ollama's response shapes for /api/chat and /api/generate: the NDJSON lines of a stream and the
whole response, from the worker's typed deltas. Pure.

A chat line is `{"model", "created_at", "message": {"role": "assistant", "content", "thinking"?, "tool_calls"?},
"done": false}`; a generate line `{"model", "created_at", "response", "thinking"?, "done": false}`. A tool call is
said whole, its arguments an object, as Ollama says it: its pieces are gathered (transcript.py) and the call
written once its part stops. The last line (and a whole response) has `done: true`, `done_reason` ("stop",
"length", or "load"/"unload" for a request with nothing to generate) and the counts and durations, truthful and in
nanoseconds: `prompt_eval_count` is the prompt tokens prefilled (those read from the prompt caches are not:
an agent's next turn says only its new tokens), `eval_count` the tokens generated; `load_duration` the wait for
the model's worker, `prompt_eval_duration` from the submit to the first token, `eval_duration` from it to the end.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from protocol.messages import CONTEXT_WINDOW, Finished
from supervisor.gateway.ollama_models import now
from supervisor.gateway.transcript import STOP, Part, Transcript

if TYPE_CHECKING:
    from supervisor.gateway.call import Calls

NS = 1_000_000_000


def dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def done_reason(reason: str | None) -> str:
    return "length" if reason in ("length", CONTEXT_WINDOW) else "stop"


def _call(part: Part) -> dict:
    try:
        args = json.loads(part.text) if part.text.strip() else {}
    except ValueError:
        args = {"_raw": part.text}  # never a lost call: what the model wrote, if it is no JSON object
    if not isinstance(args, dict):
        args = {"_value": args}
    return {"function": {"index": part.call_index, "name": part.name, "arguments": args}}


class Timing:
    """A request's clock: its arrival, the worker ready (the load's end), the first token, the end."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.loaded = self.t0
        self.calls: Calls | None = None  # a generation's Calls: its first call's lease time is the load's end

    def durations(self, fin: Finished | None, t_first: float | None) -> dict:
        end = time.monotonic()
        if self.calls is not None and self.calls.calls[0].t_leased is not None:
            self.loaded = self.calls.calls[0].t_leased
        first = t_first if t_first is not None else end
        out = {"total_duration": int((end - self.t0) * NS), "load_duration": int((self.loaded - self.t0) * NS)}
        if fin is not None:
            out.update(prompt_eval_count=max(0, fin.prompt_tokens - fin.cached_tokens),
                       prompt_eval_duration=int(max(0.0, first - self.loaded) * NS),
                       eval_count=fin.completion_tokens, eval_duration=int(max(0.0, end - first) * NS))
        return out


class OllamaShaper:
    """One chat or generate response's lines, streamed or whole."""

    def __init__(self, model: str, chat: bool, logprobs: bool = False) -> None:
        self.model = model
        self.chat = chat
        self.logprobs = logprobs
        self.said = Transcript()

    def _line(self, text: str, thinking: str, calls: list[dict], logprobs: list, done: bool) -> dict:
        out: dict = {"model": self.model, "created_at": now()}
        if self.chat:
            message: dict = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            out["message"] = message
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        if self.logprobs and logprobs:
            out["logprobs"] = [{"token": tok, "logprob": lp, "top_logprobs": [{"token": t, "logprob": p}
                                                                             for t, p in top]}
                               for tok, lp, top in logprobs]
        out["done"] = done
        return out

    def feed(self, text: str, extra: dict | None) -> dict | None:
        """A delta's line; None when it says nothing yet (a tool call's pieces are held until it stops)."""
        steps = self.said.feed(text, extra)
        calls = [_call(part) for kind, part, _ in steps if kind == STOP and part.kind == "call"]
        thinking = (extra or {}).get("reasoning") or ""
        logprobs = (extra or {}).get("logprobs") or []
        if not (text or thinking or calls or (self.logprobs and logprobs)):
            return None
        return self._line(text, thinking, calls, logprobs, False)

    def last(self, fin: Finished, durations: dict) -> list[dict]:
        """The end: a line with the finish's last delta (and any call it closes), then the done line."""
        lines = []
        if (line := self.feed(fin.text, fin.extra)) is not None:
            lines.append(line)
        calls = [_call(part) for kind, part, _ in self.said.close() if kind == STOP and part.kind == "call"]
        if calls:
            lines.append(self._line("", "", calls, [], False))
        done = self._line("", "", [], [], True)
        done.update(done_reason=done_reason(fin.finish_reason), **durations)
        return [*lines, done]

    def whole(self, fin: Finished, durations: dict) -> dict:
        """The whole response from what was fed (streamed=False)."""
        self.said.close()
        calls = [_call(p) for p in self.said.calls()]
        out = self._line("".join(self.said.answer), self.said.joined("reasoning"), calls, self.said.logprobs, True)
        out.update(done_reason=done_reason(fin.finish_reason), **durations)
        return out

    def nothing(self, reason: str, durations: dict) -> dict:
        """A request with nothing to generate: the model loaded (or unloaded)."""
        out = self._line("", "", [], [], True)
        out.update(done_reason=reason, **durations)
        return out
