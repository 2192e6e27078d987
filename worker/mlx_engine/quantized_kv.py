"""The running K/V cache quantized (`kv_bits`): a request's attention layers hold K/V at 8 or 4 bits.

mlx-lm quantizes a single sequence's cache (`QuantizedKVCache`: each token's K and V per head, affine, in groups
of `group_size` along the head dimension, stored as (weights, scales, biases)) and its attention reads it as it
is (`quantized_scaled_dot_product_attention`, chosen wherever the cache has `bits`). It has no batch form:
`BatchGenerator` merges a request's caches with `merge`, which `QuantizedKVCache` lacks. Two classes, each the
least beside mlx-lm's own:

- `QuantizedKV`: mlx-lm's `QuantizedKVCache` plus `merge` (into the batch), `size`, and `kv_blocks` (the prompt
  caches cut it into blocks as a plain KVCache: layer_state.py, kv_blocks.py store its quantized rows as they are).
- `BatchQuantizedKVCache`: mlx-lm's `BatchKVCache` (left padding, offsets, trim, masks: all inherited) over the
  (weights, scales, biases) triples: update_and_fetch quantizes the new tokens as it writes them, and
  filter / extend / extract / merge / finalize apply BatchKVCache's slicing, padding and rolls to each part.
  A row's quantized values are the same bits alone or batched: each token is quantized on its own.

`quantize_cache(model, bits, group_size)` makes the model's `make_cache` return these for its plain `KVCache`
layers (full attention, every family); sliding-window layers (`RotatingKVCache`: mlx-lm's `to_quantized` is not
implemented for it) and recurrent ones (`ArraysCache`) stay as they are. A model whose attention cannot read a
quantized cache (attention sinks: gpt-oss) keeps full precision, found by a one-token probe at load. Prefill
chunks (the solo's, the batch's `prefill_step_size`) are quantized as they are written, so a long prompt's peak
is the quantized cache plus one chunk's full-precision K/V.

No `quantized_kv_start` (mlx-lm's: `maybe_quantize_kv_cache` turns a whole KVCache into a QuantizedKVCache after the
first step whose offset reaches it): a request's cache is quantized from its first token. Converting mid-request
makes the tokens computed before the switch depend on where the switch fell, which is the chunking (the solo's
step target, the batch's prefill_step_size, padding), so solo = batch greedy parity would hold only with every
lane cut at the same token; a batch holds one cache class a layer, so rows on either side of the start would need a
mixed batch cache or a conversion at each merge; the solo's compiled decode graph traces the cache's class and
would be rebuilt; and the prompt caches' blocks would be of two formats in one model (a hit restoring a prefix
shorter than the start as full precision, a longer one quantized). Each is code in a lane that works today.

Invariant: MLX work here runs on the worker's main thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, dynamic_roll

log = logging.getLogger(__name__)

Triple = tuple[mx.array, mx.array, mx.array]  # weights (uint32), scales, biases


class QuantizedKV(QuantizedKVCache):
    """One sequence's quantized K/V: mlx-lm's class, batchable."""

    kv_blocks = True  # cut into blocks as a KVCache (layer_state.py): its rows are its tokens
    keys: Any  # (weights, scales, biases), or None while empty
    values: Any

    def size(self) -> int:
        return self.offset

    @classmethod
    def merge(cls, caches: list) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)


def _zeros(shape: tuple[int, ...], dim: int, dtype: mx.Dtype, group_size: int, bits: int) -> Triple:
    per_int = 32 // bits
    return (mx.zeros((*shape, dim // per_int), dtype=mx.uint32),
            mx.zeros((*shape, dim // group_size), dtype=dtype), mx.zeros((*shape, dim // group_size), dtype=dtype))


def _map(f: Callable[[mx.array], mx.array], t: Any) -> Triple:
    return (f(t[0]), f(t[1]), f(t[2]))


class BatchQuantizedKVCache(BatchKVCache):
    """mlx-lm's BatchKVCache with each of keys and values a (weights, scales, biases) triple."""

    keys: Any
    values: Any

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8) -> None:
        super().__init__(left_padding)
        self.group_size, self.bits = group_size, bits

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Triple, Triple]:
        prev, n = self._idx, keys.shape[2]
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            b, heads, _, dk = keys.shape
            shape = (b, heads, (self.step + n - 1) // self.step * self.step)
            new_k = _zeros(shape, dk, keys.dtype, self.group_size, self.bits)
            new_v = _zeros(shape, values.shape[3], values.dtype, self.group_size, self.bits)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys, self.values = (_map(lambda x: x[..., :prev, :], t) for t in (self.keys, self.values))
                self.keys = tuple(mx.concatenate([x, y], axis=2) for x, y in zip(self.keys, new_k, strict=True))
                self.values = tuple(mx.concatenate([x, y], axis=2) for x, y in zip(self.values, new_v, strict=True))
            else:
                self.keys, self.values = new_k, new_v
        self.offset = self.offset + n
        self._idx += n
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(3):
            self.keys[i][..., prev:self._idx, :] = qk[i]
            self.values[i][..., prev:self._idx, :] = qv[i]
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Triple, Triple]:
        idx = self._idx
        return _map(lambda x: x[..., :idx, :], self.keys), _map(lambda x: x[..., :idx, :], self.values)

    def finalize(self) -> None:
        if self._right_padding is not None:
            padding = self._right_padding
            self.keys, self.values = (_map(lambda x: dynamic_roll(x, padding[:, None], axis=2), t)
                                      for t in (self.keys, self.values))
            self.offset = self.offset - padding
            self.left_padding += padding
            self._right_padding = None

    def filter(self, batch_indices: Any) -> None:
        if self.keys is not None:
            self.keys, self.values = (_map(lambda x: x[batch_indices], t) for t in (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        min_left_pad = min(cast(list[int], self.left_padding.tolist()))
        if min_left_pad > 0:
            if self.keys is not None:
                self.keys, self.values = (_map(lambda x: x[..., min_left_pad:, :], t) for t in (self.keys, self.values))
            self._idx -= min_left_pad
            self.left_padding -= min_left_pad

    def extend(self, other: BatchQuantizedKVCache) -> None:
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        max_idx = max(self._idx, other._idx)
        max_size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        like = self if self.keys is not None else other

        def pad(c: BatchQuantizedKVCache) -> tuple[Triple, Triple, mx.array, mx.array]:
            k, v = c.keys, c.values
            if k is None:
                rows = c.offset.shape[0]
                k, v = (_map(lambda x: mx.zeros((rows, x.shape[1], 0, x.shape[3]), dtype=x.dtype), t)
                        for t in (like.keys, like.values))
            left = max_idx - c._idx
            right = max_size - k[0].shape[2] - left
            if right < 0:
                k, v = (_map(lambda x: x[..., :right, :], t) for t in (k, v))
                right = 0
            if left or right:
                widths = [(0, 0), (0, 0), (left, right), (0, 0)]
                k, v = (_map(lambda x: mx.pad(x, widths), t) for t in (k, v))
            return k, v, c.offset, c.left_padding + left

        (k1, v1, o1, l1), (k2, v2, o2, l2) = pad(self), pad(other)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(k1, k2, strict=True))
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(v1, v2, strict=True))
        self.offset, self.left_padding = mx.concatenate([o1, o2]), mx.concatenate([l1, l2])
        self._idx = max_idx

    def extract(self, idx: int) -> QuantizedKV:
        cache = QuantizedKV(self.group_size, self.bits)
        mx.eval(self.left_padding)
        padding = cast(list[int], self.left_padding.tolist())[idx]
        cache.keys, cache.values = (_map(lambda x: mx.contiguous(x[idx:idx + 1, :, padding:self._idx]), t)
                                    for t in (self.keys, self.values))
        cache.offset = self._idx - padding
        return cache

    @classmethod
    def merge(cls, caches: list) -> BatchQuantizedKVCache:
        first = caches[0]
        lengths = [c.size() for c in caches]
        max_length = max(lengths)
        if max_length == 0:
            return cls([0] * len(caches), first.group_size, first.bits)
        padding = [max_length - n for n in lengths]
        like = next(c for c in caches if c.keys is not None)
        heads = like.keys[0].shape[1]

        def zeros(t: Triple) -> Triple:
            return _map(lambda x: mx.zeros((len(caches), heads, max_length, x.shape[3]), dtype=x.dtype), t)

        keys, values = zeros(like.keys), zeros(like.values)
        for i, (p, c) in enumerate(zip(padding, caches, strict=True)):
            if c.keys is None:
                continue
            for j in range(3):
                keys[j][i:i + 1, :, p:p + c.offset] = c.keys[j][..., :c.offset, :]
                values[j][i:i + 1, :, p:p + c.offset] = c.values[j][..., :c.offset, :]
        cache = cls(padding, first.group_size, first.bits)
        cache.keys, cache.values = keys, values
        cache.offset += max_length
        cache._idx = max_length
        return cache

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(x.nbytes for t in (self.keys, self.values) for x in t)


