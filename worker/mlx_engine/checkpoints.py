"""Prefill checkpoints: what a prompt's prefill has computed goes to the prompt caches while it is computed.

On a slow machine a long prompt's prefill takes minutes, and its client may leave and retry it, or its worker may be
killed or evicted under it. Stored only when the request ended, all of it was lost. So after each step in which a
request's prefill crossed a block boundary, its new whole blocks are stored (prompt_cache.py `store`: the hot tier,
and lent to the SSD writer, which writes them behind): a retry's lookup finds them in memory, and a request resumed
on a new worker finds them on disk. An aborted request leaves what it computed too (the engine's `abort`).

`row_view` reads one row of the BatchGenerator without copying it: every block layer of the row's batch cache as a
lazy slice (mlx-lm's `extract` makes each layer contiguous, a copy of the whole prefix at every checkpoint; cutting
blocks copies only the new ones, as `store` cuts only the blocks the tiers lack). Nothing is kept past the call, so
the batch cache's next in-place update is not made to copy it.

Invariants: a checkpoint never changes what the request computes or emits; a failure is logged and costs only the
checkpoint; a model whose block layers are not all mlx-lm `BatchKVCache`s in the batch is checkpointed only as a solo.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache, KVCache

from worker.mlx_engine.quantized_kv import BatchQuantizedKVCache, QuantizedKV


def row_view(gen: BatchGenerator, uid: int, block_layers: tuple[int, ...] | list[int]) -> tuple[list, list[int]] | None:
    """(cache, tokens) of the row `uid` of the generator's prompt or generation batch: its block layers as views of
    the batch cache, the others None; None when the row is not in a batch or its caches cannot be viewed so."""
    found = gen._find_uids([uid]).get(uid)  # the generator's own lookup (stage 1: prompt batch, 2: generation)
    if found is None or found[0] == 0:
        return None
    stage, idx = found
    batch = gen._prompt_batch if stage == 1 else gen._generation_batch
    layers: list[Any] = batch.prompt_cache
    if not layers or any(not isinstance(layers[i], BatchKVCache) for i in block_layers):
        return None
    tokens = list(batch.tokens[idx])
    view: list[Any] = [None] * len(layers)
    for i in block_layers:
        c = layers[i]
        pad = int(c.left_padding[idx].item()) if isinstance(c.left_padding, mx.array) else 0  # type: ignore[arg-type]
        end = c._idx
        if end - pad != len(tokens):
            return None  # padding or tokens not as the generator's own extract would read them
        if isinstance(c, BatchQuantizedKVCache):  # the running cache quantized: views of each part
            q = QuantizedKV(c.group_size, c.bits)
            q.keys, q.values = (tuple(x[idx:idx + 1, :, pad:end] for x in t) for t in (c.keys, c.values))
            q.offset = end - pad
            view[i] = q
            continue
        kv = KVCache()
        kv.keys, kv.values = c.keys[idx:idx + 1, :, pad:end], c.values[idx:idx + 1, :, pad:end]
        kv.offset = end - pad
        view[i] = kv
    return view, tokens


def crossed(before: int, now: int, block: int) -> bool:
    """Did a prefill's position move past a block boundary between `before` and `now`?"""
    return now // block > before // block
