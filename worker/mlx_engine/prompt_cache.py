"""The worker's prompt caches, hot (memory) in front of SSD (disk): what the engine asks and tells.

- `lookup(tokens)` before a request joins the batch: the longest cached prefix of its prompt
  that can be picked up, from the hot cache and then, for what that lacked, from SSD (promoted
  into the hot cache). At least the last prompt token is always left to compute, because the
  generator needs one token to start from.
- `snapshot_points(n, cached, diverges, head)`: where a prompt's prefill must stop so that `snapshot(cache)` can
  copy the state of the layers that cannot be cut into blocks (see below).
- `store(tokens, cache, snapshots)` when a sequence finishes: its blocks go into the hot cache
  and are lent to the SSD writer; `hand_off()` at the next step gives them to it as numpy views,
  so that nothing in a step waits for them (worker/mlx_engine/disk_handoff.py).
- `keep(tokens, ttl_s)`: pin a prompt's prefix (a `cache_control` breakpoint, a `prompt_cache_key`) in the hot
  and SSD tiers for its ttl (hot_cache.py, ssd_cache.py); `kept_end(n)`: how much of an n-token prompt a finished request leaves to the caches,
  which usage reports as written (Anthropic's cache_creation_input_tokens).
- `clear(which)`, `stats()`, `close()` for admin and the orderly exit.

Every cache type is cached (worker/mlx_engine/layer_state.py). A model whose layers are all
plain `KVCache` is cut into blocks, and any block-aligned prefix is reused; a prompt cached
whole is served with its cache trimmed by one token. A model with other layers (sliding-window
`RotatingKVCache`, recurrent `ArraysCache`, `CacheList`...) keeps its plain KV layers in blocks
as well, and the other layers' whole state as snapshots taken at block boundaries: in prefill
(the prompt's last one, every `snapshot_every` tokens, where it leaves a cached prompt, and where sibling sessions
branch: the end of its head of system prompt and tools, the parts of its first user turn) and the
last one its reply's decoding crosses (the engine's): its reusable prefix is
the longest cached one that ends at a snapshot, and only blocks up to a snapshot are kept.

`kv_bits` quantizes the running cache itself (quantized_kv.py), and the blocks are its
quantized rows as they are, restored as they are: one format from the running cache to both tiers. A
model whose running cache stays full precision (quantized_kv.quantize_cache says why) stores its
blocks quantized (affine, groups along each head's tokens x dim) and restores them dequantized.

Invariants: every MLX call is on the main thread; the SSD writer only ever sees numpy; a cache
failure never fails a request (the engine logs it and computes the prompt in full).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from protocol.cachedir import legacy_cache_dir, model_cache_dir, retire
from protocol.messages import CacheStats
from worker.faults import NO_FAULTS, Faults
from worker.hot_cache import HotCache
from worker.mlx_engine.decode_graph import capacity_for
from worker.mlx_engine.disk_handoff import KV_PREFIX, DiskHandoff
from worker.mlx_engine.kv_blocks import (
    Block,
    chain_keys,
    cut_blocks,
    cut_tail,
    join_blocks,
    parent_of,
    root_key,
    running_quantized,
)
from worker.mlx_engine.layer_state import CacheLayout, Snapshot, from_numpy, take_snapshot
from worker.mlx_engine.quantized_kv import QuantizedKV
from worker.shutdown import run_best_effort
from worker.ssd_cache import SsdCache
from worker.ssd_format import SNAPSHOT_PREFIX, BlockData

log = logging.getLogger(__name__)

MIN_PARTIAL_TOKENS = 8  # the least of a block worth picking up from a cached block that starts the same way


@dataclass(frozen=True, slots=True)
class CacheOptions:
    hot_bytes: int = 0  # 0: no hot cache
    ssd_root: Path | None = None  # None: no SSD cache; blocks go to <ssd_root>/<model fingerprint>
    ssd_bytes: int = 8 * 2**30
    block_tokens: int = 64
    close_s: float = 3.0  # how long close() waits for the SSD writer to finish its queue
    faults: Faults = NO_FAULTS  # testing only (worker/faults.py): the SSD writer's faults
    kv_bits: int | None = None  # K/V quantized to 4 or 8 bits: the running cache (quantized_kv.py) and the blocks
    snapshot_every: int = 4096  # tokens; models with snapshot layers also snapshot this often (0: prompt end only)
    kv_group_size: int = 64  # the running cache's quantization groups along a head's dimension


class PromptCaches:
    def __init__(self, model: nn.Module, model_path: Path, options: CacheOptions, model_id: str = "") -> None:
        self.model_id = model_id
        self.block = options.block_tokens
        self.close_s = options.close_s
        self.every_blocks = options.snapshot_every // self.block if options.snapshot_every >= self.block else 0
        self.hits_ssd = self.misses_ssd = self.hit_tokens_ssd = 0
        self.matched = 0  # tokens of the last looked-up prompt in the hot tier's blocks, with a snapshot or not
        self.read_bytes, self.read_s = 0, 0.0  # what the last lookup read from the SSD tier, and how long (made MLX too)
        self.clears = 0  # tiers cleared so far: a store deferred from before a clear is dropped (engine.py)
        self.layout = CacheLayout.of(make_prompt_cache(model), options.kv_bits)
        self.hot = HotCache(options.hot_bytes)
        self.ssd: SsdCache | None = None
        if options.ssd_root is not None:
            directory = model_cache_dir(options.ssd_root, model_path)  # every weight byte (digests kept by file)
            fingerprint = directory.name
            blocks, reclaimed = retire(legacy_cache_dir(options.ssd_root, model_path), directory)
            if blocks or reclaimed:
                log.info("[cache] model=%s retired the directory of the old fingerprint: blocks=%d bytes=%d",
                         model_id, blocks, reclaimed)
            self.ssd = SsdCache(directory, fingerprint, options.ssd_bytes, model_id,
                                faults=options.faults, layout=self.layout.name)
        self.to_disk = DiskHandoff(self.ssd, self.block) if self.ssd is not None else None
        if self.enabled:
            log.info("[cache] model=%s layout=%s block_layers=%d snapshot_layers=%d kv_bits=%s", model_id,
                     self.layout.name, len(self.layout.block_layers), len(self.layout.snapshot_layers),
                     options.kv_bits)

    @property
    def ssd_on(self) -> bool:
        return self.ssd is not None and self.ssd.enabled

    @property
    def enabled(self) -> bool:
        return self.hot.enabled or self.ssd_on

    # --- the engine's calls ---------------------------------------------------------------

    def lookup(self, tokens: list[int]) -> tuple[int, list | None]:
        """(n, cache): a prompt cache holding the first n tokens of `tokens`, n < len(tokens); (0, None)."""
        partial = not self.layout.snapshots and self.hot.enabled  # a snapshot cannot be cut inside a block
        self.matched = self.read_bytes = 0
        self.read_s = 0.0
        if not self.enabled or len(tokens) < (MIN_PARTIAL_TOKENS + 1 if partial else self.block):
            return 0, None
        t0 = time.perf_counter()
        keys = chain_keys(tokens, self.block)
        if self.layout.snapshots:
            keys = keys[:(len(tokens) - 1) // self.block]  # a snapshot cannot be trimmed: one token must be left
        blocks = self.hot.prefix(keys)
        self.matched = len(blocks) * self.block
        if self.layout.snapshots:
            blocks, n_hot = self._to_a_snapshot(tokens, keys, blocks)
        else:
            n_hot = len(blocks)
            if n_hot < len(keys) and self.ssd is not None and self.ssd.enabled:
                found = self._from_ssd(self.ssd, tokens, keys, n_hot, len(keys))
                self.hot.put(found)  # promoted: the next hit on this prefix comes from memory
                blocks += found
        n = min(len(blocks) * self.block, len(tokens) - 1)
        from_ssd = n - min(n_hot * self.block, n)
        if partial and n < len(tokens) - 1:  # the next block, cut short: a cached one that starts the same way
            j = len(blocks)
            child, m, on_disk = self._partial(parent_of(keys, j, self.block),
                                              tokens[j * self.block:min((j + 1) * self.block, len(tokens) - 1)])
            if child is not None and m >= MIN_PARTIAL_TOKENS:
                blocks.append(child)
                n = j * self.block + m
                from_ssd += m if on_disk else 0
        if self.hot.enabled:
            self.hot.hits += n - from_ssd > 0
            self.hot.misses += n - from_ssd == 0
        if self.ssd_on:
            self.hits_ssd += from_ssd > 0
            self.misses_ssd += from_ssd == 0
        if not blocks:
            return 0, None
        from_hot = n - from_ssd
        self.hot.hit_tokens += from_hot
        self.hit_tokens_ssd += n - from_hot
        t1 = time.perf_counter()
        # room for the rest of the prompt at the compiled decode step's capacity: its first token copies nothing
        cache = join_blocks(blocks, n, self.layout, self.block, capacity_for(len(tokens)))
        hot_bytes = sum(b.nbytes for b in blocks) - self.read_bytes
        log.info("[cache] model=%s hit tokens=%d hot_tokens=%d ssd_tokens=%d bytes=%d ssd_bytes=%d find_s=%.4f "
                 "read_s=%.4f join_s=%.4f", self.model_id, n, from_hot, n - from_hot, hot_bytes, self.read_bytes,
                 t1 - t0, self.read_s, time.perf_counter() - t1)
        return n, cache

    def _partial(self, parent: bytes, tokens: list[int]) -> tuple[Block | None, int, bool]:
        """The cached block under `parent` (a tail, or a full block of another prompt) that starts with the longest
        run of `tokens`: (it, that run's length, whether it came from disk). The disk is read only for a tail that
        shares more than the hot cache's best, and it is promoted into the hot cache."""
        child, m = self.hot.best_child(parent, tokens)
        if self.ssd is None or not self.ssd.enabled or m == len(tokens):
            return child, m, False
        key, held, n = self.ssd.best_tail(parent, tokens)
        if key is None or n <= m or n < MIN_PARTIAL_TOKENS:
            return child, m, False
        t0 = time.perf_counter()
        data = self.ssd.load_tail(key, held)
        self.read_s += time.perf_counter() - t0
        if data is None:
            return child, m, False
        self.read_bytes += data.nbytes
        tail = self._block_of(data)
        self.hot.put([tail])
        return tail, n, True

    def _to_a_snapshot(self, tokens: list[int], keys: list[bytes], hot: list[Block]) -> tuple[list[Block], int]:
        """The blocks up to the deepest one that has a snapshot, from memory or disk; and how many came from memory."""
        best_hot = max((i for i, b in enumerate(hot) if b.snapshot is not None), default=-1)
        if self.ssd is not None and self.ssd.enabled:
            on_disk = self.ssd.present(keys)
            best_ssd = max((i for i, snap in enumerate(on_disk) if snap), default=-1)
            if best_ssd > best_hot:
                start = min(len(hot), best_ssd)
                found = self._from_ssd(self.ssd, tokens, keys, start, best_ssd + 1, snapshot_at=best_ssd)
                if found and found[-1].depth == best_ssd and found[-1].snapshot is not None:
                    self.hot.put(found)
                    return hot[:start] + found, start
        return hot[:best_hot + 1], best_hot + 1

    def _from_ssd(self, ssd: SsdCache, tokens: list[int], keys: list[bytes], start: int, end: int,
                  snapshot_at: int | None = None) -> list[Block]:
        """Blocks start..end-1 of the chain from disk, as MLX arrays, up to the first missing one; only the
        block at `snapshot_at` with its snapshot."""
        wanted = [tuple(tokens[i * self.block:(i + 1) * self.block]) for i in range(start, end)]
        at = None if snapshot_at is None else snapshot_at - start
        found, t0 = [], time.perf_counter()
        for data in ssd.read_chain(keys[start:end], wanted, snapshot_at=at):  # each made MLX as the next are read
            self.read_bytes += data.nbytes
            found.append(self._block_of(data))
        self.read_s += time.perf_counter() - t0
        return found

    @staticmethod
    def _block_of(data: BlockData) -> Block:
        """A block read from disk, as MLX arrays."""
        kv = {n[len(KV_PREFIX):]: from_numpy(a, data.dtypes[n]) for n, a in data.arrays.items()
              if n.startswith(KV_PREFIX)}
        snapshot = None
        if data.snapshot is not None:
            snapshot = Snapshot({n[len(SNAPSHOT_PREFIX):]: from_numpy(a, data.dtypes[n])
                                 for n, a in data.arrays.items() if n.startswith(SNAPSHOT_PREFIX)}, data.snapshot)
        return Block(data.key, data.parent, data.depth, data.tokens, kv, snapshot)

    def keep(self, tokens: list[int], ttl_s: float) -> None:
        """Pin the whole blocks of `tokens` (a marked prefix) in the hot and SSD tiers for `ttl_s` seconds."""
        if not self.enabled or ttl_s <= 0:
            return
        keys = chain_keys(tokens, self.block)
        if self.hot.enabled:
            self.hot.pin(keys, ttl_s)
        if self.ssd is not None and self.ssd.enabled:
            self.ssd.pin(keys, ttl_s)

    def kept_end(self, n_tokens: int) -> int:
        """How many of an n-token prompt's tokens `store` keeps when its request finishes (within the budgets):
        for a model with snapshot layers, through its last snapshot point; else all of them (its whole blocks,
        and its end in a block the completion fills or in the partial tail)."""
        if not self.enabled:
            return 0
        return (n_tokens - 1) // self.block * self.block if self.layout.snapshots else n_tokens

    def snapshot_points(self, n_tokens: int, cached: int, diverges: int = 0, heads: list[int] | None = None) -> list[int]:
        """The block boundaries in (cached, n_tokens - 1] where a prompt's prefill stops for a snapshot: its last
        one, every `snapshot_every`, and where the next prompt to share a prefix with it, a sibling session's, will
        pick it up: `diverges` (`matched`: where it leaves a cached prompt) and the last boundary before each of
        `heads` (`Prompts.branch_ends`: an agent's subagents and sessions share its system prompt, tools and the
        start of its first user turn, and branch there)."""
        if not self.layout.snapshots or not self.enabled:
            return []
        last = (n_tokens - 1) // self.block
        every = self.every_blocks
        branches = {diverges // self.block, *(h // self.block for h in heads or [])} - {0}
        return [i * self.block for i in range(cached // self.block + 1, last + 1)
                if i == last or (every and i % every == 0) or i in branches]

    def snapshot(self, cache: list) -> Snapshot:
        """A copy of the snapshot layers' state in one sequence's whole cache (batch 1)."""
        return take_snapshot([cache[i] for i in self.layout.snapshot_layers])

    def store(self, tokens: list[int], cache: list, snapshots: dict[int, Snapshot] | None = None,
              tail: bool = True) -> None:
        """Keep the blocks of a sequence (finished, or mid-prefill: a checkpoint, which keeps no partial `tail`);
        `cache` holds exactly `tokens`; `snapshots` by block index."""
        layout, snapshots = self.layout, snapshots or {}
        if not self.enabled:
            return
        first = cache[layout.block_layers[0]] if layout.block_layers else None
        if first is not None and first.offset != len(tokens):
            return
        keys = chain_keys(tokens, self.block)
        if layout.snapshots:  # past its last snapshot a chain cannot be picked up: keep it only that far
            keys = keys[:max(snapshots) + 1] if snapshots else []
        if not keys:
            if tail:
                self._store_tail(tokens, cache, keys)
            return
        block_bytes = 0
        if isinstance(first, QuantizedKV):  # its blocks are its rows as they are
            block_bytes = first.nbytes // first.keys[0].shape[2] * self.block * len(layout.block_layers)
        elif first is not None:
            block_bytes = (first.keys.nbytes + first.values.nbytes) // first.keys.shape[2] * self.block
            block_bytes = block_bytes * len(layout.block_layers) // (32 // layout.kv_bits if layout.kv_bits else 1)
        hot_n = min(len(keys), self.hot.room_for(block_bytes)) if block_bytes else len(keys) * self.hot.enabled
        ssd = self.ssd if self.ssd is not None and self.ssd.enabled else None
        to_disk = [i for i in range(len(keys)) if not ssd.has(keys[i], i in snapshots)] if ssd is not None else []
        wanted = sorted(set(range(hot_n)) | set(to_disk))
        have = {i: b for i in wanted if (b := self.hot.get(keys[i])) is not None}
        made = {b.depth: b for b in cut_blocks(cache, layout, tokens, keys, [i for i in wanted if i not in have],
                                                self.block, wait=False)}  # evaluated while the batch goes on
        chain = {}
        for i in wanted:
            block = have.get(i) or made[i]
            snapshot = snapshots.get(i)
            chain[i] = block.with_snapshot(snapshot) if snapshot is not None and block.snapshot is None else block
        self.hot.put([chain[i] for i in range(hot_n)])
        if self.to_disk is not None and to_disk:
            self.to_disk.lend([chain[i] for i in to_disk])
        if tail:
            self._store_tail(tokens, cache, keys)

    def _store_tail(self, tokens: list[int], cache: list, keys: list[bytes]) -> None:
        """Keep a finished sequence's partial last block in the hot cache and on disk, under its chain: prompts
        shorter than a block (a chat template's head and a short question) share their start through it, and the
        same prompt again is cached whole, from either tier."""
        layout = self.layout
        # a partial block is kept unquantized, or as the running cache's quantized rows
        quantized = running_quantized(layout)
        if layout.snapshots or (layout.kv_bits and not quantized) or not layout.block_layers or not self.hot.enabled:
            return
        if len(tokens) - len(keys) * self.block < MIN_PARTIAL_TOKENS:
            return
        parent = keys[-1] if keys else root_key(self.block)
        to_disk = self.to_disk is not None and self.ssd_on  # its chain is on disk or lent with it (store's)
        if not keys or parent in self.hot or to_disk:
            block = cut_tail(cache, layout, tokens, parent, self.block)
            if not keys or parent in self.hot:
                self.hot.put([block])
            if to_disk and not cast(SsdCache, self.ssd).has(block.key):
                cast(DiskHandoff, self.to_disk).lend([block])

    def hand_off(self) -> None:
        """Once a step: the blocks stored at earlier steps go to the SSD writer (see disk_handoff.py)."""
        if self.to_disk is not None:
            self.to_disk.hand_off()

    # --- admin and teardown ----------------------------------------------------------------

    def clear(self, which: str) -> tuple[int, int]:
        """Empty one tier ('hot' or 'ssd'); return (entries, bytes) actually given back."""
        self.clears += 1
        if which == "hot":
            released = self.hot.clear()
            mx.clear_cache()  # hand the freed buffers back to the OS, not to MLX's buffer cache
        elif self.ssd is not None:
            if self.to_disk is not None:
                self.to_disk.drop()
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
            (stats.ssd_entries, stats.ssd_bytes), stats.ssd_cap_bytes = self.ssd.usage(), self.ssd.cap
            stats.ssd_dir, stats.ssd_error = str(self.ssd.dir), self.ssd.error
        return stats

    def close(self) -> list[str]:
        """Flush the SSD writer (within `close_s`), then release the hot cache; best-effort."""
        steps: list[tuple[str, Callable[[], object]]] = []
        if self.to_disk is not None:
            to_disk = self.to_disk
            steps.append(("flush_ssd", lambda: to_disk.close(self.close_s)))
        steps.append(("release_hot", self.hot.clear))
        return run_best_effort(f"caches model={self.model_id}", steps)
