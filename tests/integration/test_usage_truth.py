"""Issue 34: a request's reported usage is the worker's own count, on every API (OpenAI chat, Anthropic messages,
Responses), for a cold request and for a second turn that extends the first.

The worker's count is what its engine logs when a request finishes (`[usage] rid=... prompt= cached= prefilled=`,
prefilled counted from the generator's own progress, worker/mlx_engine/engine.py) and the hot cache's hit
tokens in /api/status. Anthropic's three input fields add up to the prompt: read, written (the worker keeps
every prompt token it computed: a plain-KV model with the hot cache on) and the rest.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Daemon, start_daemon, wait_for

USAGE_LINE = re.compile(r"\[usage\] rid=(\S+) prompt=(\d+) cached=(\d+) prefilled=(\d+)")


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("usage")
    config = root / "c.toml"
    config.write_text(f'[models.tiny]\npath = "{model_dir / "tiny"}"\n\n[cache]\nssd = false\n')
    d = start_daemon(root / "state", "--config", str(config))
    yield d
    assert d.stop() == 0


def worker_count(d: Daemon, rid: str) -> dict:
    """What the worker logged for request `rid` as it finished."""
    def logged() -> dict | None:
        for m in USAGE_LINE.finditer((d.state_dir / "daemon.log").read_text(errors="replace")):
            if m[1] == rid:
                return {"prompt": int(m[2]), "cached": int(m[3]), "prefilled": int(m[4])}
        return None
    return wait_for(logged, 30, what=f"the worker's usage line for {rid}")  # type: ignore[return-value]


def hit_tokens(d: Daemon) -> int:
    cache = d.model("tiny")["cache"]  # None before the worker's first heartbeat
    return cache["hot"]["hit_tokens"] if cache else 0


def system(seed: int) -> str:
    return f"Rules {seed}: " + " ".join(f"rule{(seed * 7919 + i * 104729) % 9973} holds" for i in range(60))


def chat(d: Daemon, turns: list[dict]) -> tuple[str, str, dict]:
    body = {"model": "tiny", "messages": turns, "max_tokens": 12, "temperature": 0}
    out = httpx.post(d.v1 + "/chat/completions", json=body, timeout=120).json()
    u = out["usage"]
    return out["id"], out["choices"][0]["message"]["content"] or "x", \
        {"prompt": u["prompt_tokens"], "cached": u["prompt_tokens_details"]["cached_tokens"]}


def messages(d: Daemon, turns: list[dict]) -> tuple[str, str, dict]:
    """With a breakpoint on the last message, as Claude Code sends: the cache write covers the whole conversation."""
    *head, last = turns[1:]
    last = {**last, "content": [{"type": "text", "text": last["content"], "cache_control": {"type": "ephemeral"}}]}
    body = {"model": "tiny", "system": turns[0]["content"], "messages": [*head, last], "max_tokens": 12,
            "temperature": 0}
    out = httpx.post(d.v1 + "/messages", json=body, timeout=120).json()
    u = out["usage"]
    read, written, rest = u["cache_read_input_tokens"], u["cache_creation_input_tokens"], u["input_tokens"]
    text = "".join(b["text"] for b in out["content"] if b["type"] == "text") or "x"
    return out["id"], text, {"prompt": read + written + rest, "cached": read, "written": written}


def responses(d: Daemon, turns: list[dict]) -> tuple[str, str, dict]:
    body = {"model": "tiny", "instructions": turns[0]["content"], "input": turns[1:], "max_output_tokens": 12,
            "temperature": 0}
    out = httpx.post(d.v1 + "/responses", json=body, timeout=120).json()
    u = out["usage"]
    text = "".join(c["text"] for item in out["output"] if item["type"] == "message" for c in item["content"]) or "x"
    return out["id"], text, {"prompt": u["input_tokens"], "cached": u["input_tokens_details"]["cached_tokens"]}


API = Callable[[Daemon, list[dict]], tuple[str, str, dict]]


@pytest.mark.parametrize("api, seed", [(chat, 1), (messages, 2), (responses, 3)], ids=["chat", "messages", "responses"])
def test_usage_is_the_worker_s_count_cold_and_on_the_next_turn(daemon: Daemon, api: API, seed: int) -> None:
    turns = [{"role": "system", "content": system(seed)}, {"role": "user", "content": "Which rule comes first?"}]
    for turn in range(2):
        before = hit_tokens(daemon)
        rid, text, usage = api(daemon, turns)
        worker = worker_count(daemon, rid)
        assert usage["prompt"] == worker["prompt"] and usage["cached"] == worker["cached"], (turn, usage, worker)
        assert usage["prompt"] - usage["cached"] == worker["prefilled"], (turn, usage, worker)
        # the hot cache's own tally moved by exactly what this request read from it
        assert wait_for(lambda moved=before + usage["cached"]: hit_tokens(daemon) == moved or None, 10,
                        what="the hot cache's hit tokens")
        if "written" in usage:  # Anthropic: what this request computed up to its breakpoint, kept for the next turn
            # the breakpoint covers the messages (at most the assistant header the template appends is past it)
            assert usage["written"] > 0 and 0 <= worker["prefilled"] - usage["written"] <= 8, (turn, usage, worker)
        if turn == 0:
            assert usage["cached"] < 64 < worker["prompt"], (usage, worker)  # at most the template's head, shared
        else:
            assert usage["cached"] > 0, (usage, worker)
        turns += [{"role": "assistant", "content": text}, {"role": "user", "content": "And the next one?"}]


def test_a_request_without_breakpoints_writes_no_cache_as_anthropic_counts_it(daemon: Daemon) -> None:
    """Catches: every computed token reported as a cache write (billed at 1.25x by clients that price usage) on a
    request that marks no `cache_control` breakpoint; Anthropic's API reports those as plain input tokens."""
    body = {"model": "tiny", "system": system(4), "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Which rule comes last?"}]}
    out = httpx.post(daemon.v1 + "/messages", json=body, timeout=120).json()
    u = out["usage"]
    worker = worker_count(daemon, out["id"])
    assert u["cache_creation_input_tokens"] == 0, u
    assert u["input_tokens"] == worker["prefilled"] and u["cache_read_input_tokens"] == worker["cached"], (u, worker)
