"""worker/mlx_engine/scripted.py: which request a script answers, and that its processor forces exactly the scripted ids
through a real sampler (greedy, and sampling at a temperature), whatever the model's logits say."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_sampler

from protocol.messages import Submit
from worker.mlx_engine import scripted
from worker.mlx_engine.scripted import Script, ScriptedReply, latest_turn_text

SCRIPT = [{"match": "STEP-2", "reply": "done"}, {"match": "STEP-1", "reply": "call"}]


def test_the_latest_turn_is_what_follows_the_last_assistant_message(tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "STEP-1 in the system prompt does not count"},
                {"role": "user", "content": [{"type": "text", "text": "please STEP-1"}]},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "x", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "out STEP-2"},
                {"role": "user", "content": "a reminder"}]
    assert latest_turn_text(messages) == "out STEP-2\na reminder"
    script = Script.load(write(tmp_path, SCRIPT))
    assert script.reply_for(messages) == "done"
    assert script.reply_for(messages[:2]) == "call"
    assert script.reply_for([{"role": "user", "content": "nothing scripted"}]) is None


def test_a_malformed_script_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="list of"):
        Script.load(write(tmp_path, [{"match": "x"}]))


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_the_processor_forces_the_scripted_ids_then_eos(temperature: float) -> None:
    vocab, ids = 50, [7, 3, 3, 41, 2]
    sampler = make_sampler(temperature, top_p=0.9 if temperature else 0.0)
    forced = ScriptedReply(ids)
    tokens = mx.array([1, 2, 3])
    drawn = []
    for step in range(len(ids) + 2):  # past the end: EOS (the last id) again
        logits = mx.random.normal((1, vocab)) * 10
        logits[0, ids[min(step, len(ids) - 1)]] = -30.0  # the model disfavours the scripted token
        out = forced(tokens, logits)
        logprobs = out - mx.logsumexp(out, axis=-1, keepdims=True)
        drawn.append(int(sampler(logprobs).item()))
    assert drawn == [*ids, 2, 2]


def test_a_resumed_request_goes_on_where_it_stopped() -> None:
    forced = ScriptedReply([5, 6, 7], done=2)
    assert int(mx.argmax(forced(mx.array([0]), mx.zeros((1, 10))), axis=-1).item()) == 7


def test_nothing_is_scripted_without_a_script(tmp_path: Path) -> None:
    class Tok:
        eos_token_ids = {0, 2}
        eos_token_id = 2

        def encode(self, text: str, add_special_tokens: bool) -> list[int]:
            assert not add_special_tokens
            return [ord(c) for c in text]

    ask = [{"role": "user", "content": "STEP-1"}]
    engine = SimpleNamespace(decoding=SimpleNamespace(tokenizer=Tok(), hooks=[]))  # a chat engine's decoding
    assert engine.decoding.hooks == []  # an engine nothing was wired into scripts nothing
    assert not scripted.install(SimpleNamespace(), write(tmp_path, SCRIPT))  # an engine that decodes nothing
    assert scripted.install(engine, write(tmp_path, SCRIPT))
    (hook,) = engine.decoding.hooks
    (processor,) = hook(Submit("r", 0, messages=ask, resume_tokens=[5]))
    assert processor.ids == [ord(c) for c in "call"] + [2] and processor.at == 1
    assert hook(Submit("r", 0, prompt="STEP-1")) == []  # a completion, not a chat
    assert hook(Submit("r", 0, messages=[{"role": "user", "content": "free"}])) == []


def write(folder: Path, entries: list) -> Path:
    path = folder / "script.json"
    path.write_text(json.dumps(entries))
    return path
