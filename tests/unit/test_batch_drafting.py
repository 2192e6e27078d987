"""The batch's rollback (batch_drafting.py): a verification's rejected tokens taken back out of every row of mlx-lm's
batch caches, as if only the kept ones had been fed. Real MLX on the CPU, mlx-lm's own cache classes; the model is a
stand-in that writes each token's id as its K/V and folds it into a recurrent state."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache

from worker.mlx_engine.batch_drafting import bucket, mark, undo, undoable


def model(ids: mx.array, cache: list) -> None:
    """Feeds `ids` (B, S) to every layer: its K/V are the ids; a recurrent layer's state folds each one in."""
    kv = ids.astype(mx.float32)[:, None, :, None] * mx.ones((1, 1, 1, 2))
    for c in cache:
        if isinstance(c, ArraysCache):
            state = c[0] if c[0] is not None else mx.zeros((ids.shape[0], 1))
            for j in range(ids.shape[1]):
                state = state * 0.5 + ids[:, j:j + 1].astype(mx.float32)
            c[0] = state
        else:
            c.update_and_fetch(kv, kv)


def rows(cache: list) -> list:
    """What each row holds, in order: every layer's K (extracted per row) or recurrent state."""
    out = []
    for c in cache:
        for i in range(2):
            out.append(c[0][i].tolist() if isinstance(c, ArraysCache) else c.extract(i).keys[0, 0, :, 0].tolist())
        if not isinstance(c, ArraysCache):  # where each row's tokens start and end: its mask
            out += [c.offset.tolist(), c.left_padding.tolist()]
    return out


LAYERS: dict[str, Callable[[], list]] = {
    "kv": lambda: [BatchKVCache([1, 0])],
    "window with room": lambda: [BatchRotatingKVCache(32, [1, 0]), BatchKVCache([1, 0])],
    "full window": lambda: [BatchRotatingKVCache(8, [1, 0]), BatchKVCache([1, 0])],
    "recurrent": lambda: [ArraysCache(1), BatchKVCache([1, 0])],
}


@pytest.mark.parametrize("layers", list(LAYERS), ids=list(LAYERS))
@pytest.mark.parametrize("keep", [1, 3, 5])
def test_a_verification_undone_leaves_what_plain_steps_of_the_kept_tokens_leave(layers: str, keep: int) -> None:
    prompt = mx.array([[0, *range(101, 112)], list(range(201, 213))])  # row 0 left-padded
    fed = mx.array([[11, 12, 13, 14, 15], [21, 22, 23, 24, 25]])
    drafted, plain = LAYERS[layers](), LAYERS[layers]()
    for cache in (drafted, plain):
        model(prompt, cache)
    assert undoable(drafted)
    marked = mark(drafted, fed.shape[1])
    assert (marked is None) == (layers in ("kv", "window with room"))  # a trim does it where it can
    model(fed, drafted)
    refed = undo(model, drafted, fed, keep, marked)
    assert refed == (0 if marked is None or keep == fed.shape[1] else keep)
    for j in range(keep):  # plain decoding: one token a step
        model(fed[:, j:j + 1], plain)
    for cache in (drafted, plain):  # and the next step, one token, goes on alike
        model(mx.array([[99], [98]]), cache)
    assert rows(drafted) == rows(plain)


def test_a_batch_is_priced_at_the_next_size_measured() -> None:
    assert [bucket(n) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
