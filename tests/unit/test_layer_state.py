"""Prompt caches for every cache type, on real MLX arrays (CPU) without a model.

Snapshots round-trip each mlx-lm cache class through its own state protocol; blocks cut and join
(quantized too); and `PromptCaches` picks the deepest cached block that ends at a snapshot, from
memory or from disk, and never hands out a prefix of a snapshot model that has no snapshot.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from worker.mlx_engine.decode_graph import DecodeGraph, capacity_for
from worker.mlx_engine.kv_blocks import chain_keys, cut_blocks, join_blocks
from worker.mlx_engine.layer_state import CacheLayout, restore_snapshot, take_snapshot
from worker.mlx_engine.prompt_cache import CacheOptions, PromptCaches

B = 8  # block tokens


def filled_kv(tokens: int, seed: int = 0, heads: int = 2, dim: int = 16) -> KVCache:
    c = KVCache()
    k = mx.random.normal((1, heads, tokens, dim), key=mx.random.key(seed))
    c.update_and_fetch(k, k * 2)
    return c


def rotating(tokens: int, window: int = 8) -> RotatingKVCache:
    c = RotatingKVCache(window)
    for i in range(tokens):  # one token at a time: the buffer rotates
        k = mx.full((1, 2, 1, 16), float(i))
        c.update_and_fetch(k, -k)
    return c


def arrays(seed: float) -> ArraysCache:
    c = ArraysCache(3)
    c[0] = mx.full((1, 3, 4), seed)
    c[2] = mx.full((1, 2, 5, 5), -seed, dtype=mx.bfloat16)  # c[1] stays None
    return c


def state_leaves(caches: list) -> list:
    flat = tree_flatten([c.state for c in caches])
    return [(p, v.tolist() if isinstance(v, mx.array) else v) for p, v in flat]


@pytest.mark.parametrize("make", [
    lambda: [rotating(21)],
    lambda: [arrays(1.5)],
    lambda: [CacheList(filled_kv(5), arrays(2.0))],
    lambda: [filled_kv(6, dim=64).to_quantized(group_size=64, bits=8)],
    lambda: [arrays(3.0), rotating(5), CacheList(arrays(4.0))],
], ids=["rotating", "arrays", "cache-list", "quantized", "mixed"])
def test_a_snapshot_round_trips_every_cache_class(make) -> None:
    original = make()
    snapshot = take_snapshot(original)
    restored = restore_snapshot(snapshot)
    assert [type(c) for c in restored] == [type(c) for c in original]
    assert state_leaves(restored) == state_leaves(original)


def test_a_snapshot_owns_its_buffers() -> None:
    """A snapshot of one sequence sliced out of a batch must not pin the batch's whole state."""
    before = mx.get_active_memory()  # what the tests before this one keep (a module's model): not this test's
    batch = mx.random.normal((8, 256, 256))  # a real buffer (mx.zeros would be a broadcast, copied anyway)
    mx.eval(batch)
    one = ArraysCache(1)
    one[0] = batch[3:4]
    snapshot = take_snapshot([one])
    del batch, one
    assert snapshot.nbytes == 256 * 256 * 4
    assert mx.get_active_memory() - before < 8 * 256 * 256 * 4  # the batch buffer is gone


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_blocks_cut_and_join_back_to_the_same_prefix(bits: int | None) -> None:
    layout = CacheLayout(("KVCache", "KVCache"), (0, 1), (), bits)
    cache = [filled_kv(3 * B, seed=1), filled_kv(3 * B, seed=2)]
    tokens = list(range(3 * B))
    keys = chain_keys(tokens, B)
    blocks = cut_blocks(cache, layout, tokens, keys, [0, 1, 2], B)
    joined = join_blocks(blocks, 2 * B + 3, layout, B)
    assert [c.offset for c in joined] == [2 * B + 3] * 2
    full = 2 * 16 * 3 * B * 4 * 2 * 2  # heads * dim * tokens * float32 * (K, V) * layers
    stored = sum(b.nbytes for b in blocks)
    for got, want in zip(joined, cache, strict=True):
        err = float(mx.max(mx.abs(got.keys[..., :3 * B, :] - want.keys[..., :3 * B, :])))
        if bits is None:
            assert err == 0 and stored == full
        else:  # affine quantization: small error, and 4x / ~7x fewer bytes than float32 (scales and biases too)
            assert 0 < err < (0.1 if bits == 8 else 1.0)
            assert stored < full / (3 if bits == 8 else 5)


def test_joining_copies_each_block_once_not_once_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 30k-token hit is ~470 blocks: a copy per block and layer was ~19k GPU kernels for a 20-layer model, most
    of a warm agent turn's time to first token (docs/agent-sessions.md)."""
    layers = 4
    layout = CacheLayout(("KVCache",) * layers, tuple(range(layers)), (), None)
    cache = [filled_kv(3 * B, seed=i) for i in range(layers)]
    tokens = list(range(3 * B))
    blocks = cut_blocks(cache, layout, tokens, chain_keys(tokens, B), [0, 1, 2], B)
    copied: list[mx.array] = []
    concatenate = mx.concatenate

    def counting(arrays: list[mx.array], *args: object, **kwargs: object) -> mx.array:
        copied.extend(arrays)
        return concatenate(arrays, *args, **kwargs)

    monkeypatch.setattr(mx, "concatenate", counting)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))  # the GPU's way (a kernel per copy)
    joined = join_blocks(blocks, 3 * B - 2, layout, B)
    assert len(copied) == 2 * len(blocks)  # each block's K and V, all its layers at once
    for got, want in zip(joined, cache, strict=True):
        assert got.offset == 3 * B - 2 and got.keys.shape == (1, 2, 3 * B, 16)
        assert mx.array_equal(got.keys, want.keys[..., :3 * B, :]).item()
        assert mx.array_equal(got.values, want.values[..., :3 * B, :]).item()


