"""Split a model's output text into answer, reasoning and tool calls, as it streams. Pure: no MLX.

A parser is fed the text deltas of one request (worker/textstream.py's output, with the format's
markers left in) and returns typed deltas (`Out`): answer text, reasoning text and tool-call
pieces [index, id, name, arguments_piece] (id and name only in a call's first piece). Two formats:
- `MarkupParser`: reasoning between think markers (`<think>`...`</think>`, the tokenizer's
  think_start/think_end) and calls between tool markers (mlx-lm's `tool_call_start`/`tool_call_end`),
  each call's text parsed by mlx-lm's tool parser for the family. Calls written as
  {"name": ..., "arguments": {...}} JSON (Qwen3) stream their arguments as they come; other
  formats give a call's arguments in one piece when the call closes.
- `HarmonyParser`: gpt-oss's harmony messages (`<|channel|>analysis|commentary|final`, a
  recipient `to=functions.NAME` for a call, bodies closed by `<|end|>`, `<|call|>`, `<|return|>`).
  Hand-written: openai-harmony parses token ids of its own o200k_harmony encoding (which it
  downloads), not text of any other tokenizer.

Invariants: feeding a text whole or split at any character boundary gives the same joined deltas
(text that may be the start of a marker is held back until it is decided); markup never reaches
the answer or the reasoning, except a call that fails to parse, whose text is returned as answer
text rather than lost; `finish()` releases whatever is still held.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Out:
    content: str = ""
    reasoning: str = ""
    calls: list[list] = field(default_factory=list)  # [index, id | "", name | "", arguments_piece]

    def extend(self, other: Out) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.calls.extend(other.calls)


class OutputParser(Protocol):
    calls_made: int

    def feed(self, text: str) -> Out: ...

    def finish(self) -> Out: ...


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def partial_suffix(text: str, markers: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    longest = min(len(text), max((len(m) for m in markers), default=1) - 1)
    for k in range(longest, 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


def arguments_json(args: Any) -> str:
    """A call's arguments as OpenAI sends them: a JSON string (an object already a string stays as written)."""
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class PlainParser:
    """No markup in this format: all text is answer."""

    calls_made = 0

    def feed(self, text: str) -> Out:
        return Out(content=text)

    def finish(self) -> Out:
        return Out()


@dataclass(frozen=True)
class ToolFormat:
    start: str
    end: str
    parse: Callable[[str], Any]  # the call's text (between the markers) -> {"name", "arguments"} or a list of them
    json_call: bool = False  # {"name": ..., "arguments": ...}: the arguments can stream


# The head of a JSON call, up to its arguments' first character (so a split inside the whitespace before
# them cannot change where they start).
_JSON_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
CONTENT, REASONING, TOOL = "content", "reasoning", "tool"


class MarkupParser:
    def __init__(self, think: tuple[str, str] | None = None, in_think: bool = False, tool: ToolFormat | None = None,
                 call_id: Callable[[], str] = new_call_id) -> None:
        self.think = think
        self.tool = tool
        self.call_id = call_id
        self.state = REASONING if think and in_think else CONTENT
        self.calls_made = 0
        self._buf = ""
        self._strip_lead = self.state == REASONING  # the newline after a marker is the format's, not the text's
        self._head: re.Match | None = None  # a JSON call's head, once seen: its arguments stream
        self._released = 0  # of the streaming call's arguments

    def _openers(self) -> list[str]:
        return [m for m in ((self.think[0] if self.think else None), (self.tool.start if self.tool else None)) if m]

    def feed(self, text: str) -> Out:
        self._buf += text
        out = Out()
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> Out:
        out = Out()
        while self._step(out, final=True):
            pass
        if self.state == TOOL:
            self._close_call(self._buf, out, complete=False)
        elif self._buf:
            self._emit(self._buf, out)
        self._buf = ""
        return out

    def _emit(self, text: str, out: Out) -> None:
        if self._strip_lead:
            text = text.lstrip("\n")
            if not text:
                return
            self._strip_lead = False
        if self.state == REASONING:
            out.reasoning += text
        else:
            out.content += text

    def _step(self, out: Out, final: bool) -> bool:
        """Act on the buffer once; True while there may be more to do."""
        if self.state == TOOL:
            return self._step_tool(out, final)
        closer = [self.think[1]] if self.state == REASONING and self.think else []
        markers = closer or self._openers()
        hits = [(i, m) for m in markers if (i := self._buf.find(m)) >= 0]
        if hits:
            i, marker = min(hits)
            before = self._buf[:i]
            self._buf = self._buf[i + len(marker):]
            if self.state == REASONING:
                self._emit(before.rstrip("\n"), out)
                self.state, self._strip_lead = CONTENT, True
            elif self.think and marker == self.think[0]:
                self._emit(before, out)
                self.state, self._strip_lead = REASONING, True
            else:
                self._emit(before.rstrip("\n"), out)
                self.state, self._head, self._released = TOOL, None, 0
            return True
        if final:
            return False
        held = self._buf[:len(self._buf) - partial_suffix(self._buf, markers)]
        text = held.rstrip("\n")  # newlines before a marker belong to the format: held until text follows
        if text:
            self._emit(text, out)
            self._buf = self._buf[len(text):]
        return False

    def _step_tool(self, out: Out, final: bool) -> bool:
        assert self.tool is not None
        i = self._buf.find(self.tool.end)
        if i >= 0:
            text, self._buf = self._buf[:i], self._buf[i + len(self.tool.end):]
            self._close_call(text, out, complete=True)
            self.state, self._strip_lead = CONTENT, True
            return True
        if final or not self.tool.json_call:
            return False
        if self._head is None and not self._match_head(self._buf, out):
            return False
        assert self._head is not None
        args = self._buf[self._head.end():]
        cut = len(args) - partial_suffix(args, [self.tool.end])
        last_brace = args.rfind("}", 0, cut)
        cut = last_brace if last_brace >= 0 else cut  # the last '}' may close the call's outer object
        if cut > self._released:
            out.calls.append([self.calls_made, "", "", args[self._released:cut]])
            self._released = cut
        return False

    def _match_head(self, text: str, out: Out) -> bool:
        """A JSON call's head ({"name": "...", "arguments": ): the call starts, its arguments stream."""
        head = _JSON_CALL_HEAD.match(text)
        if head is None:
            return False
        try:
            name = json.loads(f'"{head.group(1)}"')
        except ValueError:
            return False
        self._head, self._released = head, 0
        out.calls.append([self.calls_made, self.call_id(), name, ""])
        return True

    def _close_call(self, text: str, out: Out, complete: bool) -> None:
        assert self.tool is not None
        if self._head is None and self.tool.json_call:
            self._match_head(text, out)
        if self._head is not None:  # streamed: the rest of the arguments, less the outer object's '}'
            args = text[self._head.end():].rstrip()
            if complete and args.endswith("}"):
                args = args[:-1].rstrip()
            if len(args) > self._released:
                out.calls.append([self.calls_made, "", "", args[self._released:]])
            self.calls_made += 1
            self._head = None
            return
        calls = self._parse(text) if complete else None
        if calls is None:  # not a call after all: its text is answer, not lost
            saved, self.state = self.state, CONTENT
            self._emit(self.tool.start + text + (self.tool.end if complete else ""), out)
            self.state = saved
            return
        for call in calls:
            out.calls.append([self.calls_made, self.call_id(), call["name"], arguments_json(call.get("arguments", {}))])
            self.calls_made += 1

    def _parse(self, text: str) -> list[dict] | None:
        assert self.tool is not None
        try:
            parsed = self.tool.parse(text)
        except Exception:  # mlx-lm's parsers raise what their format's decoder raises
            return None
        calls = parsed if isinstance(parsed, list) else [parsed]
        if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
            return None
        return calls


