"""What a model's cache layers are made of, and the snapshots of the layers that cannot be cut into blocks.

A model's prompt cache (mlx-lm's `make_prompt_cache`) is a list of per-layer caches. The prompt
caches treat each layer one of two ways (`CacheLayout`):

- **blocks**: a plain `KVCache` holds one key and one value per token, so its state for any prefix
  is a slice. These layers are cut into token blocks (worker/mlx_engine/kv_blocks.py) and joined
  again for any block-aligned prefix.
- **snapshot**: every other kind (`RotatingKVCache` of sliding-window layers, `ArraysCache` of
  recurrent layers such as Gated DeltaNet, `CacheList`, quantized caches, what mlx-lm adds next)
  holds state that cannot be cut: a rotating buffer past its window, a recurrent state that folds
  in every token. Their whole state is copied at chosen block boundaries during prefill, and a
  prefix is reusable only up to a boundary that has such a snapshot.

A snapshot goes through mlx-lm's own cache-state protocol (`cache.state`, `Class.from_state`, as
`save_prompt_cache` uses it): its tree of state is flattened into arrays and JSON scalars, so any
cache class mlx-lm defines round-trips, nested ones (`CacheList`) included, with no per-class code.

Numpy conversions live here too: the SSD writer thread only ever sees numpy (bfloat16 travels as
its 16-bit pattern). Invariant: MLX work here runs on the worker's main thread.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import KVCache


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """Which of a model's layers are cut into blocks and which are snapshotted, and how blocks are stored."""

    classes: tuple[str, ...]  # each layer's cache class, as make_prompt_cache builds it
    block_layers: tuple[int, ...]
    snapshot_layers: tuple[int, ...]
    kv_bits: int | None = None  # blocks' K/V stored quantized to this many bits (None: as computed)

    @classmethod
    def of(cls, probe: list, kv_bits: int | None = None) -> CacheLayout:
        kinds = [type(c) is KVCache or getattr(c, "kv_blocks", False) for c in probe]  # vision.py: RopeKVCache
        return cls(tuple(type(c).__name__ for c in probe), tuple(i for i, k in enumerate(kinds) if k),
                   tuple(i for i, k in enumerate(kinds) if not k), kv_bits)

    @property
    def snapshots(self) -> bool:
        """True when a prefix is reusable only at a snapshot (some layer cannot be cut into blocks)."""
        return bool(self.snapshot_layers)

    @property
    def name(self) -> str:
        """A short stable id of this layout: a cache entry written under another one is never used."""
        text = f"{','.join(self.classes)};kv_bits={self.kv_bits}"
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


@dataclass(slots=True, eq=False)
class Snapshot:
    """The snapshot layers' whole state at one token position: arrays, and the scalars and classes as JSON."""

    arrays: dict[str, mx.array]
    meta: dict  # {"classes": [...], "paths": [...], "scalars": {path: value}}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def take_snapshot(layers: list) -> Snapshot:
    """Copy the state of one sequence's caches `layers` (batch 1); evaluated, so it owns its buffers."""
    flat = cast(list[tuple[str, object]], tree_flatten([c.state for c in layers]))
    # mx.array copies: a slice of the batch's state (what `extract` gives) would pin the whole batch's buffer
    arrays = {path: mx.array(v) for path, v in flat if isinstance(v, mx.array)}
    scalars = {path: v for path, v in flat if not isinstance(v, mx.array)}
    for path, v in scalars.items():
        if v is not None and not isinstance(v, (bool, int, float, str)):
            raise TypeError(f"cache state at {path} is a {type(v).__name__}, not an array or a scalar")
    mx.eval(list(arrays.values()))
    return Snapshot(arrays, {"classes": [type(c).__name__ for c in layers], "paths": [p for p, _ in flat],
                             "scalars": scalars})


def restore_snapshot(snapshot: Snapshot) -> list:
    """The caches a snapshot was taken of, rebuilt by their own classes' `from_state`."""
    meta = snapshot.meta
    leaves = [(p, snapshot.arrays[p] if p in snapshot.arrays else meta["scalars"][p]) for p in meta["paths"]]
    states = tree_unflatten(leaves) if leaves else []
    classes = meta["classes"]
    states = list(states) + [[] for _ in range(len(classes) - len(states))]  # a layer with no state at all
    return [getattr(mlx_cache, name).from_state(state) for name, state in zip(classes, states, strict=True)]


# --- numpy, for the SSD tier ----------------------------------------------------------------

def dtype_name(a: mx.array) -> str:
    return str(a.dtype).rsplit(".", 1)[-1]


def to_numpy(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def from_numpy(a: np.ndarray, dtype: str) -> mx.array:
    arr = mx.array(a)
    return arr.view(mx.bfloat16) if dtype == "bfloat16" else arr