class KVModel(nn.Module):
    """Only what DecodeGraph asks of a model to start: its cache classes (two plain KV layers)."""

    def make_cache(self) -> list:
        return [KVCache(), KVCache()]


def test_on_a_cpu_a_hit_is_one_buffer_a_layer_at_the_graphs_capacity_which_it_takes_without_a_copy() -> None:
    """A hit copies its prefix once: into each layer's own buffer, with room for the rest of the prompt, which the
    compiled decode step writes into (a buffer shared by the layers, or too small, is copied again at its start)."""
    layers = 2
    layout = CacheLayout(("KVCache",) * layers, tuple(range(layers)), (), None)
    cache = [filled_kv(3 * B, seed=i) for i in range(layers)]
    tokens = list(range(3 * B))
    blocks = cut_blocks(cache, layout, tokens, chain_keys(tokens, B), [0, 1, 2], B)
    capacity = capacity_for(3 * B + 1)
    joined = join_blocks(blocks, 3 * B - 1, layout, B, capacity)
    for got, want in zip(joined, cache, strict=True):
        assert got.offset == 3 * B - 1 and got.keys.shape == (1, 2, capacity, 16)
        assert mx.array_equal(got.keys[..., :3 * B, :], want.keys[..., :3 * B, :]).item()
        assert not mx.any(got.values[..., 3 * B:, :]).item()
    buffers = [c.keys for c in joined]
    state = DecodeGraph(KVModel()).start(joined)
    assert all(a is b for a, b in zip(state.keys, buffers, strict=True))  # taken, not copied
    assert all(c.keys is None for c in joined)  # and let go of by the cache, so the first write lands in place


class HybridModel(nn.Module):
    """Only what PromptCaches asks of a model: its cache classes (a KV layer and a recurrent one)."""

    def make_cache(self) -> list:
        return [KVCache(), ArraysCache(2)]


def finished(tokens: int, seed: float) -> list:
    rec = ArraysCache(2)
    rec[0] = mx.full((1, 4), seed)
    rec[1] = mx.full((1, 2, 2), seed)
    return [filled_kv(tokens), rec]


def caches(tmp_path: Path | None, hot: int = 1 << 30) -> PromptCaches:
    return PromptCaches(HybridModel(), tmp_path or Path("/nonexistent"),
                        CacheOptions(hot_bytes=hot, ssd_root=tmp_path, block_tokens=B, close_s=10))


def test_a_hybrid_prefix_is_picked_up_only_at_its_deepest_snapshot(tmp_path: Path) -> None:
    pc = caches(None)
    assert pc.snapshot_points(5 * B + 1, 0) == [5 * B]  # the prompt's last boundary (every 4096: none here)
    assert pc.snapshot_points(5 * B, 2 * B) == [4 * B]  # one token must be left after the snapshot
    tokens = list(range(6 * B))
    snaps = {1: pc.snapshot(finished(2 * B, 1.0)), 3: pc.snapshot(finished(4 * B, 3.0))}
    pc.store(tokens, finished(6 * B, 9.0), snaps)
    assert len(pc.hot) == 4  # blocks past the last snapshot are useless to such a model: not kept

    n, cache = pc.lookup(tokens[:5 * B] + [999])
    assert n == 4 * B and cache is not None
    assert cache[0].offset == 4 * B and float(cache[1][0][0, 0]) == 3.0
    n, cache = pc.lookup(tokens[:3 * B + 5])  # the snapshot at 4B is past it: the one at 2B
    assert n == 2 * B and cache is not None and float(cache[1][0][0, 0]) == 1.0
    assert pc.lookup(tokens[:2 * B]) == (0, None)  # a snapshot at 2B would leave no token to compute
    assert pc.lookup([5] + tokens[1:5 * B]) == (0, None)
    # a sibling diverging in block 3 (no snapshot at its start): picked up at 2B, and its prefill stops at 3B
    sibling = tokens[:3 * B + 5] + [999] * 2 * B
    n, _ = pc.lookup(sibling)
    assert (n, pc.matched) == (2 * B, 3 * B)
    assert pc.snapshot_points(len(sibling), n, pc.matched) == [3 * B, 5 * B]


def test_a_hybrid_prefix_comes_back_from_disk_with_its_snapshot(tmp_path: Path) -> None:
    pc = caches(tmp_path)
    tokens = list(range(6 * B))
    pc.store(tokens, finished(6 * B, 0.0), {1: pc.snapshot(finished(2 * B, 1.0)), 4: pc.snapshot(finished(5 * B, 4.0))})
    pc.store(tokens, finished(6 * B, 0.0), {3: pc.snapshot(finished(4 * B, 3.0))})  # block 3 gains a snapshot
    pc.close()
    assert pc.ssd is not None and pc.ssd.present(chain_keys(tokens, B)) == [False, True, False, True, True]

    again = caches(tmp_path, hot=0)  # a new worker: nothing in memory
    n, cache = again.lookup(tokens[:4 * B] + [7])
    assert n == 4 * B and cache is not None and float(cache[1][0][0, 0]) == 3.0
    assert np.allclose(np.array(cache[0].keys[..., :4 * B, :]), np.array(filled_kv(6 * B).keys[..., :4 * B, :]))
    assert again.stats().ssd_hit_tokens == 4 * B
    again.close()