def group_for(dim: int, group_size: int) -> int | None:
    """The group size a head dimension `dim` takes: the one asked for, else the largest of MLX's that divides it."""
    for g in (group_size, 128, 64, 32):
        if g <= dim and dim % g == 0:
            return g
    return None


def quantize_cache(model: nn.Module, bits: int | None, group_size: int = 64) -> int | None:
    """Make `model.make_cache` (what mlx-lm's make_prompt_cache calls) build QuantizedKV for its plain KVCache
    layers. The group size used (None: the model keeps full precision: no bits asked, no KVCache layer, a head
    dimension no group divides, or attention that cannot read a quantized cache)."""
    if not bits:
        return None
    base = model.make_cache if hasattr(model, "make_cache") else (lambda: [KVCache() for _ in model.layers])
    probe = base()
    model(mx.array([[0]]), cache=probe)
    dims = {d for c in probe if type(c) is KVCache and c.keys is not None and c.values is not None
            for d in (c.keys.shape[-1], c.values.shape[-1])}
    groups = {group_for(d, group_size) for d in dims}
    if not dims:
        log.warning("[kv] running cache kept at full precision: no plain KVCache layer (%s)",
                    ", ".join(sorted({type(c).__name__ for c in probe})))
        return None
    if None in groups:
        log.warning("[kv] running cache kept at full precision: head dims %s take no group of %d", sorted(dims),
                    group_size)
        return None
    first = min(g for g in groups if g is not None)
    # the group asked for, then a smaller one where attention cannot read that one: MLX CUDA 0.32.4 has no quantized
    # matmul for a head dimension of 64 in groups of 64, and has it in groups of 32 (bench/results/gpu/kv_quant/)
    tries = [first, *(g for g in (32,) if g < first and all(d % g == 0 for d in dims))]
    for group in tries:
        def make_cache(group: int = group) -> list:
            return [QuantizedKV(group, bits) if type(c) is KVCache else c for c in base()]

        try:
            mx.eval(model(mx.array([[0, 0]]), cache=make_cache()))
        except Exception as e:  # attention sinks (gpt-oss: mlx-lm's quantized attention refuses them), or
            # attention that reads the cache's K/V as arrays (another library's model classes): full precision, said so
            error = e
            continue
        if group != first:
            log.warning("[kv] running cache quantized in groups of %d: groups of %d failed (%s)", group, first, error)
        model.make_cache = make_cache
        return group
    log.warning("[kv] running cache kept at full precision: %s: %s", type(error).__name__, error)
    return None
