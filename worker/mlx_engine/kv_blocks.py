"""KV blocks: the unit both prompt caches store, and the MLX code that cuts and joins them.

A prompt's tokens are split into blocks of `block_tokens` tokens; only full blocks are cached.
Block i is keyed by a chained hash, key_i = blake2b(key_{i-1} || tokens of block i), with
key_{-1} a root that names the block size, so a key identifies the block's tokens *and every
token before it*: two prompts share block i's key exactly when they share their first
(i + 1) * block_tokens tokens, which is when its K/V are the same (attention is causal). The
longest cached prefix of a new prompt is found by walking its keys until the first miss.

A block holds two arrays, keys (layers, kv_heads, block_tokens, k_dim) and values (same with
v_dim), stacked over the layers so that each block owns one exact-size buffer: its `nbytes`
is the memory it pins, and evicting it frees exactly that. Blocks are immutable.

Invariant: all MLX work here runs on the worker's main thread.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
from mlx_lm.models.cache import KVCache

KEY_BYTES = 16


@dataclass(slots=True, eq=False)
class Block:
    key: bytes
    parent: bytes
    depth: int  # index of the block in its prompt: it covers tokens [depth * n, (depth + 1) * n)
    tokens: tuple[int, ...]
    keys: mx.array
    values: mx.array

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def root_key(block_tokens: int) -> bytes:
    return hashlib.blake2b(f"mlxsup-kv-root:{block_tokens}".encode(), digest_size=KEY_BYTES).digest()


def chain_keys(tokens: list[int], block_tokens: int, n_blocks: int | None = None) -> list[bytes]:
    """The keys of the first `n_blocks` full blocks of `tokens` (all of them when None)."""
    full = len(tokens) // block_tokens
    n = full if n_blocks is None else min(n_blocks, full)
    keys, parent = [], root_key(block_tokens)
    for i in range(n):
        chunk = tokens[i * block_tokens:(i + 1) * block_tokens]
        h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
        h.update(b"".join(t.to_bytes(4, "little") for t in chunk))
        parent = h.digest()
        keys.append(parent)
    return keys


def parent_of(keys: list[bytes], i: int, block_tokens: int) -> bytes:
    return keys[i - 1] if i else root_key(block_tokens)


def is_plain_kv(cache: list) -> bool:
    """True when every layer is a plain KVCache: the only kind these blocks can rebuild."""
    return bool(cache) and all(type(c) is KVCache for c in cache)


def cut_blocks(cache: list[KVCache], tokens: list[int], keys: list[bytes], wanted: list[int],
               block_tokens: int) -> list[Block]:
    """Copy blocks `wanted` (indices into `keys`) out of one sequence's finished cache.

    `cache` holds one sequence (batch 1) whose first len(tokens) positions are `tokens`.
    mx.stack allocates a fresh buffer, so a block never keeps the finished cache alive.
    """
    blocks = []
    for i in wanted:
        s, e = i * block_tokens, (i + 1) * block_tokens
        k = mx.stack([cast(mx.array, c.keys)[0, :, s:e, :] for c in cache])  # filled: the sequence ran
        v = mx.stack([cast(mx.array, c.values)[0, :, s:e, :] for c in cache])
        blocks.append(Block(keys[i], parent_of(keys, i, block_tokens), i, tuple(tokens[s:e]), k, v))
    if blocks:
        mx.eval([a for b in blocks for a in (b.keys, b.values)])
    return blocks


def join_blocks(blocks: list[Block], n_tokens: int) -> list[KVCache]:
    """A per-layer prompt cache holding the first `n_tokens` tokens of the consecutive `blocks`."""
    layers = blocks[0].keys.shape[0]
    cache = []
    for layer in range(layers):
        c = KVCache()
        c.keys = mx.concatenate([b.keys[layer] for b in blocks], axis=1)[None]
        c.values = mx.concatenate([b.values[layer] for b in blocks], axis=1)[None]
        c.offset = n_tokens  # <= the blocks' length: the rest is overwritten by the next tokens
        cache.append(c)
    mx.eval([a for c in cache for a in (c.keys, c.values)])
    return cache
