"""Issue 34: an agent session's turns on one daemon, as the agents send them.

- A hybrid model (qwen3_5: recurrent layers, whose state cannot be cut at any token) keeps a reusable state at
  the end of each reply (worker/mlx_engine/snapshots.py: `Snapshots.of_replies`), so a tool loop's next turn, which
  carries the reply back, prefills only its own new tokens and under one block: not the reply again.
- The first sibling session (an agent's subagent: the same system prompt and tools, then its own first message)
  picks up the head its elder left, for a hybrid and a sliding-window model (gemma3): the elder's prefill stopped
  for a snapshot at its head's end (`Prompts.head_end`), where the sibling branches.
- Claude Code's side requests name a small model of Anthropic's (claude-haiku-*); with a default configuration
  (no aliases, no default model) they are served by the one model loaded, and no second worker starts.

The reply is scripted (worker/mlx_engine/scripted.py): random weights, real model steps, the reply's tokens forced.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from mlx_lm.utils import load_tokenizer

from protocol.messages import Submit
from tests.conftest import MLXSUP, Daemon, assert_gone, start_daemon
from worker.mlx_engine.prompt import Prompts, shared_prefix

BLOCK = 64
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "agent_traffic"
TOOLS = [{"type": "function", "function": {"name": "read", "description": "Read a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
REASONING = "The notes hold the answer. " + " ".join(f"step{i}" for i in range(50))
CALL = "<tool_call>\n<function=read>\n<parameter=path>\nnotes.txt\n</parameter>\n</function>\n</tool_call>"
SCRIPT = [{"match": "SESSION-TURN-1", "reply": f"{REASONING}\n</think>\n\n{CALL}"}]  # after the prompt's <think>


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("agent_sessions")
    model = root / "hybrid"
    subprocess.run([*MLXSUP, "make-model", str(model), "--arch", "qwen3_5", "--preset", "tiny"], check=True,
                   capture_output=True)
    subprocess.run([*MLXSUP, "make-model", str(root / "sliding"), "--arch", "gemma3", "--preset", "tiny"], check=True,
                   capture_output=True)
    (root / "script.json").write_text(json.dumps(SCRIPT))
    config = root / "c.toml"
    config.write_text(f'[models.hybrid]\npath = "{model}"\nworker_args = ["--script", "{root / "script.json"}"]\n\n'
                      f'[models.sliding]\npath = "{root / "sliding"}"\n\n[cache]\nssd = false\n')
    d = start_daemon(root / "state", "--config", str(config))
    yield d
    pids = d.children()
    assert d.stop() == 0
    assert_gone(pids)


def chat(d: Daemon, messages: list[dict], max_tokens: int, **extra: object) -> dict:
    r = httpx.post(d.v1 + "/chat/completions", timeout=300, json={
        "model": "hybrid", "messages": messages, "tools": TOOLS, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_hybrid_s_next_turn_prefills_only_its_new_tokens(hybrid: Daemon) -> None:
    system = "Rules: " + " ".join(f"rule{i * 7919 % 9973} holds" for i in range(60))
    turn = [{"role": "system", "content": system}, {"role": "user", "content": "What do the notes say? SESSION-TURN-1"}]
    first = chat(hybrid, turn, 1000)
    reply = first["choices"][0]["message"]
    assert reply["tool_calls"] and reply["reasoning_content"], reply
    done = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]  # the sequence turn 1 left
    assert first["usage"]["completion_tokens"] > 2 * BLOCK, first["usage"]  # the reply crosses block boundaries
    # the tool loop goes on: the reply as the API gave it (its reasoning too, as opencode sends it), the tool's result
    turn += [{"role": "assistant", "content": reply["content"], "reasoning_content": reply["reasoning_content"],
              "tool_calls": reply["tool_calls"]},
             {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "The notes say 2."}]
    # alone and unscripted, it decodes the solo way (mlx_engine/solo.py), past block boundaries: snapshots there too
    usage = chat(hybrid, turn, 2 * BLOCK, ignore_eos=True)["usage"]
    prefilled = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    # without a state at the reply's end: picked up at turn 1's prompt end, the whole reply prefilled again
    assert prefilled <= usage["prompt_tokens"] - done + BLOCK, (usage, done)
    assert usage["completion_tokens"] == 2 * BLOCK
    assert "reply snapshot failed" not in (hybrid.state_dir / "daemon.log").read_text(errors="replace")


@pytest.mark.parametrize("model", ["hybrid", "sliding"])
def test_the_first_sibling_session_picks_up_the_head_its_elder_left(hybrid: Daemon, model: str) -> None:
    system = f"{model} agent. " + " ".join(f"rule{i * 104729 % 9973} holds" for i in range(300))  # ~20 blocks
    sessions = [[{"role": "system", "content": system}, {"role": "user", "content": f"{task} Which rule is first?"}]
                for task in ("Alpha task: read the notes.", "Beta task: list the files.")]
    tools = TOOLS if model == "hybrid" else []  # gemma3's template renders no tools
    usages = []
    for messages in sessions:
        r = httpx.post(hybrid.v1 + "/chat/completions", timeout=300, json={
            "model": model, "messages": messages, "max_tokens": 1, "temperature": 0, **({"tools": tools} if tools else {})})
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
    # the tokens the two prompts share, by the model's own template and tokenizer (as the worker encodes them)
    prompts = Prompts(load_tokenizer(hybrid.state_dir.parent / model), 0, 1 << 20, False)
    encoded = [prompts.encode(Submit(rid="s", max_tokens=1, messages=m, tools=[t["function"] for t in tools] or None))
               for m in sessions]
    assert [u["prompt_tokens"] for u in usages] == [len(e) for e in encoded]
    shared = shared_prefix(*encoded)
    assert shared > 10 * BLOCK, shared
    sibling = usages[1]
    prefilled = sibling["prompt_tokens"] - sibling["prompt_tokens_details"]["cached_tokens"]
    # without a snapshot at the elder's head: nothing to pick up before its prompt's last block, all prefilled again
    assert prefilled <= sibling["prompt_tokens"] - shared + BLOCK, (sibling, shared)


@pytest.fixture(scope="module")
def default_daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A default configuration: two models there, no aliases, no default model."""
    d = start_daemon(tmp_path_factory.mktemp("agent_default"), "--model-dir", str(model_dir))
    yield d
    pids = d.children()
    assert d.stop() == 0
    assert_gone(pids)


def side_request() -> dict:
    """A Claude Code request as recorded, under the small model's name its background requests use."""
    body = json.loads((FIXTURES / "claude.jsonl").read_text().splitlines()[0])["body"]
    return {**body, "model": "claude-haiku-4-5-20251001", "max_tokens": 8, "stream": False,
            "messages": body["messages"][:1], "system": body["system"][:1], "tools": []}


def loaded(d: Daemon) -> list[str]:
    return [m["id"] for m in d.status()["models"] if m["pid"]]


def test_claude_code_s_side_request_is_served_by_the_one_model_loaded(default_daemon: Daemon) -> None:
    d = default_daemon
    r = httpx.post(d.v1 + "/messages", json={"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"}]}, timeout=120)
    assert r.status_code == 200, r.text
    assert loaded(d) == ["tiny"]
    r = httpx.post(d.v1 + "/messages?beta=true", json=side_request(), timeout=120,
                   headers={"anthropic-version": "2023-06-01", "x-api-key": "any"})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "claude-haiku-4-5-20251001" and r.json()["usage"]["output_tokens"] > 0
    assert loaded(d) == ["tiny"]  # no second worker for it
