"""max_tokens is a ceiling, not a promise (issue 26), in the engine itself (real MLX on the CPU, no daemon): a request
whose prompt fits but prompt + max_tokens does not generates up to the context's end and finishes as
"context_window"; the room is the context less the prompt and a resumed request's earlier tokens, the same for each
sequence; only a prompt that leaves no room is refused, and strict_context keeps the old refusal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol.messages import CONTEXT_LENGTH_EXCEEDED, CONTEXT_WINDOW, Finished, Submit
from worker.engine_api import RequestRejected
from worker.mlx_engine.engine import Engine
from worker.mlx_engine.make_model import make_model

CONTEXT = 64  # the test model's context, made small so a request reaches its end in a few steps


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "qwen3"
    make_model(path, "tiny", seed=0, arch="qwen3")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    return path


@pytest.fixture(scope="module")
def engine(model: Path) -> Engine:
    return Engine(model, warm="off")


def ask(rid: str, prompt: int, max_tokens: int, **kw) -> Submit:
    """A completion of `prompt` token ids that never stops at EOS, so only a token limit ends it."""
    return Submit(rid=rid, max_tokens=max_tokens, prompt_ids=[5] * prompt, temperature=0, ignore_eos=True, **kw)


def run(engine: Engine, rids: set[str]) -> dict[str, Finished]:
    ended: dict[str, Finished] = {}
    while rids & set(engine.rids):
        _, done = engine.step()
        for d in done:
            assert isinstance(d, Finished), d
            ended[d.rid] = d
    return ended


def test_max_tokens_past_the_context_is_clamped_and_the_context_ends_it(engine: Engine) -> None:
    engine.submit(ask("clamped", 50, 1000))
    end = run(engine, {"clamped"})["clamped"]
    assert (end.finish_reason, end.prompt_tokens, end.completion_tokens) == (CONTEXT_WINDOW, 50, CONTEXT - 50)


def test_max_tokens_that_fits_ends_as_length(engine: Engine) -> None:
    engine.submit(ask("fits", 50, 5))
    end = run(engine, {"fits"})["fits"]
    assert (end.finish_reason, end.completion_tokens) == ("length", 5)


def test_each_of_n_sequences_and_a_resumed_request_count_against_the_same_room(engine: Engine) -> None:
    for rid in ("a", "b"):  # n = 2: one Submit per choice, each its own room
        engine.submit(ask(rid, 40, 1000))
    engine.submit(ask("resumed", 40, 1000 - 10, resume_tokens=[7] * 10))  # 10 of its tokens came before
    ended = run(engine, {"a", "b", "resumed"})
    assert {rid: (e.finish_reason, e.completion_tokens) for rid, e in ended.items()} == {
        "a": (CONTEXT_WINDOW, CONTEXT - 40), "b": (CONTEXT_WINDOW, CONTEXT - 40),
        "resumed": (CONTEXT_WINDOW, CONTEXT - 40)}  # its 10 earlier tokens count as completion tokens


@pytest.mark.parametrize("prompt, resumed", [(CONTEXT, 0), (CONTEXT + 5, 0), (CONTEXT - 3, 3)])
def test_a_prompt_that_leaves_no_room_is_refused(engine: Engine, prompt: int, resumed: int) -> None:
    with pytest.raises(RequestRejected) as exc:
        engine.submit(ask("full", prompt, 10, resume_tokens=[7] * resumed))
    assert exc.value.code == CONTEXT_LENGTH_EXCEEDED and not engine.rids


def test_strict_context_refuses_what_would_be_clamped(model: Path) -> None:
    strict = Engine(model, warm="off", strict_context=True)
    with pytest.raises(RequestRejected) as exc:
        strict.submit(ask("over", 50, CONTEXT - 50 + 1))
    assert exc.value.code == CONTEXT_LENGTH_EXCEEDED and not strict.rids
    strict.submit(ask("fits", 50, CONTEXT - 50))  # exactly to the end still fits
    end = run(strict, {"fits"})["fits"]
    assert (end.finish_reason, end.completion_tokens) == ("length", CONTEXT - 50)  # max_tokens ended it
