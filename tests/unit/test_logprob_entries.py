"""A token's logprobs entry: its own logprob and the top alternatives, best first, as a whole sort would give them."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tests.unit import mlx_streams
from worker.mlx_engine.guided import MIN_LOGPROB, logprob_entries


def test_the_top_alternatives_are_a_whole_sorts_first_ones_best_first() -> None:
    x = mx.random.normal((5000,), key=mx.random.key(3))
    logprobs = x - mx.logsumexp(x)
    logprobs[11] = -mx.inf  # a token the grammar or a bias ruled out: a finite floor, not -inf in JSON
    entry = logprob_entries(lambda ids: f"<{ids[0]}>", 20)
    text, value, alts = entry(11, logprobs)
    whole = mx.argsort(-logprobs)[:20].tolist()
    assert [a[0] for a in alts] == [f"<{i}>" for i in whole]
    assert [a[1] for a in alts] == logprobs[mx.array(whole)].tolist()
    assert text == "<11>" and value == MIN_LOGPROB
    assert logprob_entries(str, 0)(4, logprobs)[2] == []  # logprobs without alternatives
    small = mx.array([-0.1, -3.0, -2.0])  # fewer tokens than asked for: all of them
    assert [a[0] for a in logprob_entries(lambda ids: str(ids[0]), 5)(0, small)[2]] == ["0", "2", "1"]


def test_an_entry_is_computed_on_the_generation_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the step computed the logprobs (mlx-lm's generation stream), so reading them waits on no other stream."""
    seen = mlx_streams.record(monkeypatch, "argpartition")
    logprob_entries(str, 3)(0, mx.array([-0.5, -1.0, -2.0, -4.0]))
    assert seen == [mlx_streams.generation()]
