"""Test-only scripted replies: a worker that answers chat requests from a script, as a model would.

Random test weights never choose to call a tool, so an agent's whole tool loop cannot be tested
against them. Started with `--script FILE` (a testing flag, like `--fault`: worker/faults.py), a
worker looks each chat request up in the script and, on a match, forces the scripted reply's
tokens one by one: the real model still runs every step, and each token still goes through the
real sampler, output parser and streaming path; only the choice is made for it.

The script is a JSON list of entries `{"match": SUBSTRING, "reply": TEXT}`. A request matches the
first entry whose substring occurs in the text of its latest turn (the user and tool messages after
the last assistant message). The reply is raw model output, in the family's own markup (qwen3:
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`), tokenized by the model's tokenizer
and followed by EOS unless it already ends in one.

The test wires it in: `install` (called at startup by worker/__main__.py when `--script` is given) adds the
script as a hook of the chat engine's decoding (decoding.py's `hooks`); no other code calls this module, and an
engine without the hook scripts nothing.

Invariants: a request that matches no entry, or is no chat, is generated freely; a scripted processor is the
last one applied (the hooks come after every other processor), so its token wins over penalties and grammars.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx

log = logging.getLogger(__name__)


class Script:
    """The script's entries, in order: (substring to match, raw reply text)."""

    def __init__(self, entries: list[tuple[str, str]]) -> None:
        self.entries = entries

    @classmethod
    def load(cls, path: Path) -> Script:
        raw = json.loads(path.read_text())
        if not isinstance(raw, list) or not all(isinstance(e, dict) and isinstance(e.get("match"), str)
                                                and isinstance(e.get("reply"), str) for e in raw):
            raise ValueError(f"{path}: a script is a list of {{\"match\": str, \"reply\": str}}")
        return cls([(e["match"], e["reply"]) for e in raw])

    def reply_for(self, messages: list[dict]) -> str | None:
        """The reply of the first entry matched by the latest turn's text; None when none matches."""
        turn = latest_turn_text(messages)
        return next((reply for match, reply in self.entries if match in turn), None)

    def processors(self, messages: list | None, tokenizer: Any, done: int = 0) -> list[ScriptedReply]:
        """The processor forcing this chat request's scripted reply, if an entry matches (`done`: tokens already
        generated, a resumed request's)."""
        reply = self.reply_for(messages) if messages is not None else None
        if reply is None:
            return []
        log.info("[script] reply=%r", reply[:80])
        return [ScriptedReply(reply_ids(tokenizer, reply), done)]


def latest_turn_text(messages: list[dict]) -> str:
    """The text of the user and tool messages after the last assistant message (a tool result may come with
    more user text in the same turn, as Claude Code sends it)."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    return "\n".join(text_of(m.get("content")) for m in messages[last + 1:] if m.get("role") in ("user", "tool"))


def text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(text_of(part.get("text") if isinstance(part, dict) else part) for part in content)
    return ""


class ScriptedReply:
    """A logits processor that forces `ids[n]` at its n-th call: every id but that one is masked to -inf.

    The forced logit is the model's own logits times zero, so the step's forward pass stays in the graph.
    Calls past the end force the last id (EOS) again. `done`: ids already generated (a resumed request's)."""

    def __init__(self, ids: list[int], done: int = 0) -> None:
        if not ids:
            raise ValueError("a scripted reply needs at least one token")
        self.ids = ids
        self.at = done

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        token = self.ids[min(self.at, len(self.ids) - 1)]
        self.at += 1
        chosen = mx.arange(logits.shape[-1]) == token
        return mx.where(chosen, logits * 0, mx.array(-mx.inf, dtype=logits.dtype))


def reply_ids(tokenizer, reply: str) -> list[int]:
    """The reply's token ids, as the model would have generated them, ending in EOS."""
    ids = list(tokenizer.encode(reply, add_special_tokens=False))
    eos = set(tokenizer.eos_token_ids)
    if not ids or ids[-1] not in eos:
        ids.append(tokenizer.eos_token_id if tokenizer.eos_token_id in eos else min(eos))
    return ids


def install(engine: Any, path: Path) -> bool:
    """Wire the script (from `--script`, a test's flag) into a chat engine: a hook of its decoding, so its matching
    requests get the forcing processor. False for an engine that decodes nothing (an embedding model's)."""
    decoding = getattr(engine, "decoding", None)
    if decoding is None:
        log.warning("[script] %s not installed: this engine generates no replies", path)
        return False
    script, tokenizer = Script.load(path), decoding.tokenizer
    decoding.hooks.append(lambda msg: script.processors(msg.messages, tokenizer, len(msg.resume_tokens)))
    log.warning("[script] replies scripted from %s (%d entries): for tests only", path, len(script.entries))
    return True
