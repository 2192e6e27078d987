"""KV blocks: the unit both prompt caches store, and the MLX code that cuts and joins them.

A prompt's tokens are split into blocks of `block_tokens` tokens; full blocks are cached in both
tiers, and the hot cache also keeps a finished sequence's partial last block (`cut_tail`), which a
later prompt can only pick up part of (a prefix walk never reaches it: its key is not a chain key).
Block i is keyed by a chained hash, key_i = blake2b(key_{i-1} || tokens of block i), with
key_{-1} a root that names the block size, so a key identifies the block's tokens *and every
token before it*: two prompts share block i's key exactly when they share their first
(i + 1) * block_tokens tokens, which is when its K/V are the same (attention is causal). The
longest cached prefix of a new prompt is found by walking its keys until the first miss.

A block holds the K/V of its tokens for the layers the model's `CacheLayout` cuts into blocks
(worker/mlx_engine/layer_state.py), stacked over those layers so that each block owns one
exact-size buffer per array: keys (layers, kv_heads, block_tokens, k_dim) and values (same
with v_dim), or their quantized form (`kv_bits`: weights, scales and biases of each). A model whose
running cache is quantized (quantized_kv.py) has its blocks cut from it as they are, rows
of its (weights, scales, biases), and a hit restores them into a QuantizedKV with no dequantize or
requantize: a prefix from either tier holds the bits a fresh prefill would. Its
`nbytes` is the memory it pins, and evicting it frees exactly that. A block of a model with
snapshot layers (sliding-window, recurrent) may also carry the `Snapshot` of those layers at its
end: only there can a prefix of such a model be picked up. Blocks are immutable.

Invariant: all MLX work here runs on the worker's main thread.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from worker.mlx_engine.layer_state import CacheLayout, Snapshot, restore_snapshot
from worker.mlx_engine.quantized_kv import QuantizedKV

KEY_BYTES = 16


@dataclass(slots=True, eq=False)
class Block:
    key: bytes
    parent: bytes
    depth: int  # index of the block in its prompt: it covers tokens [depth * n, (depth + 1) * n)
    tokens: tuple[int, ...]
    kv: dict[str, mx.array]  # "k", "v"; quantized: "k.q", "k.s", "k.b", "v.q", "v.s", "v.b"; {}: no block layers
    snapshot: Snapshot | None = None  # the snapshot layers' state after this block's last token

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.kv.values()) + (self.snapshot.nbytes if self.snapshot else 0)

    def with_snapshot(self, snapshot: Snapshot) -> Block:
        return Block(self.key, self.parent, self.depth, self.tokens, self.kv, snapshot)


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


def _quantize(a: mx.array, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """(layers, heads, tokens, dim) quantized along each head's tokens x dim run, in groups of 64 (32 if it must)."""
    flat = a.reshape(*a.shape[:2], -1)
    group = 64 if flat.shape[-1] % 64 == 0 else 32
    w, scales, biases = mx.quantize(flat, group_size=group, bits=bits)
    return w, scales, biases


