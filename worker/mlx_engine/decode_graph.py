"""A solo's decode step as one compiled MLX graph (issue 15).

One stream is bound by the CPU, not the GPU: each token rebuilds the model's graph op by op
in Python and dispatches it (worker/mlx_engine/solo.py's SoloTimes: the GPU never makes a
token wait). `mx.compile` traces the step once and replays it from C++, fusing its elementwise
ops. A graph replays only if its shapes and constants are the same, and mlx-lm's KVCache is
neither: it slices with the Python int `offset` and grows by concatenation. So while the step
runs compiled, every attention layer's keys and values live in a buffer of fixed capacity (a
multiple of `CAPACITY_STEP`), the fill is an array, a token's K/V is written with
`mx.slice_update` at it, and attention reads the whole buffer under a mask of the filled
positions. Recurrent layers (ArraysCache: fixed-shape state) pass through as they are.

Models whose caches are all KVCache and ArraysCache (Llama, Qwen3 dense and MoE, the Qwen3.5
hybrids) use it; the rest (sliding windows, quantized caches) decode uncompiled. The graph is
traced once per capacity per worker (the first token past a multiple of CAPACITY_STEP pays it; the
first capacity is traced at load where the engine warms up).

Measured (bench.diagnose engine, worker): on this CPU the compiled step takes ~0.6x the uncompiled
one (tiny model: 0.86-0.91 against 1.42 ms per token; stream_generate 1.44). On an H200 (MLX CUDA,
1b preset) it took ~1.3x (worker: 3.4 against 2.2 ms), masked or biased alike, and its first trace
builds kernels for 11-17 s; so the worker's `--solo auto` leaves it off there (`solo_modes`). Metal
is not measured here; its fused attention takes the mask, and auto turns the graph on.

Invariants: `DecodeState.n` is the fill, the same as `off`; positions >= n of a buffer are
never weigh in attention; `write_back` leaves the solo's cache objects exactly as uncompiled decoding
would have (keys and values of length n, offset n), so the batch and the prompt caches see
no difference.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

CAPACITY_STEP = 512  # K/V positions a buffer grows by: one retrace per step, at most this many unfilled positions read
SDPA_HEAD_DIMS = (64, 96, 128, 256)  # head sizes MLX CUDA's one-query attention kernel takes
HIDDEN = -1e4  # the bias channel of a key not filled yet: its score times any scale underflows to a zero weight
_FAST_SDPA = mx.fast.scaled_dot_product_attention


SOLO_MODES = ("auto", "compiled", "plain", "off")


def solo_modes(mode: str) -> tuple[bool, bool]:
    """(a request alone runs solo, its decode steps compiled) for the worker's `--solo` mode. auto: compiled except
    where MLX runs on CUDA: there the compiled step measured slower than uncompiled decoding (bench/README.md)."""
    if mode not in SOLO_MODES:
        raise ValueError(f"solo mode must be one of {SOLO_MODES}, not {mode!r}")
    return mode != "off", mode == "compiled" or (mode == "auto" and not mx.cuda.is_available())


def bias_dim(head_dim: int) -> int:
    """The head size a key with a bias channel is padded to (0: none is free, attention takes a mask)."""
    return next((p for p in SDPA_HEAD_DIMS if p > head_dim), 0)


class _Slots:
    """A KVCache stand-in inside the graph: a fixed buffer, written at the fill `offset` (an array).

    Unfilled positions are hidden from attention in one of two ways. `mask` (pad 0): a boolean mask of the filled
    positions, which Metal's and the CPU's attention take. `bias` (pad P): keys and values are padded to head size
    P, with one channel of each key a bias (0 filled, HIDDEN not) that the query meets with a 1 (graph._sdpa), so
    attention needs no mask: MLX CUDA's fused attention takes none, and without it falls back to separate ops."""

    __slots__ = ("keys", "values", "offset", "pad")

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, pad: int) -> None:
        self.keys, self.values, self.offset, self.pad = keys, values, offset, pad

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array | None:
        if self.pad:
            return None
        # one query at position `offset` sees the positions filled so far and itself
        return (mx.arange(self.keys.shape[2]) <= self.offset)[None]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.pad:
            keys, values = _padded(keys, self.pad), _padded(values, self.pad)
        self.keys = mx.slice_update(self.keys, keys, self.offset, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.offset, axes=(2,))
        return self.keys, self.values


def _padded(a: mx.array, dim: int) -> mx.array:
    return mx.concatenate([a, mx.zeros((*a.shape[:-1], dim - a.shape[-1]), a.dtype)], axis=-1)


@dataclass(slots=True)
class DecodeState:
    n: int  # the fill (tokens in the cache)
    off: mx.array  # the same, as an int32 array of shape (1,)
    keys: list[mx.array]  # per attention layer, capacity >= n
    values: list[mx.array]
    arrays: list[list[mx.array]]  # per recurrent layer, its state


def _grown(a: mx.array, capacity: int, bias_at: int | None = None) -> mx.array:
    """`a` with rows added up to `capacity`: zeros, and HIDDEN in the channel `bias_at` (unfilled keys)."""
    rows = mx.zeros((*a.shape[:2], capacity - a.shape[2], a.shape[3]), a.dtype)
    if bias_at is not None:
        rows[..., bias_at] = HIDDEN
    return mx.concatenate([a, rows], axis=2)


