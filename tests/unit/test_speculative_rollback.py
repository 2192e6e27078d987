"""Undoing a verification's tokens in layers a trim cannot undo (rollback.py): a full sliding window and a recurrent
state get their marked state back, a KVCache drops the tokens, and feeding the kept tokens again leaves each layer
as feeding only those would have. Real mlx-lm cache classes on the CPU; no model."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from worker.mlx_engine.rollback import mark, restore, room, undoable

WINDOW = 8


def kv(n: int, seed: int) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((1, 2, n, 4), key=mx.random.key(seed))
    return k, k + 1


def feed(cache: list, n: int, seed: int) -> None:
    """n tokens into each layer as a model's step does: K/V appended, the recurrent state replaced."""
    keys, values = kv(n, seed)
    for c in cache:
        if isinstance(c, ArraysCache):
            c[0] = (c[0] if c[0] is not None else mx.zeros((1, 4))) * 0.5 + keys.sum()
        else:
            c.update_and_fetch(keys, values)


def layers() -> list:
    """A window filled past its size one token at a time (so its buffer rotates), a recurrent state, a KVCache."""
    cache = [RotatingKVCache(WINDOW), ArraysCache(1), KVCache()]
    for i in range(WINDOW + 5):
        feed(cache, 1, i)
    return cache


def state(cache: list) -> list:
    out = []
    for c in cache:
        if isinstance(c, ArraysCache):
            out.append(np.array(c[0]))
        else:
            k, v = (c.keys[..., :c.offset, :], c.values[..., :c.offset, :]) if isinstance(c, KVCache) else (
                c.keys_and_values())
            out += [np.array(k), np.array(v), c.offset]
    return out


def test_marked_layers_get_their_state_back_and_re_fed_tokens_land_as_if_only_they_were_fed() -> None:
    cache, reference = layers(), layers()
    assert undoable(cache) and room(cache) == 0  # the window is full, the recurrent state folds: no trim
    marked = mark(cache, 4)
    assert marked is not None and set(marked) == {0, 1}  # the KVCache is trimmed, not marked
    feed(cache, 4, 100)  # the token in hand and 3 drafts, in one pass
    restore(cache, marked, 4)
    assert all(np.array_equal(a, b) for a, b in zip(state(cache), state(reference)))
    feed(cache, 2, 200)  # the token and the one draft kept, again
    feed(reference, 2, 200)
    assert all(np.array_equal(a, b) for a, b in zip(state(cache), state(reference)))
    feed(cache, 1, 300)  # and decoding goes on, one token at a time, in the rotated window
    feed(reference, 1, 300)
    assert all(np.array_equal(a, b) for a, b in zip(state(cache), state(reference)))


def test_a_cache_a_trim_undoes_needs_no_mark() -> None:
    cache = [RotatingKVCache(WINDOW), KVCache()]
    feed(cache, 3, 0)
    assert room(cache) == WINDOW - 3 and mark(cache, 4) is None and mark(cache, 6) is not None