def _dequantize(w: mx.array, scales: mx.array, biases: mx.array, bits: int, block_tokens: int) -> mx.array:
    n = w.shape[-1] * 32 // bits
    out = mx.dequantize(w, scales, biases, group_size=n // scales.shape[-1], bits=bits)
    return out.reshape(*out.shape[:2], block_tokens, -1)


def cut_blocks(cache: list, layout: CacheLayout, tokens: list[int], keys: list[bytes], wanted: list[int],
               block_tokens: int, wait: bool = True) -> list[Block]:
    """Copy blocks `wanted` (indices into `keys`) out of one sequence's finished cache.

    `cache` holds one sequence (batch 1) whose first len(tokens) positions are `tokens` in its
    block layers. mx.stack allocates a fresh buffer, so a block never keeps the cache alive once
    evaluated: at once (`wait`), or scheduled with mx.async_eval, so the step in flight is not waited for.
    """
    layers = [cast(KVCache, cache[i]) for i in layout.block_layers]
    blocks = []
    for i in wanted:
        s, e = i * block_tokens, (i + 1) * block_tokens
        kv: dict[str, mx.array] = {}
        if layers and isinstance(layers[0], QuantizedKV):
            kv = _rows(layers, s, e)
        elif layers:
            k = mx.stack([cast(mx.array, c.keys)[0, :, s:e, :] for c in layers])  # filled: the sequence ran
            v = mx.stack([cast(mx.array, c.values)[0, :, s:e, :] for c in layers])
            if layout.kv_bits:
                for name, a in (("k", k), ("v", v)):
                    kv.update(zip((f"{name}.q", f"{name}.s", f"{name}.b"), _quantize(a, layout.kv_bits),
                                  strict=True))
            else:
                kv = {"k": k, "v": v}
        blocks.append(Block(keys[i], parent_of(keys, i, block_tokens), i, tuple(tokens[s:e]), kv))
    if blocks:
        (mx.eval if wait else mx.async_eval)([a for b in blocks for a in b.kv.values()])
    return blocks


def _rows(layers: list, s: int, e: int) -> dict[str, mx.array]:
    """Tokens [s, e) of quantized running caches (batch 1), stacked over the layers, as they are."""
    return {f"{name}.{part}": mx.stack([getattr(c, attr)[j][0, :, s:e, :] for c in layers])
            for name, attr in (("k", "keys"), ("v", "values")) for j, part in enumerate("qsb")}


def running_quantized(layout: CacheLayout) -> bool:
    """Whether the block layers are the running cache quantized (their blocks: its rows as they are)."""
    return bool(layout.block_layers) and layout.classes[layout.block_layers[0]] == QuantizedKV.__name__


def tail_key(parent: bytes, tokens: list[int] | tuple[int, ...]) -> bytes:
    """The key of a partial last block: never on a chain of full blocks' keys, found only by its parent."""
    h = hashlib.blake2b(parent + b"partial", digest_size=KEY_BYTES)
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return h.digest()


def cut_tail(cache: list, layout: CacheLayout, tokens: list[int], parent: bytes, block_tokens: int) -> Block:
    """The partial block after the last full one of a finished sequence (block layers only): unquantized, or the
    running cache's quantized rows as they are."""
    s = len(tokens) // block_tokens * block_tokens
    layers = [cast(KVCache, cache[i]) for i in layout.block_layers]
    if isinstance(layers[0], QuantizedKV):
        kv = _rows(layers, s, len(tokens))
    else:
        kv = {"k": mx.stack([cast(mx.array, c.keys)[0, :, s:len(tokens), :] for c in layers]),
              "v": mx.stack([cast(mx.array, c.values)[0, :, s:len(tokens), :] for c in layers])}
    mx.async_eval(list(kv.values()))  # evaluated while the batch goes on, like cut_blocks(wait=False)
    return Block(tail_key(parent, tokens[s:]), parent, s // block_tokens, tuple(tokens[s:]), kv)


def _block_kv(block: Block, layout: CacheLayout, block_tokens: int) -> tuple[mx.array, mx.array]:
    if not layout.kv_bits:
        return block.kv["k"], block.kv["v"]
    kv = block.kv
    return (_dequantize(kv["k.q"], kv["k.s"], kv["k.b"], layout.kv_bits, block_tokens),
            _dequantize(kv["v.q"], kv["v.s"], kv["v.b"], layout.kv_bits, block_tokens))


def join_blocks(blocks: list[Block], n_tokens: int, layout: CacheLayout, block_tokens: int,
                capacity: int = 0) -> list:
    """A whole prompt cache (every layer) holding the first `n_tokens` tokens of the consecutive `blocks`.

    With snapshot layers, `n_tokens` must be the end of the last block, and that block must carry
    the snapshot: the other layers' state comes from it. On a CPU each plain KV layer gets a buffer of its
    own of at least `capacity` positions (the rest zeros), which the compiled decode step takes as it is
    (decode_graph.py): a hit copies its prefix once. On a GPU every layer is one view of a single
    concatenation, whose kernels are one per block, not one per block and layer.
    """
    cache: list = [None] * len(layout.classes)
    if running_quantized(layout):
        assert layout.kv_bits
        joined = {name: mx.concatenate([b.kv[name] for b in blocks], axis=2) for name in blocks[0].kv}
        dim = joined["k.q"].shape[-1] * 32 // layout.kv_bits
        group = dim // joined["k.s"].shape[-1]
        for j, layer in enumerate(layout.block_layers):
            q = QuantizedKV(group, layout.kv_bits)
            q.keys, q.values = (tuple(joined[f"{name}.{part}"][j:j + 1] for part in "qsb") for name in "kv")
            q.offset = n_tokens  # <= the blocks' length: the rest is overwritten by the next tokens
            cache[layer] = q
    elif layout.block_layers and mx.default_device() == mx.cpu:
        parts = [_block_kv(b, layout, block_tokens) for b in blocks]
        room = capacity - sum(k.shape[2] for k, _ in parts)

        def padding(a: mx.array) -> list[mx.array]:
            return [mx.zeros((1, a.shape[1], room, a.shape[3]), a.dtype)] if room > 0 else []

        for j, layer in enumerate(layout.block_layers):
            c = KVCache()
            c.keys = mx.concatenate([k[j:j + 1] for k, _ in parts] + padding(parts[0][0]), axis=2)
            c.values = mx.concatenate([v[j:j + 1] for _, v in parts] + padding(parts[0][1]), axis=2)
            c.offset = n_tokens
            cache[layer] = c
    elif layout.block_layers:
        parts = [_block_kv(b, layout, block_tokens) for b in blocks]
        # one concatenation over all layers, cut into per-layer views: a copy per block, not per block and layer
        # (a 30k-token prompt of a 20-layer model is 470 blocks: 940 copies, not 18,800 kernels on a GPU)
        keys = mx.concatenate([k for k, _ in parts], axis=2)
        values = mx.concatenate([v for _, v in parts], axis=2)
        for j, layer in enumerate(layout.block_layers):
            c = KVCache()
            c.keys, c.values = keys[j:j + 1], values[j:j + 1]
            c.offset = n_tokens  # <= the blocks' length: the rest is overwritten by the next tokens
            cache[layer] = c
    if layout.snapshots:
        snapshot = blocks[-1].snapshot
        if snapshot is None or n_tokens != len(blocks) * block_tokens:
            raise ValueError("a prefix of a model with snapshot layers must end at a block with a snapshot")
        for layer, c in zip(layout.snapshot_layers, restore_snapshot(snapshot), strict=True):
            cache[layer] = c
    mx.eval([cache[layer].state for layer in layout.block_layers])
    return cache
