"""A kept prefix (PromptCaches.keep: a `cache_control` breakpoint, a `prompt_cache_key`) is pinned in the SSD tier as
well as the hot one: it outlives a burst of other prompts that overflows a small SSD budget, and a worker that starts
after it (no hot tier, no pins) still picks it up from disk. Real MLX arrays (CPU) and the real SSD writer."""

from __future__ import annotations

from pathlib import Path

import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from tests.conftest import wait_for
from tests.unit.test_layer_state import filled_kv
from worker.mlx_engine.prompt_cache import CacheOptions, PromptCaches

B = 8  # block tokens
BLOCK_FILE = 2 * 2 * B * 16 * 4 + 512  # K and V of 2 heads of 16, float32, and the header (an upper bound)


class KvModel(nn.Module):
    """Only what PromptCaches asks of a model: its cache classes."""

    def make_cache(self) -> list:
        return [KVCache()]


def caches(root: Path) -> PromptCaches:
    options = CacheOptions(hot_bytes=0, ssd_root=root / "ssd", ssd_bytes=6 * BLOCK_FILE, block_tokens=B, close_s=10)
    return PromptCaches(KvModel(), root / "model", options)


def test_a_kept_prefix_outlives_an_ssd_burst_and_a_restart(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    pc = caches(tmp_path)
    marked = list(range(4 * B))
    pc.keep(marked, 300.0)  # at submit: before its blocks are on disk
    pc.store(marked, [filled_kv(4 * B)])
    pc.hand_off()
    assert pc.ssd is not None
    wait_for(lambda: len(pc.ssd) == 4, 10, what="the marked prefix on disk")
    for seed in range(1, 5):  # 16 blocks of other prompts through a budget of 6
        other = [1000 * seed + i for i in range(4 * B)]
        pc.store(other, [filled_kv(4 * B, seed)])
        pc.hand_off()
    pc.close()

    again = caches(tmp_path)  # a new worker: nothing in memory, no pins
    n, cache = again.lookup(marked + [7])
    assert n == 4 * B and cache is not None  # unpinned on disk, the oldest chain went first
    assert again.stats().ssd_hit_tokens == 4 * B
    again.close()
