"""The batch's rollback (batch_drafting.py): a verification's rejected tokens taken back out of every row of mlx-lm's
batch caches, as if only the kept ones had been fed, each row keeping as many as all the others or its own number.
Real MLX on the CPU, mlx-lm's own cache classes; the model is a stand-in that writes each token's id as its K/V and
folds it into a recurrent state (up to each row's length, where the cache gives lengths, as mlx-lm's models do)."""

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
                folded = state * 0.5 + ids[:, j:j + 1].astype(mx.float32)
                state = folded if c.lengths is None else mx.where((j < c.lengths)[:, None], folded, state)
            c[0] = state
        else:
            c.update_and_fetch(kv, kv)


def row(cache: list, i: int) -> list:
    """What row i holds: every layer's K (extracted: its tokens, in order) and position, or recurrent state."""
    out = []
    for c in cache:
        if isinstance(c, ArraysCache):
            out.append(c[0][i].tolist())
        else:
            out += [c.extract(i).keys[0, 0, :, 0].tolist(), c.offset[i].item()]
    return out


LAYERS: dict[str, Callable[[list[int]], list]] = {
    "kv": lambda pad: [BatchKVCache(pad)],
    "window with room": lambda pad: [BatchRotatingKVCache(32, pad), BatchKVCache(pad)],
    "full window": lambda pad: [BatchRotatingKVCache(8, pad), BatchKVCache(pad)],
    "recurrent": lambda pad: [ArraysCache(1), BatchKVCache(pad)],
}


@pytest.mark.parametrize("layers", list(LAYERS), ids=list(LAYERS))
@pytest.mark.parametrize("keep", [(1, 1), (3, 3), (5, 5), (1, 3), (5, 2), (2, 4)], ids=str)
def test_a_verification_undone_leaves_what_plain_steps_of_the_kept_tokens_leave(layers: str,
                                                                                keep: tuple[int, int]) -> None:
    """Each row ends as if fed its prompt and only its kept tokens one at a time (row 0's prompt one shorter, left
    padded in the batch), and the next step goes on alike."""
    prompts = [list(range(101, 112)), list(range(201, 213))]
    fed = mx.array([[11, 12, 13, 14, 15], [21, 22, 23, 24, 25]])
    drafted = LAYERS[layers]([1, 0])
    model(mx.array([[0, *prompts[0]], prompts[1]]), drafted)
    assert undoable(drafted)
    marked = mark(drafted, fed.shape[1])
    assert (marked is None) == (layers in ("kv", "window with room"))  # a trim does it where it can
    model(fed, drafted)
    refed = undo(model, drafted, fed, list(keep), marked)
    trims = marked is None and (keep[0] == keep[1] or layers == "kv")
    assert refed == (0 if trims or min(keep) == fed.shape[1] else max(keep))
    model(mx.array([[99], [98]]), drafted)  # the next step, one token
    for i in range(2):  # plain decoding: row i alone, one token a step
        plain = LAYERS[layers]([0])
        model(mx.array([prompts[i]]), plain)
        for j in range(keep[i]):
            model(fed[i:i + 1, j:j + 1], plain)
        model(mx.array([[99, 98][i:i + 1]]), plain)
        assert row(drafted, i) == row(plain, 0), i


def test_a_batch_is_priced_at_the_next_size_measured() -> None:
    assert [bucket(n) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
