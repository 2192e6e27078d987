"""OpenAI response shapes: chat and completion, streamed chunks and whole responses. Pure.

The worker sends typed deltas (answer text, and in a chunk's extras: reasoning, tool-call pieces,
logprobs); this module writes them in OpenAI's shapes: `delta.content`, `delta.reasoning_content`,
`delta.tool_calls` (index, id and name first, then arguments in pieces), `logprobs.content`, and
the whole `message` from the same deltas' transcript (transcript.py), so a streamed and a whole
response say the same.
Invariant: tool-call markup never reaches `content` (the worker's parser removed it); a choice
that made calls finishes with "tool_calls"; one the context window ended (max_tokens clamped to it) with
"length", as one max_tokens ended.
"""

from __future__ import annotations

import time

from protocol.messages import CONTEXT_WINDOW, Finished
from supervisor.gateway.openai_api import Parsed
from supervisor.gateway.transcript import Transcript


def usage(finished: list[Finished], per_prompt: int = 1) -> dict:
    """Usage of all choices: each prompt counted once (its n choices share it), every completion token."""
    prompt = sum(f.prompt_tokens for f in finished[::per_prompt])
    completion = sum(f.completion_tokens for f in finished)
    cached = max((f.cached_tokens for f in finished), default=0)
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": cached}}
    drafted, accepted = sum(f.drafted_tokens for f in finished), sum(f.accepted_tokens for f in finished)
    if drafted:  # speculative decoding, in the names OpenAI gives predicted outputs' tokens
        out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                            "rejected_prediction_tokens": drafted - accepted}
    return out


def openai_reason(reason: str | None) -> str | None:
    """The API's finish_reason of the worker's: OpenAI's "length" says the context ended it too."""
    return "length" if reason == CONTEXT_WINDOW else reason


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", "surrogatepass"))


class Shaper:
    """Builds the response objects of one request, chat or completion, streamed or whole."""

    def __init__(self, parsed: Parsed, model: str) -> None:
        self.chat = parsed.submit.messages is not None
        self.id = parsed.submit.rid
        self.model = model
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"
        self.want_logprobs = parsed.logprobs
        self.per_prompt = parsed.n
        self._offsets: dict[int, int] = {}  # a streamed completion choice's text so far, for logprobs' text_offset

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    # --- logprobs --------------------------------------------------------------------------

    def _chat_logprobs(self, entries: list[list]) -> dict | None:
        if not self.want_logprobs:
            return None
        content = [{"token": tok, "logprob": lp, "bytes": _bytes(tok),
                    "top_logprobs": [{"token": t, "logprob": p, "bytes": _bytes(t)} for t, p in top]}
                   for tok, lp, top in entries]
        return {"content": content, "refusal": None}

    def _completion_logprobs(self, entries: list[list], offset: int = 0) -> dict | None:
        if not self.want_logprobs:
            return None
        offsets, at = [], offset
        for tok, _, _ in entries:
            offsets.append(at)
            at += len(tok)
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [dict(e[2]) for e in entries], "text_offset": offsets}

    # --- streamed --------------------------------------------------------------------------

    def chunk(self, index: int, text: str, extra: dict | None = None, first: bool = False,
              finish_reason: str | None = None) -> dict:
        entries = (extra or {}).get("logprobs") or []
        if not self.chat:
            offset = self._offsets.get(index, 0)
            self._offsets[index] = offset + sum(len(e[0]) for e in entries)
            choice = {"index": index, "text": text,
                      "logprobs": self._completion_logprobs(entries, offset) if entries else None,
                      "finish_reason": openai_reason(finish_reason)}
            return self._envelope("text_completion", [choice])
        delta: dict = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        if extra and extra.get("reasoning"):
            delta["reasoning_content"] = extra["reasoning"]
        calls = []
        for call_index, call_id, name, args in (extra or {}).get("calls") or []:
            piece: dict = {"index": call_index, "function": {"arguments": args}}
            if call_id:
                piece = {"index": call_index, "id": call_id, "type": "function",
                         "function": {"name": name, "arguments": args}}
            calls.append(piece)
        if calls:
            delta["tool_calls"] = calls
        choice = {"index": index, "delta": delta, "logprobs": self._chat_logprobs(entries) if entries else None,
                  "finish_reason": openai_reason(finish_reason)}
        return self._envelope("chat.completion.chunk", [choice])

    def has_delta(self, text: str, extra: dict | None) -> bool:
        return bool(text or (extra and (extra.get("reasoning") or extra.get("calls") or extra.get("logprobs"))))

    def usage_chunk(self, finished: list[Finished]) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage(finished, self.per_prompt)}

    # --- whole -----------------------------------------------------------------------------

    def whole(self, said: list[Transcript], finished: list[Finished]) -> dict:
        choices = []
        for index, (choice, fin) in enumerate(zip(said, finished)):
            text = "".join(choice.answer)
            if not self.chat:
                choices.append({"index": index, "text": text, "logprobs": self._completion_logprobs(choice.logprobs),
                                "finish_reason": openai_reason(fin.finish_reason)})
                continue
            calls = [{"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.text}}
                     for c in choice.calls()]
            message: dict = {"role": "assistant", "content": text if text or not calls else None}
            if reasoning := choice.joined("reasoning"):
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = calls
            choices.append({"index": index, "message": message, "logprobs": self._chat_logprobs(choice.logprobs),
                            "finish_reason": openai_reason(fin.finish_reason)})
        return {**self._envelope(self.object, choices), "usage": usage(finished, self.per_prompt)}
