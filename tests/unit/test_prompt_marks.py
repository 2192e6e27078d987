"""Where a `cache_control` breakpoint ends in the prompt (Prompts.marked), on a real tokenizer and chat template.

An agent marks the same head (its system prompt and tools) on every turn, often twice in one request: the template
renders that head once, not once per mark per request (it was a second template pass over most of a 30k-token
prompt, docs/agent-sessions.md), and a changed head is rendered anew.
"""

from __future__ import annotations

import pytest
from mlx_lm.utils import load_tokenizer

from protocol.messages import Submit
from worker.mlx_engine.make_model import make_model
from worker.mlx_engine.prompt import Prompts

TOOLS = [{"name": "Read", "description": "Read a file",  # Submit's neutral shape
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Prompts:
    path = tmp_path_factory.mktemp("models") / "qwen3"
    make_model(path, "tiny", seed=0, arch="qwen3")
    return Prompts(load_tokenizer(path), 0, 4096, False)


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