# --- harmony (gpt-oss) ---------------------------------------------------------------------

HARMONY_MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"]
_BODY_ENDS = ["<|end|>", "<|call|>", "<|return|>", "<|start|>"]
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


class HarmonyParser:
    """Harmony messages: a header (role, `<|channel|>NAME`, maybe `to=functions.NAME` and a
    `<|constrain|>` type) up to `<|message|>`, then the body up to `<|end|>`/`<|call|>`/`<|return|>`.
    analysis -> reasoning; a body addressed to functions.NAME -> a call, its body the arguments;
    final and the rest -> answer. The generation prompt ends at `<|start|>assistant`, so output opens
    with a header."""

    def __init__(self, call_id: Callable[[], str] = new_call_id) -> None:
        self.call_id = call_id
        self.calls_made = 0
        self._buf = ""
        self._in_body = False
        self._kind = CONTENT
        self._headers_seen = False

    def feed(self, text: str) -> Out:
        self._buf += text
        out = Out()
        while self._step(out):
            pass
        return out

    def finish(self) -> Out:
        out = Out()
        if self._in_body:
            self._body(self._buf, out)
            self._end_body()
        elif self._buf and not self._headers_seen:  # no harmony at all: the text is the answer
            out.content += self._buf
        self._buf = ""
        return out

    def _step(self, out: Out) -> bool:
        if not self._in_body:
            i = self._buf.find("<|message|>")
            if i < 0:
                return False
            self._open(self._buf[:i], out)
            self._buf = self._buf[i + len("<|message|>"):]
            return True
        hits = [(i, m) for m in _BODY_ENDS if (i := self._buf.find(m)) >= 0]
        if hits:
            i, marker = min(hits)
            self._body(self._buf[:i], out)
            self._end_body()
            self._buf = self._buf[i + (len(marker) if marker != "<|start|>" else 0):]
            return True
        keep = len(self._buf) - partial_suffix(self._buf, HARMONY_MARKERS)
        self._body(self._buf[:keep], out)
        self._buf = self._buf[keep:]
        return False

    def _open(self, header: str, out: Out) -> None:
        self._headers_seen = True
        self._in_body = True
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient and recipient.group(1).startswith("functions."):
            self._kind = TOOL
            out.calls.append([self.calls_made, self.call_id(), recipient.group(1)[len("functions."):], ""])
        elif channel and channel.group(1) == "analysis":
            self._kind = REASONING
        else:
            self._kind = CONTENT

    def _body(self, text: str, out: Out) -> None:
        if not text:
            return
        if self._kind == TOOL:
            out.calls.append([self.calls_made, "", "", text])
        elif self._kind == REASONING:
            out.reasoning += text
        else:
            out.content += text

    def _end_body(self) -> None:
        if self._kind == TOOL:
            self.calls_made += 1
        self._in_body = False
        self._kind = CONTENT
