"""Storing a finished sequence's blocks does no copy and no wait on the generation thread (issue 15).

Real MLX arrays (CPU), a real SSD cache directory and its real writer thread; no model: a
two-layer KV "model" gives PromptCaches its cache classes. `store` only schedules the blocks;
the next step's `hand_off` gives the writer zero-copy views of them, and the writer's files
hold exactly the sequence's K/V (bfloat16 included). A clear between the two writes nothing;
close hands off and flushes what was lent.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from worker.faults import Faults
from worker.mlx_engine.kv_blocks import chain_keys
from worker.mlx_engine.prompt_cache import MIN_PARTIAL_TOKENS, CacheOptions, PromptCaches
from worker.ssd_format import BlockData

B = 8  # block tokens


class TwoLayerModel(nn.Module):
    """Only what PromptCaches asks of a model: its cache classes (two plain KV layers)."""

    def make_cache(self) -> list:
        return [KVCache(), KVCache()]


def finished_cache(tokens: int, seed: int) -> list:
    layers = []
    for layer in range(2):
        c = KVCache()
        k = mx.random.normal((1, 2, tokens, 16), key=mx.random.key(seed * 10 + layer)).astype(mx.bfloat16)
        c.update_and_fetch(k, -k)
        layers.append(c)
    return layers


def caches(root: Path, hot: int = 1 << 30, faults: tuple[str, ...] = (), block: int = B) -> PromptCaches:
    return PromptCaches(TwoLayerModel(), root, CacheOptions(hot_bytes=hot, ssd_root=root, block_tokens=block,
                                                            close_s=30, faults=Faults(faults)))


def spy_on_enqueue(pc: PromptCaches) -> list[list[BlockData]]:
    """What the SSD writer is handed, recorded; the real enqueue still runs."""
    assert pc.ssd is not None
    handed: list[list[BlockData]] = []
    real = pc.ssd.enqueue

    def enqueue(blocks: list[BlockData]) -> int:
        handed.append(blocks)
        return real(blocks)

    pc.ssd.enqueue = enqueue  # type: ignore[method-assign]
    return handed


def test_store_hands_the_writer_views_at_the_next_step_not_copies_at_once(tmp_path: Path) -> None:
    pc = caches(tmp_path)
    handed = spy_on_enqueue(pc)
    tokens = list(range(3 * B + 3))
    cache = finished_cache(len(tokens), seed=1)
    pc.store(tokens, cache)
    assert handed == []  # nothing copied or queued in the step where the sequence finished
    assert len(pc.hot) == 3  # the hot cache has them at once

    pc.hand_off()  # the next step
    assert [[b.depth for b in chain] for chain in handed] == [[0, 1, 2]]
    for block in handed[0]:
        for name, a in block.arrays.items():
            assert not a.flags.owndata, f"{name} of block {block.depth} was copied on the generation thread"
    pc.close()
    assert pc.to_disk is not None and pc.to_disk.held == 0  # released on this thread once written

    again = caches(tmp_path, hot=0)  # a new worker: only the disk has them
    n, joined = again.lookup(tokens)
    assert n == 3 * B and joined is not None
    for layer in range(2):
        assert joined[layer].keys.dtype == mx.bfloat16
        assert mx.array_equal(joined[layer].keys[..., :n, :], cache[layer].keys[..., :n, :]).item()
        assert mx.array_equal(joined[layer].values[..., :n, :], cache[layer].values[..., :n, :]).item()
    again.close()


def test_clear_before_the_hand_off_writes_nothing(tmp_path: Path) -> None:
    pc = caches(tmp_path)
    tokens = list(range(2 * B + 1))
    pc.store(tokens, finished_cache(len(tokens), seed=2))
    pc.clear("ssd")
    pc.hand_off()
    pc.close()
    assert pc.ssd is not None and len(pc.ssd) == 0 and not list(tmp_path.rglob("*.kvb"))


def test_close_flushes_what_was_lent_and_keeps_the_writers_order(tmp_path: Path) -> None:
    pc = caches(tmp_path, faults=("ssd-slow",))  # the writer is still busy when the next chains come
    first, second = list(range(2 * B + 1)), list(range(100, 100 + 2 * B + 1))
    pc.store(first, finished_cache(len(first), seed=3))
    pc.hand_off()
    assert pc.to_disk is not None and pc.to_disk.held == 1  # the writer reads them: kept alive here
    pc.store(second, finished_cache(len(second), seed=4))
    pc.close()  # never handed off by a step: close does it, then flushes
    assert pc.ssd is not None and pc.ssd.present(chain_keys(first, B)) == [False, False]
    assert pc.ssd.present(chain_keys(second, B)) == [False, False]
    assert pc.to_disk.held == 0
    written = {p.stem: p.stat().st_mtime_ns for p in tmp_path.rglob("*.kvb")}
    assert max(written[k.hex()] for k in chain_keys(first, B)) < min(written[k.hex()] for k in chain_keys(second, B))


def test_a_whole_prompt_comes_back_from_disk_its_partial_last_block_too(tmp_path: Path) -> None:
    """The same prompt again after a restart is cached whole, less its last token: the tail is on disk too."""
    block = 2 * B  # a tail of at least MIN_PARTIAL_TOKENS fits in it
    pc = caches(tmp_path, block=block)
    handed = spy_on_enqueue(pc)
    tokens = list(range(2 * block + 12))  # 2 full blocks and a tail of 12 tokens
    cache = finished_cache(len(tokens), seed=4)
    pc.store(tokens, cache)
    pc.hand_off()
    assert [[(b.depth, b.tail) for b in chain] for chain in handed] == [[(0, False), (1, False)], [(2, True)]]
    pc.close()

    again = caches(tmp_path, block=block)  # a new worker: its hot cache empty, the disk's index rebuilt
    prompt = tokens[:2 * block + MIN_PARTIAL_TOKENS + 1]
    n, joined = again.lookup(prompt)
    assert n == len(prompt) - 1 and joined is not None
    assert again.stats().ssd_hit_tokens == n and again.stats().hot_hit_tokens == 0
    for layer in range(2):
        assert mx.array_equal(joined[layer].keys[..., :n, :], cache[layer].keys[..., :n, :]).item()
        assert mx.array_equal(joined[layer].values[..., :n, :], cache[layer].values[..., :n, :]).item()
    assert again.lookup(prompt)[0] == n and again.stats().hot_hit_tokens == n  # promoted: the next hit is memory's
    again.close()
