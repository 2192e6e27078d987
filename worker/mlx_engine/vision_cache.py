"""What keeps a vision worker's caches correct and its tower's work done once (worker/mlx_engine/vision.py uses it).

`image_hashes` and `image_keys`: the prompt caches know a prompt by its ids with each image's placeholder run
replaced by ids drawn from a hash of the pixels the processor fed the model (and its grid), past any vocabulary,
so the same image in a later turn is a hit and a different one at the same place a miss. `CachedTower`: the vision
tower's output for an image seen before (same hash) is reused from a bounded LRU, not computed again.
Invariant: the model, the batch and the logits processors only ever see real ids; the keys are the caches' alone.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

TOWER_CACHE_BYTES = 256 * 2**20  # the vision tower's outputs kept for images seen before
KEY_BASE = 1 << 30  # image key ids start past any vocabulary; chain_keys packs ids in 4 bytes


def image_hashes(pixel_values: mx.array, grid: mx.array | None, count: int) -> list[bytes]:
    """Each image's hash over the pixels fed to the model (and its grid): Qwen's rows are all images' patches,
    split by each grid's t*h*w; other families hold one image per leading index."""
    pixels = np.asarray(pixel_values)
    if grid is not None:
        rows = [int(np.prod(g)) for g in np.asarray(grid).tolist()]
        bounds = np.cumsum([0, *rows])
        parts = [(pixels[a:b], np.asarray(g)) for a, b, g in zip(bounds[:-1], bounds[1:], np.asarray(grid), strict=True)]
    else:
        parts = [(pixels[i], np.asarray(pixels.shape[1:])) for i in range(min(count, len(pixels)))]
    out = []
    for data, shape in parts:
        h = hashlib.blake2b(np.ascontiguousarray(shape, dtype=np.int64).tobytes(), digest_size=32)
        h.update(np.ascontiguousarray(data).tobytes())
        out.append(h.digest())
    return out


def image_keys(ids: list[int], image_token: int, hashes: list[bytes]) -> list[int]:
    """`ids` with the k-th run of image tokens replaced by ids drawn from the k-th image's hash (32-bit words, in
    turn, each < 2**30 past KEY_BASE: a run of n tokens carries 30 * min(n, 8) bits of its image)."""
    runs, start = [], None
    for i, t in enumerate([*ids, -1]):
        if t == image_token and start is None:
            start = i
        elif t != image_token and start is not None:
            runs.append((start, i))
            start = None
    if len(runs) != len(hashes):  # a processor that splits an image: every run keyed by all of them together
        hashes = [hashlib.blake2b(b"".join(hashes), digest_size=32).digest()] * len(runs)
    keys = list(ids)
    for (a, b), digest in zip(runs, hashes, strict=True):
        words = [int.from_bytes(digest[i:i + 4], "little") % KEY_BASE for i in range(0, 32, 4)]
        keys[a:b] = [KEY_BASE + words[j % 8] for j in range(b - a)]
    return keys


class CachedTower(nn.Module):
    """The vision tower, with its output for an image seen before (same pixels) taken from an LRU bounded by bytes.

    Called as the tower is, on all of a prompt's images at once; runs the tower on the images it lacks only, one at
    a time (the tower encodes each image on its own: Qwen's attention is per image, SigLIP's per batch row)."""

    def __init__(self, tower: nn.Module, budget_bytes: int = TOWER_CACHE_BYTES) -> None:
        super().__init__()
        self.tower = tower
        self.kept = _Lru(budget_bytes)
        self.runs = 0  # images the tower encoded (tests count them)

    def __getattr__(self, key: str) -> Any:  # the tower's own attributes (Qwen reads patch_embed's dtype)
        if key in self:
            return self[key]
        if "tower" not in self:  # while __init__ runs
            raise AttributeError(key)
        return getattr(self["tower"], key)

    def __call__(self, pixels: mx.array, grid: mx.array | None = None, **kwargs: Any) -> tuple:
        hashes = image_hashes(pixels, grid, len(pixels))
        outs = []
        for i, digest in enumerate(hashes):
            out = self.kept.get(digest)
            if out is None:
                if grid is not None:
                    a = int(sum(int(np.prod(g)) for g in np.asarray(grid[:i]).tolist()))
                    b = a + int(np.prod(np.asarray(grid[i])))
                    features, deep = self.tower(pixels[a:b], grid[i:i + 1], **kwargs)
                    out = (features, list(deep))
                else:
                    out = (self.tower(pixels[i:i + 1], **kwargs)[0], None)  # SigLIP: (pooled, embeddings, states)
                mx.eval(out[0], out[1] or [])
                self.runs += 1
                self.kept.put(digest, out, out[0].nbytes + sum(d.nbytes for d in out[1] or []))
            outs.append(out)
        features = mx.concatenate([o[0] for o in outs], axis=0)
        if grid is None:
            return features, None, None
        return features, [mx.concatenate(list(layer), axis=0) for layer in zip(*(o[1] for o in outs), strict=True)]


class _Lru:
    def __init__(self, budget: int) -> None:
        self.budget, self.nbytes = budget, 0
        self.items: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()

    def get(self, key: bytes) -> Any:
        if key not in self.items:
            return None
        self.items.move_to_end(key)
        return self.items[key][0]

    def clear(self) -> None:
        self.items.clear()
        self.nbytes = 0

    def put(self, key: bytes, value: Any, nbytes: int) -> None:
        if nbytes > self.budget:
            return
        self.items[key] = (value, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.budget:
            self.nbytes -= self.items.popitem(last=False)[1][1]
