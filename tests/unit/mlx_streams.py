"""Which MLX stream a worker's evals run on: an eval from another stream than the one that computed its inputs
synchronises across the two (on MLX CUDA, ~0.5 ms a token for a lone stream)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generation_stream


def current() -> str:
    return str(mx.default_stream(mx.default_device()))


def generation() -> str:
    """mlx-lm's generation stream as `current` names it inside `with mx.stream(generation_stream)`."""
    with mx.stream(generation_stream):
        inside = current()
    assert inside != current()  # a check against it can tell the two apart
    return inside


def record(monkeypatch: pytest.MonkeyPatch, name: str) -> list[str]:
    """mx.NAME wrapped for the test: the stream current at each call, in order."""
    seen: list[str] = []
    original = getattr(mx, name)

    def wrapped(*a, **kw):
        seen.append(current())
        return original(*a, **kw)

    monkeypatch.setattr(mx, name, wrapped)
    return seen