class DecodeGraph:
    """The compiled decode step of one model (one per engine: traces are kept per capacity)."""

    def __init__(self, model: nn.Module, attention: str = "auto") -> None:
        """`attention`: how unfilled positions are hidden (_Slots): "mask", "bias", or "auto" (bias where MLX runs
        on CUDA, mask elsewhere)."""
        if attention not in ("auto", "mask", "bias"):
            raise ValueError(f"attention must be auto, mask or bias, not {attention!r}")
        self.model = model
        self.bias = attention == "bias" or (attention == "auto" and mx.cuda.is_available())
        self._step = mx.compile(self._forward)
        self._kinds: tuple[str, ...] = ()
        self._dims = (0, 0, 0)  # (key head size, value head size, padded size; 0: masked)
        self.warm_s: float | None = None  # how long warm() took, once it ran

    def warm(self) -> bool:
        """Trace the step at the first capacity, and build its kernels, on a dummy token, so that a first request
        does not wait for it (the engine's warm-up at load). False: this model's caches do not fit the graph."""
        t0 = time.perf_counter()
        cache = make_prompt_cache(self.model)
        self.model(mx.array([[0]]), cache=cache)
        fits = self.fits(cache)
        if fits:
            mx.eval(self.feed(self.start(cache), mx.array([0])))
        self.warm_s = time.perf_counter() - t0
        return fits

    @staticmethod
    def fits(cache: list) -> bool:
        """Whether decoding with `cache` (a solo's, prefilled) can run compiled."""
        kinds = [type(c) for c in cache]
        return (KVCache in kinds and all(k in (KVCache, ArraysCache) for k in kinds)
                and all(c.keys is not None for c in cache if type(c) is KVCache)
                and all(a is not None for c in cache if type(c) is ArraysCache for a in c.cache))

    def start(self, cache: list) -> DecodeState:
        """The graph's state for a prefilled cache (which `fits`)."""
        self._kinds = tuple("kv" if type(c) is KVCache else "arrays" for c in cache)
        kv: list[Any] = [c for c in cache if type(c) is KVCache]  # filled (fits): keys and values are arrays
        recurrent: list[Any] = [c for c in cache if type(c) is ArraysCache]
        n = kv[0].offset
        dk, dv = kv[0].keys.shape[-1], kv[0].values.shape[-1]
        pad = bias_dim(max(dk, dv)) if self.bias and all(
            (c.keys.shape[-1], c.values.shape[-1]) == (dk, dv) for c in kv) else 0
        self._dims = (dk, dv, pad)
        capacity = -(-(n + 1) // CAPACITY_STEP) * CAPACITY_STEP
        keys = [c.keys[..., :n, :] for c in kv]
        values = [c.values[..., :n, :] for c in kv]
        if pad:
            keys, values = [_padded(k, pad) for k in keys], [_padded(v, pad) for v in values]
        bias_at = dk if pad else None
        return DecodeState(n, mx.array([n], mx.int32), [_grown(k, capacity, bias_at) for k in keys],
                           [_grown(v, capacity) for v in values],
                           [list(c.cache) for c in recurrent])

    def feed(self, state: DecodeState, token: mx.array) -> mx.array:
        """Schedule one token into the state; the next token's logprobs (not evaluated), shape (1, vocab)."""
        if state.n + 1 > state.keys[0].shape[2]:
            capacity = state.keys[0].shape[2] + CAPACITY_STEP
            bias_at = self._dims[0] if self._dims[2] else None
            state.keys = [_grown(a, capacity, bias_at) for a in state.keys]
            state.values = [_grown(a, capacity) for a in state.values]
        logprobs, state.off, state.keys, state.values, state.arrays = self._step(
            token, state.off, state.keys, state.values, state.arrays)
        state.n += 1
        return logprobs

    def write_back(self, state: DecodeState, cache: list) -> None:
        """Leave `cache` as uncompiled decoding would have: every token fed is in it."""
        kv = iter(zip(state.keys, state.values))
        arrays = iter(state.arrays)
        for c in cache:
            if type(c) is KVCache:
                k, v = next(kv)
                dk, dv, _ = self._dims
                c.keys, c.values, c.offset = k[..., :state.n, :dk], v[..., :state.n, :dv], state.n
            else:
                c.cache = list(next(arrays))

    def _forward(self, token: mx.array, off: mx.array, keys: list, values: list, arrays: list) -> tuple:
        kv, ar = iter(zip(keys, values)), iter(arrays)
        cache: list = []
        for kind in self._kinds:
            if kind == "kv":
                cache.append(_Slots(*next(kv), off, self._dims[2]))
            else:
                state = next(ar)
                c = ArraysCache(len(state))
                c.cache = list(state)
                cache.append(c)
        mx.fast.scaled_dot_product_attention = self._sdpa  # while tracing (main thread only): see _Slots
        try:
            logits = self.model(token.reshape(1, 1), cache=cache)[:, -1, :]
        finally:
            mx.fast.scaled_dot_product_attention = _FAST_SDPA
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        slots = [c for c in cache if isinstance(c, _Slots)]
        return (logprobs, off + 1, [s.keys for s in slots], [s.values for s in slots],
                [c.cache for c in cache if isinstance(c, ArraysCache)])

    def _sdpa(self, q: mx.array, k: mx.array, v: mx.array, **kw) -> mx.array:
        """Attention over padded keys: the query meets the bias channel with a 1 and the padding with zeros."""
        if k.shape[-1] == q.shape[-1]:
            return _FAST_SDPA(q, k, v, **kw)
        dk, dv, pad = self._dims
        one = mx.ones((*q.shape[:-1], 1), q.dtype)
        q = mx.concatenate([q, one, mx.zeros((*q.shape[:-1], pad - dk - 1), q.dtype)], axis=-1)
        return _FAST_SDPA(q, k, v, **kw)[..., :dv]
