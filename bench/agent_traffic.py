"""Recorded coding-agent traffic (tests/fixtures/agent_traffic/<program>.jsonl): reading it, and each request as
the worker sees it.

A fixture holds one JSON line per request a program sent during a scripted session (made by
tests/tools/record_agent_traffic.py): `i` (order in the session), `path` (the endpoint), `body` (the request body,
machine-specific values normalised), `marker` (the script step this request answered, None for a request no step
matched) and `reply` (the raw qwen3 text the scripted model answered it with).

`submit_of` turns a body into the Submit the gateway would send (its own pure parsers), so that a bench can
tokenize it exactly as the worker does, without a daemon.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from protocol.messages import Submit
from supervisor.gateway.anthropic_api import parse_messages
from supervisor.gateway.openai_api import parse_chat
from supervisor.gateway.responses_api import parse_responses

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "agent_traffic"
PROGRAMS = ("claude", "codex", "opencode")


@dataclass
class Recorded:
    i: int
    path: str
    body: dict
    marker: str | None
    reply: str | None


def load(program: str, root: Path = FIXTURES) -> list[Recorded]:
    lines = (root / f"{program}.jsonl").read_text().splitlines()
    return [Recorded(**json.loads(line)) for line in lines if line.strip()]


def submit_of(path: str, body: dict) -> Submit:
    """The Submit the gateway makes of `body` sent to `path` (no stored history: agents send it all)."""
    endpoint = path.split("?")[0]
    if endpoint == "/v1/messages":
        return parse_messages(body).submit
    if endpoint == "/v1/chat/completions":
        return parse_chat(body).submit
    if endpoint == "/v1/responses":
        return parse_responses(body, lambda rid: []).parsed.submit
    raise ValueError(f"no parser for {path}")
