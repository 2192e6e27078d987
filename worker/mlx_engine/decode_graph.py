"""A solo's decode step as one compiled MLX graph.

One stream is bound by the CPU, not the GPU: each token rebuilds the model's graph op by op
in Python and dispatches it (worker/mlx_engine/solo.py's SoloTimes: the GPU never makes a
token wait). `mx.compile` traces the step once and replays it from C++, fusing its elementwise
ops. A graph replays only if its shapes and constants are the same, and mlx-lm's KVCache is
neither: it slices with the Python int `offset` and grows by concatenation. So while the step
runs compiled, every attention layer's keys and values live in a buffer of fixed capacity
(`capacity_for`), the fill is an array, a token's K/V is written with
`mx.slice_update` at it, and attention reads the whole buffer under a mask of the filled
positions. Recurrent layers (ArraysCache: fixed-shape state) pass through as they are.

A verification of drafted tokens (speculative.py) runs through the same graph (`verify`: n tokens, a causal mask
over the buffer), and rejected drafts are undone by moving the fill back (`rollback`): what they wrote lies past
it, masked, until overwritten; so a solo that drafts keeps its cache in the graph (one trace per n and capacity).

Models whose caches are all KVCache and ArraysCache (Llama, Qwen3 dense and MoE, the Qwen3.5
hybrids) use it, and so do their running caches quantized (QuantizedKV, `kv_bits`: each of
keys and values a (weights, scales, biases) buffer, a token quantized as it is written at the fill, read
by mlx-lm's quantized attention under the same mask); the rest (sliding windows) decode uncompiled. The graph is
traced once per capacity per worker (the first token past a capacity pays it; the first capacity is
traced by the engine's idle warm-up, after Ready). Capacities step by 64 positions up to 1024 and by 1/8 to
1/16 of the fill beyond: attention reads at most that many masked positions (a 512-position step
cost the `small` preset 8% a token on this CPU), and a long context is traced ~8 times per doubling.

Measured (bench.diagnose engine, worker): on this CPU the compiled step takes ~0.6x the uncompiled
one (tiny model: 0.86-0.91 against 1.42 ms per token; stream_generate 1.44). On an H200 (MLX CUDA,
1b preset) it took ~1.5x (worker: 3.4-3.8 against 2.2 ms), and its first trace builds kernels for
11-17 s at load; so the worker's `--solo auto` leaves it off there and builds each step's graph ahead instead
(`solo_modes`, solo.py's Ahead). The mask is not
why: MLX CUDA's fused one-query attention takes no array mask, but a variant that hid the unfilled
keys with a bias channel in padded heads instead, keeping attention fused, was no faster (removed;
bench/results/history/gpu/diag-compiled-2026-11-21). Metal is not measured here; its fused attention takes
the mask, and auto turns the graph on.

Invariants: `DecodeState.n` is the fill, the same as `off`; positions >= n of a buffer
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

from worker.mlx_engine.quantized_kv import QuantizedKV
from worker.mlx_engine.taps import tap_of

KV = (KVCache, QuantizedKV)  # the attention layers the graph holds in fixed buffers

MIN_STEP = 64  # the fewest K/V positions a buffer grows by


def capacity_for(n: int) -> int:
    """The buffer capacity for a fill of n positions: n rounded up to a step of max(MIN_STEP, ~n/16..n/8)."""
    step = max(MIN_STEP, 1 << max(0, n.bit_length() - 4))
    return -(-n // step) * step


SOLO_MODES = ("auto", "compiled", "ahead", "plain", "off")


def solo_modes(mode: str) -> tuple[bool, bool, bool]:
    """(a request alone runs solo, its decode steps compiled, each uncompiled step's graph built ahead on a thread
    of its own: solo.py's Ahead) for the worker's `--solo` mode. auto: compiled, except where MLX runs on CUDA: there
    the compiled step measured slower than uncompiled decoding (bench/README.md), and the steps are built ahead."""
    if mode not in SOLO_MODES:
        raise ValueError(f"solo mode must be one of {SOLO_MODES}, not {mode!r}")
    cuda = mx.cuda.is_available()
    return mode != "off", mode == "compiled" or (mode == "auto" and not cuda), mode == "ahead" or (mode == "auto" and cuda)


class _Slots:
    """A KVCache stand-in inside the graph: a fixed buffer, written at the fill `offset` (an array)."""

    __slots__ = ("keys", "values", "offset")

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array) -> None:
        self.keys, self.values, self.offset = keys, values, offset

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        # query i, at position offset + i, sees the positions filled so far, the queries before it and itself
        return mx.arange(self.keys.shape[2])[None] <= (self.offset + mx.arange(n))[:, None]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys, self.offset, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.offset, axes=(2,))
        return self.keys, self.values


class _QSlots:
    """A QuantizedKV stand-in: keys and values each a (weights, scales, biases) buffer; `bits` sends attention
    through mlx-lm's quantized path."""

    __slots__ = ("keys", "values", "offset", "group_size", "bits")

    def __init__(self, keys: Any, values: Any, offset: mx.array, group_size: int, bits: int) -> None:
        self.keys, self.values, self.offset = keys, values, offset
        self.group_size, self.bits = group_size, bits

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        return mx.arange(self.keys[0].shape[2])[None] <= (self.offset + mx.arange(n))[:, None]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        self.keys = tuple(mx.slice_update(b, x, self.offset, axes=(2,)) for b, x in zip(self.keys, qk, strict=True))
        self.values = tuple(mx.slice_update(b, x, self.offset, axes=(2,)) for b, x in zip(self.values, qv, strict=True))
        return self.keys, self.values


@dataclass(slots=True)
class DecodeState:
    n: int  # the fill (tokens in the cache)
    off: mx.array  # the same, as an int32 array of shape (1,)
    keys: list[Any]  # per attention layer, capacity >= n (a quantized layer's: its three buffers)
    values: list[Any]
    arrays: list[list[mx.array]]  # per recurrent layer, its state


def _grown(a: Any, capacity: int) -> Any:
    """`a` with zero rows added up to `capacity` positions (each part of a quantized buffer)."""
    if isinstance(a, tuple):
        return tuple(_grown(x, capacity) for x in a)
    rows = mx.zeros((*a.shape[:2], capacity - a.shape[2], a.shape[3]), a.dtype)
    return mx.concatenate([a, rows], axis=2)


def _upto(a: Any, n: int) -> Any:
    """The first n positions of a buffer (each part of a quantized one)."""
    return tuple(x[..., :n, :] for x in a) if isinstance(a, tuple) else a[..., :n, :]


def _taken(a: Any, n: int, capacity: int) -> Any:
    """A cache's buffer for the graph: itself at `capacity` positions (past n: never read unmasked), else its first n
    positions grown to it."""
    return a if _positions(a) == capacity else _grown(_upto(a, n), capacity)


def _positions(a: Any) -> int:
    return (a[0] if isinstance(a, tuple) else a).shape[2]


class DecodeGraph:
    """The compiled decode step of one model (one per engine: traces are kept per capacity)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._step = mx.compile(self._forward)
        self._tap = tap_of(model)  # a drafter's tap (taps.py): the step returns the hidden states too
        # each layer's cache kind, as make_prompt_cache builds them: the graph's layout (used where they `fit`)
        self._kinds = tuple((c.group_size, c.bits) if type(c) is QuantizedKV else "kv" if type(c) is KVCache
                            else "arrays" for c in make_prompt_cache(model))
        self.warm_s: float | None = None  # how long warm() took, once it ran

    def warm(self) -> bool:
        """Trace the step at the first capacity, and build its kernels, on a dummy token, so that a first request
        does not wait for it (the engine's idle warm-up, Engine.warm_step). False: this model's caches do not fit the graph."""
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
        return (any(k in KV for k in kinds) and all(k in (*KV, ArraysCache) for k in kinds)
                and all(c.keys is not None for c in cache if type(c) in KV)
                and all(a is not None for c in cache if type(c) is ArraysCache for a in c.cache))

    def start(self, cache: list) -> DecodeState:
        """The graph's state for a prefilled cache (which `fits`). A KV buffer already at the graph's capacity (a
        prefill's, or a hit's: kv_blocks.join_blocks) is taken as it is, and the cache lets go of it, so that the
        graph's first write lands in it instead of a copy; `write_back` gives the cache its K/V again."""
        kv: list[Any] = [c for c in cache if type(c) in KV]  # filled (fits): keys and values are arrays (triples)
        recurrent: list[Any] = [c for c in cache if type(c) is ArraysCache]
        n = kv[0].offset
        capacity = capacity_for(n + 1)
        keys = [_taken(c.keys, n, capacity) for c in kv]
        values = [_taken(c.values, n, capacity) for c in kv]
        for c in kv:
            c.keys = c.values = None  # the graph's now: a reference left here would make its first write a copy
        return DecodeState(n, mx.array([n], mx.int32), keys, values, [list(c.cache) for c in recurrent])

    def feed(self, state: DecodeState, token: mx.array) -> mx.array:
        """Schedule one token into the state; the next token's logprobs (not evaluated), shape (1, vocab)."""
        return self.verify(state, token)

    def verify(self, state: DecodeState, tokens: mx.array) -> mx.array:
        """Schedule n tokens into the state (a token and its drafts); the logprobs after each, shape (n, vocab).
        Traced once per n and capacity."""
        n = tokens.size
        if state.n + n > _positions(state.keys[0]):
            capacity = capacity_for(state.n + n)
            state.keys = [_grown(a, capacity) for a in state.keys]
            state.values = [_grown(a, capacity) for a in state.values]
        logprobs, state.off, state.keys, state.values, state.arrays, *hidden = self._step(
            tokens, state.off, state.keys, state.values, state.arrays)
        if self._tap is not None:
            self._tap.ready = hidden[0]
        state.n += n
        return logprobs

    @staticmethod
    def rollback(state: DecodeState, n: int, arrays: list[list[mx.array]] | None = None) -> None:
        """Forget the last n tokens fed (rejected drafts): the fill goes back; what they wrote lies past it, masked,
        and is overwritten by the next tokens. A recurrent state cannot go back: `arrays` is the one from before
        them (`state.arrays` then: the step replaces it, never writes into it)."""
        if n > 0:
            assert arrays is not None or not state.arrays, "a recurrent layer's state cannot be rolled back"
            state.n -= n
            state.off = mx.array([state.n], mx.int32)
            state.arrays = state.arrays if arrays is None else arrays

    def write_back(self, state: DecodeState, cache: list) -> None:
        """Leave `cache` as uncompiled decoding would have: every token fed is in it."""
        kv = iter(zip(state.keys, state.values))
        arrays = iter(state.arrays)
        for c in cache:
            if type(c) in KV:
                k, v = next(kv)
                c.keys, c.values, c.offset = _upto(k, state.n), _upto(v, state.n), state.n
            else:
                c.cache = list(next(arrays))

    def _forward(self, token: mx.array, off: mx.array, keys: list, values: list, arrays: list) -> tuple:
        kv, ar = iter(zip(keys, values)), iter(arrays)
        cache: list = []
        for kind in self._kinds:
            if kind == "kv":
                cache.append(_Slots(*next(kv), off))
            elif isinstance(kind, tuple):
                cache.append(_QSlots(*next(kv), off, *kind))
            else:
                state = next(ar)
                c = ArraysCache(len(state))
                c.cache = list(state)
                cache.append(c)
        tap = self._tap
        if tap is not None:
            tap.on = True
        try:
            logits = self.model(token.reshape(1, -1), cache=cache)[0]
        finally:
            if tap is not None:
                tap.on = False
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        slots = [c for c in cache if isinstance(c, (_Slots, _QSlots))]
        return (logprobs, off + token.size, [s.keys for s in slots], [s.values for s in slots],
                [c.cache for c in cache if isinstance(c, ArraysCache)], *([] if tap is None else [tap.collect()]))
