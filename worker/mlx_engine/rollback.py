"""Undoing tokens fed to a cache: the rejected drafts of a verification (speculative decoding).

A verification feeds the token in hand and k drafts in one forward pass, and keeps a prefix of them. Two ways back:

- **trim**: a KVCache (quantized or not) drops its last n tokens exactly, and so does a RotatingKVCache while the
  tokens fed fit in its window (`room`: past it the window overwrote what a trim would need).
- **mark and re-feed**: a recurrent layer (ArraysCache: a Gated DeltaNet state folds in every token) cannot go
  back, nor a sliding window that is full. Their state is marked before the verification (`mark`), given back
  after it while every other layer drops all the tokens fed (`restore`), and the caller feeds the kept tokens again
  in one forward pass. The tokens' K/V and recurrent states come out as a plain decode of them gives.

A mark holds references, not copies, which costs nothing whatever the window's size: mlx-lm's layers replace their
state's arrays (ArraysCache `cache[i] = ...`; a RotatingKVCache update of several tokens concatenates) and never
write into them, except a RotatingKVCache's update of one token, which writes in place. Invariant: a mark is
taken right before a feed of at least two tokens, and used (or dropped) before the next feed.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import ArraysCache, CacheList, RotatingKVCache

MARKED = (ArraysCache, RotatingKVCache)  # the layers a mark holds the state of, where a trim cannot undo a feed


def room(cache: list | tuple) -> int:
    """How many tokens can be fed to `cache` and trimmed back exactly (0: none)."""
    left = sys.maxsize
    for c in cache:
        if isinstance(c, CacheList):
            left = min(left, room(c.caches))
        elif isinstance(c, RotatingKVCache):
            left = min(left, max(0, c.max_size - c.offset))
        elif not c.is_trimmable():
            return 0
    return left


def undoable(cache: list) -> bool:
    """Whether any number of tokens fed to `cache` can be undone: each layer is trimmed or marked."""
    return all(isinstance(c, MARKED) or c.is_trimmable() for c in cache)


def trim(cache: list, n: int) -> None:
    if n > 0:
        for c in cache:
            c.trim(n)


def mark(cache: list, n: int, copies: bool = False) -> dict[int, Any] | None:
    """Before feeding n tokens to an `undoable` cache: the marked layers' state, by layer (None: a trim undoes them).
    References hold it where the feed is of at least 2 tokens; `copies` for feeds of one token at a time (a draft
    model's), which a RotatingKVCache writes into its arrays in place."""
    if room(cache) >= n:
        return None
    keep = (lambda leaf: mx.array(leaf) if isinstance(leaf, mx.array) else leaf) if copies else (lambda leaf: leaf)
    return {i: tree_map(keep, c.state) for i, c in enumerate(cache) if isinstance(c, MARKED)}


def restore(cache: list, marked: dict[int, Any], n: int) -> None:
    """Undo the n tokens fed since `marked` was taken: the marked layers get their state back, the others drop
    them."""
    for i, c in enumerate(cache):
        if i in marked:
            c.state = marked[i]
        else:
            c.trim(n)
