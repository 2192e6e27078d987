"""BatchQuantizedKVCache (issue 53) holds each row as mlx-lm's QuantizedKVCache would hold it alone: the same bits
after merge, extend, filter, a right-padded prefill's finalize, trim and extract. Real MLX on the CPU, random K/V."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import KVCache

from worker.mlx_engine.quantized_kv import BatchQuantizedKVCache, QuantizedKV, group_for, quantize_cache

HEADS, DIM = 2, 64


def kv(n: int, seed: int) -> tuple[mx.array, mx.array]:
    mx.random.seed(seed)
    return mx.random.normal((1, HEADS, n, DIM)), mx.random.normal((1, HEADS, n, DIM))


def alone(n: int, seed: int, bits: int = 8) -> QuantizedKV:
    c = QuantizedKV(64, bits)
    c.update_and_fetch(*kv(n, seed))
    return c


def same(a: QuantizedKV, b: QuantizedKV) -> bool:
    return a.offset == b.offset and all(
        mx.array_equal(x[..., :a.offset, :], y[..., :b.offset, :]).item()
        for ta, tb in ((a.keys, b.keys), (a.values, b.values)) for x, y in zip(ta, tb, strict=True))


@pytest.mark.parametrize("bits", [8, 4])
def test_rows_keep_their_bits_through_merge_extend_filter_and_extract(bits: int) -> None:
    rows = [alone(n, seed, bits) for seed, n in enumerate((5, 300, 17))]
    batch = QuantizedKV.merge(rows[:2])
    assert isinstance(batch, BatchQuantizedKVCache) and batch.bits == bits
    batch.extend(QuantizedKV.merge(rows[2:]))
    assert [same(batch.extract(i), r) for i, r in enumerate(rows)] == [True] * 3
    k, v = kv(1, 9)  # one more token each: written at each row's end, quantized as a lone cache writes it
    keys, _ = batch.update_and_fetch(mx.concatenate([k] * 3), mx.concatenate([v] * 3))
    assert keys[0].shape[2] == batch._idx == 301
    for r in rows:
        r.update_and_fetch(k, v)
    assert [same(batch.extract(i), r) for i, r in enumerate(rows)] == [True] * 3
    batch.filter([0, 2])  # the long row gone: the padding left of the others is dropped
    assert batch._idx == 18 and [same(batch.extract(i), r) for i, r in enumerate((rows[0], rows[2]))] == [True] * 2
    assert batch.trim(3) == 3 and batch.extract(1).offset == rows[2].offset - 3


def test_a_right_padded_prefill_is_finalized_into_left_padding() -> None:
    """Rows fed different lengths in one step (mlx-lm's prepare/finalize): each as if fed alone."""
    batch = BatchQuantizedKVCache([0, 0], 64, 8)
    (k1, v1), (k2, v2) = kv(6, 1), kv(3, 2)
    pad = mx.zeros((1, HEADS, 3, DIM))
    batch.prepare(lengths=[6, 3], right_padding=[0, 3])
    batch.update_and_fetch(mx.concatenate([k1, mx.concatenate([k2, pad], axis=2)]),
                           mx.concatenate([v1, mx.concatenate([v2, pad], axis=2)]))
    batch.finalize()
    one, two = QuantizedKV(64, 8), QuantizedKV(64, 8)
    one.update_and_fetch(k1, v1)
    two.update_and_fetch(k2, v2)
    assert same(batch.extract(0), one) and same(batch.extract(1), two)
    assert batch.nbytes == sum(x.nbytes for t in (batch.keys, batch.values) for x in t) > 0


def test_a_head_dimension_takes_the_group_asked_for_or_the_largest_that_divides_it() -> None:
    assert group_for(128, 64) == 64 and group_for(32, 64) == 32 and group_for(96, 64) == 32
    assert group_for(16, 64) is None


class _NoGroupsOf64(nn.Module):
    """A one-layer model whose attention, as MLX CUDA 0.32.4's, reads no quantized K/V in groups of 64 (head
    dimension 64) and reads groups of 32: what cannot run here is the refusal, faked; the cache and its quantization
    are mlx-lm's."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = [nn.Linear(64, 64)]

    def make_cache(self) -> list:
        return [KVCache()]

    def __call__(self, ids: mx.array, cache: list) -> mx.array:
        c = cache[0]
        if getattr(c, "group_size", None) == 64:
            raise RuntimeError("[quantized_matmul] No implementation for problem shape: 2x2x64x32")
        x = mx.zeros((1, 1, ids.shape[1], 64))
        c.update_and_fetch(x, x)
        return x


def test_a_group_attention_cannot_read_falls_back_to_groups_of_32_not_to_full_precision() -> None:
    model = _NoGroupsOf64()
    assert quantize_cache(model, 8, 64) == 32
    cache = model.make_cache()
    assert type(cache[0]) is QuantizedKV and cache[0].group_size == 32 and cache[0].bits == 8
