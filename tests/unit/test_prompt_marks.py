"""Where a `cache_control` breakpoint ends in the prompt (Prompts.marked), on a real tokenizer and chat template.

An agent marks the same head (its system prompt and tools) on every turn, often twice in one request: the template
renders that head once, not once per mark per request (it was a second template pass over most of a 30k-token
prompt, docs/agent-sessions.md), and a changed head is rendered anew.
"""

from __future__ import annotations

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_tokenizer

from protocol.messages import Submit
from worker.mlx_engine.make_model import make_model
from worker.mlx_engine.prompt import Prompts, shared_prefix

TOOLS = [{"name": "Read", "description": "Read a file",  # Submit's neutral shape
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> TokenizerWrapper:
    path = tmp_path_factory.mktemp("models") / "qwen3"
    make_model(path, "tiny", seed=0, arch="qwen3")
    return load_tokenizer(path)


@pytest.fixture
def prompts(tokenizer: TokenizerWrapper) -> Prompts:
    """Each test's own: a Prompts remembers the heads it rendered, and the tests count renders (in any order)."""
    return Prompts(tokenizer, 0, 4096, False)


def turn(system: str, n: int) -> Submit:
    """A conversation of a system message and n user/assistant exchanges, marked at the system message."""
    messages = [{"role": "system", "content": system}]
    for i in range(n):
        messages += [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    messages.append({"role": "user", "content": "and now?"})
    return Submit(rid=f"r{n}", max_tokens=8, messages=messages, tools=TOOLS, cache_mark=[[1, 300.0], [1, 300.0]])


def test_a_head_marked_again_is_not_rendered_again(prompts: Prompts, monkeypatch: pytest.MonkeyPatch) -> None:
    render = prompts.tokenizer.apply_chat_template
    head = render([{"role": "system", "content": "You are a careful agent."}],
                  tools=[{"type": "function", "function": t} for t in TOOLS], add_generation_prompt=False)
    renders: list[int] = []

    def counting(messages: list, **kwargs: object) -> list[int]:
        renders.append(len(messages))
        return render(messages, **kwargs)

    monkeypatch.setattr(prompts.tokenizer, "apply_chat_template", counting)
    ends = []
    for n in range(3):  # three turns of one session, each marking its system message twice
        msg = turn("You are a careful agent.", n)
        tokens = prompts.encode(msg)
        ends += [prompts.marked(msg, tokens, 1) for _ in msg.cache_mark]
    assert ends == [len(head)] * 6  # the mark ends where the system message does, on every turn
    assert renders.count(1) == 1  # the head rendered once: by the first mark of the first turn

    other = turn("You are a different agent.", 1)
    assert prompts.marked(other, prompts.encode(other), 1) > 0
    assert renders.count(1) == 2  # a changed head is rendered, not taken from the one remembered


def test_the_head_ends_where_sibling_sessions_branch_and_is_rendered_once(prompts: Prompts,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts.branch_ends: sessions sharing a system prompt and tools (an agent's subagents) branch at their first
    user message's text; that end is found by rendering the head once, then remembered."""
    render = prompts.tokenizer.apply_chat_template
    renders: list[int] = []

    def counting(messages: list, **kwargs: object) -> list[int]:
        renders.append(len(messages))
        return render(messages, **kwargs)

    monkeypatch.setattr(prompts.tokenizer, "apply_chat_template", counting)
    sessions = [Submit(rid=task, max_tokens=8, tools=TOOLS, messages=[
        {"role": "system", "content": "You are a careful agent."}, {"role": "user", "content": f"{task}: go"}])
        for task in ("Alpha", "Beta")]
    encoded = [prompts.encode(m) for m in sessions]
    renders.clear()
    ends = [prompts.branch_ends(m, t) for m, t in zip(sessions, encoded)]
    assert ends[0] == ends[1] and ends[0][-1] == shared_prefix(*encoded)
    assert renders == [1, 2]  # the template's preamble, the head and an empty user turn: once for both sessions
    other = Submit(rid="o", max_tokens=8, tools=TOOLS, messages=[{"role": "system", "content": "Title this chat."},
                                                                 {"role": "user", "content": "Alpha: go"}])
    preamble = shared_prefix(prompts.encode(other), encoded[0])  # "<|im_start|>system\n": every session's
    assert preamble > 0 and prompts.branch_ends(other, prompts.encode(other))[0] == ends[0][0] == preamble
    later = turn("You are a careful agent.", 2)
    assert prompts.branch_ends(later, prompts.encode(later)) == ends[0]
    no_head = Submit(rid="u", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert len(prompts.branch_ends(no_head, prompts.encode(no_head))) <= 1  # the template's preamble, if any


def test_sessions_branch_inside_their_first_user_turn_where_its_parts_end(prompts: Prompts) -> None:
    """Sessions of one agent in one project share more than the head: Claude Code opens the first user message with
    system-reminder blocks (the gateway joins a message's blocks and says where they end: Submit.branch_points),
    Codex sends its environment as a user message of its own; each session's task comes after. Those ends are
    branch points (a model that caches only at snapshots snapshots there), each where the sessions' prompts part."""
    reminder = "<system-reminder>\nThe project's notes: " + "keep it short. " * 40 + "\n</system-reminder>\n"
    blocks = [Submit(rid=task, max_tokens=8, tools=TOOLS, branch_points=[[1, len(reminder)]], messages=[
        {"role": "system", "content": "You are a careful agent."}, {"role": "user", "content": reminder + task}])
        for task in ("Fix the bug.", "Write the docs.")]
    separate = [Submit(rid=task, max_tokens=8, tools=TOOLS, messages=[
        {"role": "system", "content": "You are a careful agent."}, {"role": "user", "content": "<env>/tmp/w</env>"},
        {"role": "user", "content": task}]) for task in ("Fix the bug.", "Write the docs.")]
    for pair in (blocks, separate):
        encoded = [prompts.encode(m) for m in pair]
        _, head, *inside = prompts.branch_ends(pair[0], encoded[0])
        assert inside and prompts.branch_ends(pair[1], encoded[1])[1:] == [head, *inside]
        assert head < inside[-1] <= shared_prefix(*encoded) <= inside[-1] + 8  # where they part, to a few tokens
