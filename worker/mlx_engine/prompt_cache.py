"""The worker's prompt caches, hot (memory) in front of SSD (disk): what the engine asks and tells.

- `lookup(tokens)` before a request joins the batch: the longest cached block prefix of its
  prompt, from the hot cache and then, for what that lacked, from SSD (promoted into the hot
  cache). At least the last prompt token is always left to compute, because the generator
  needs one token to start from: a prompt cached whole is served with its cache trimmed by one.
- `store(tokens, cache)` when a sequence finishes: its full blocks (prompt and completion) go
  into the hot cache and, as numpy copies, to the SSD writer.
- `clear(which)`, `stats()`, `close()` for admin and the orderly exit.

Only models whose layers all use a plain KVCache are cached (sliding-window or recurrent caches
cannot be cut into blocks); others run uncached, with a warning. Invariants: every MLX call is
on the main thread; the SSD writer only ever sees numpy; a cache failure never fails a request
(the engine logs it and computes the prompt in full).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from protocol.cachedir import model_fingerprint
from protocol.messages import CacheStats
from worker.faults import NO_FAULTS, Faults
from worker.hot_cache import HotCache
from worker.mlx_engine.kv_blocks import Block, chain_keys, cut_blocks, is_plain_kv, join_blocks, parent_of
from worker.shutdown import run_best_effort
from worker.ssd_cache import SsdCache
from worker.ssd_format import BlockData

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CacheOptions:
    hot_bytes: int = 0  # 0: no hot cache
    ssd_root: Path | None = None  # None: no SSD cache; blocks go to <ssd_root>/<model fingerprint>
    ssd_bytes: int = 8 * 2**30
    block_tokens: int = 64
    close_s: float = 3.0  # how long close() waits for the SSD writer to finish its queue
    faults: Faults = NO_FAULTS  # testing only (worker/faults.py): the SSD writer's faults


def _dtype_name(a: mx.array) -> str:
    return str(a.dtype).rsplit(".", 1)[-1]


def _to_numpy(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def _from_numpy(a: np.ndarray, dtype: str) -> mx.array:
    arr = mx.array(a)
    return arr.view(mx.bfloat16) if dtype == "bfloat16" else arr


class PromptCaches:
    def __init__(self, model: nn.Module, model_path: Path, options: CacheOptions, model_id: str = "") -> None:
        self.model_id = model_id
        self.block = options.block_tokens
        self.close_s = options.close_s
        self.hits_ssd = self.misses_ssd = self.hit_tokens_ssd = 0
        probe = make_prompt_cache(model)
        self._layers = len(probe)
        supported = is_plain_kv(probe)
        if not supported and (options.hot_bytes or options.ssd_root):
            log.warning("[cache] model=%s caches=off reason='layers do not all use a plain KVCache'", model_id)
        self.hot = HotCache(options.hot_bytes if supported else 0)
        self.ssd: SsdCache | None = None
        if supported and options.ssd_root is not None:
            fingerprint = model_fingerprint(model_path)
            self.ssd = SsdCache(options.ssd_root / fingerprint, fingerprint, options.ssd_bytes, model_id,
                                faults=options.faults)

    @property
    def ssd_on(self) -> bool:
        return self.ssd is not None and self.ssd.enabled

    @property
    def enabled(self) -> bool:
        return self.hot.enabled or self.ssd_on

    # --- the engine's two calls ----------------------------------------------------------

    def lookup(self, tokens: list[int]) -> tuple[int, list[KVCache] | None]:
        """(n, cache): a prompt cache holding the first n tokens of `tokens`, n < len(tokens); (0, None)."""
        if not self.enabled or len(tokens) < self.block:
            return 0, None
        keys = chain_keys(tokens, self.block)
        blocks = self.hot.prefix(keys)
        n_hot = len(blocks)
        if self.hot.enabled:
            self.hot.hits += n_hot > 0
            self.hot.misses += n_hot == 0
        if n_hot < len(keys) and self.ssd is not None and self.ssd.enabled:
            found = self._from_ssd(self.ssd, tokens, keys, n_hot)
            self.hot.put(found)  # promoted: the next hit on this prefix comes from memory
            blocks += found
            self.hits_ssd += bool(found)
            self.misses_ssd += not found
        if not blocks:
            return 0, None
        n = min(len(blocks) * self.block, len(tokens) - 1)
        from_hot = min(n_hot * self.block, n)
        self.hot.hit_tokens += from_hot
        self.hit_tokens_ssd += n - from_hot
        return n, join_blocks(blocks, n)

    def _from_ssd(self, ssd: SsdCache, tokens: list[int], keys: list[bytes], start: int) -> list[Block]:
        """Blocks start.. of the chain from disk, as MLX arrays, up to the first missing one."""
        wanted = [tuple(tokens[i * self.block:(i + 1) * self.block]) for i in range(start, len(keys))]
        found = []
        for data in ssd.load_chain(keys[start:], wanted):
            if data.keys.shape[0] != self._layers:
                break  # the fingerprint rules this out; a mismatch must never reach the model
            found.append(Block(data.key, data.parent, data.depth, data.tokens, _from_numpy(data.keys, data.dtype),
                               _from_numpy(data.values, data.dtype)))
        return found

    def store(self, tokens: list[int], cache: list) -> None:
        """Keep the full blocks of a finished sequence; `cache` holds exactly `tokens`."""
        if not self.enabled or not is_plain_kv(cache) or cache[0].offset != len(tokens):
            return
        keys = chain_keys(tokens, self.block)
        if not keys:
            return
        c = cache[0]
        block_bytes = (c.keys.nbytes + c.values.nbytes) // c.keys.shape[2] * self.block * len(cache)
        hot_n = min(len(keys), self.hot.room_for(block_bytes))  # a chain longer than the budget: its head
        ssd = self.ssd if self.ssd is not None and self.ssd.enabled else None
        to_disk = [i for i in range(len(keys)) if not ssd.has(keys[i])] if ssd is not None else []
        wanted = sorted(set(range(hot_n)) | set(to_disk))
        have = {i: b for i in wanted if (b := self.hot.get(keys[i])) is not None}
        cut = cut_blocks(cache, tokens, keys, [i for i in wanted if i not in have], self.block)
        made = {b.depth: b for b in cut}
        self.hot.put([have.get(i) or made[i] for i in range(hot_n)])
        if ssd is not None and to_disk:
            ssd.enqueue([self._numpy_block(have.get(i) or made[i], keys, i) for i in to_disk])

    def _numpy_block(self, block: Block, keys: list[bytes], i: int) -> BlockData:
        return BlockData(block.key, parent_of(keys, i, self.block), i, block.tokens, _dtype_name(block.keys),
                         _to_numpy(block.keys), _to_numpy(block.values))

    # --- admin and teardown ----------------------------------------------------------------

    def clear(self, which: str) -> tuple[int, int]:
        """Empty one tier ('hot' or 'ssd'); return (entries, bytes) actually given back."""
        if which == "hot":
            released = self.hot.clear()
            mx.clear_cache()  # hand the freed buffers back to the OS, not to MLX's buffer cache
        elif self.ssd is not None:
            released = self.ssd.clear()
        else:
            released = (0, 0)
        log.info("[cache] model=%s cleared=%s entries=%d bytes=%d", self.model_id, which, *released)
        return released

    def stats(self) -> CacheStats:
        hot = self.hot
        stats = CacheStats(
            block_tokens=self.block, hot_entries=len(hot), hot_bytes=hot.nbytes, hot_budget_bytes=hot.budget,
            hot_hits=hot.hits, hot_misses=hot.misses, hot_hit_tokens=hot.hit_tokens, ssd_enabled=self.ssd_on,
            ssd_entries=0, ssd_bytes=0, ssd_cap_bytes=0, ssd_hits=self.hits_ssd, ssd_misses=self.misses_ssd,
            ssd_hit_tokens=self.hit_tokens_ssd)
        if self.ssd is not None:  # not `if self.ssd`: an SsdCache with no entries is falsy (len 0)
            stats.ssd_entries, stats.ssd_bytes, stats.ssd_cap_bytes = len(self.ssd), self.ssd.nbytes, self.ssd.cap
            stats.ssd_dir, stats.ssd_error = str(self.ssd.dir), self.ssd.error
        return stats

    def close(self) -> list[str]:
        """Flush the SSD writer (within `close_s`), then release the hot cache; best-effort."""
        steps: list[tuple[str, Callable[[], object]]] = []
        if self.ssd is not None:
            ssd = self.ssd
            steps.append(("flush_ssd", lambda: ssd.close(self.close_s)))
        steps.append(("release_hot", self.hot.clear))
        return run_best_effort(f"caches model={self.model_id}", steps)
