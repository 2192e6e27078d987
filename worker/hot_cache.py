"""The hot cache: KV blocks in worker memory, least recently used first out, under a byte budget.

Blocks are looked up by chained key (worker/kv_blocks.py), so the longest cached prefix of a
prompt is a walk along its keys. Recency is kept so that a prefix outlives its extensions: a
chain is always touched from its deepest block back to its root, which leaves the root the
most recent, and eviction (oldest first) therefore takes the tails of old chains before their
heads; a block whose parent went anyway is unreachable and simply ages out.

The blocks are also known by their parent (`_children`), so that a prompt which shares only part
of its next block with a cached one can pick up that part (`best_child`): requests that share
a chat template's system prefix, shorter than a block, share its K/V.

A prefix can be pinned for a while (`pin`: a `cache_control` breakpoint or a `prompt_cache_key`, and its ttl): eviction
passes over its blocks, which go back to the recent end, as long as unpinned blocks are left to take; pins
are by key, so a block pinned before it is held is kept once it is put. Past its deadline a pin is gone.

Invariants: `nbytes` is the sum of the held blocks' `nbytes` and never exceeds `budget` once
a call returns; a budget of 0 turns the cache off. Main thread only (blocks are MLX arrays).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only the type: this module holds blocks but does no MLX work itself
    from worker.mlx_engine.kv_blocks import Block


class HotCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget = max(0, budget_bytes)
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()
        self._children: dict[bytes, set[bytes]] = {}  # parent key -> keys of the held blocks under it
        self._pins: dict[bytes, float] = {}  # key -> time.monotonic() deadline of its pin
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def get(self, key: bytes) -> Block | None:
        return self._blocks.get(key)

    def prefix(self, keys: list[bytes]) -> list[Block]:
        """The cached blocks of the longest prefix of `keys`, touched as used."""
        found = []
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                break
            found.append(block)
        self.touch([b.key for b in found])
        return found

    def best_child(self, parent: bytes, tokens: tuple[int, ...] | list[int]) -> tuple[Block | None, int]:
        """The held block under `parent` whose tokens start with the longest run of `tokens`, and that
        run's length (touched as used when > 0)."""
        best, best_n = None, 0
        for key in self._children.get(parent, ()):
            block = self._blocks[key]
            n = 0
            for a, b in zip(block.tokens, tokens):
                if a != b:
                    break
                n += 1
            if n > best_n:
                best, best_n = block, n
        if best is not None:
            self.touch([best.key])
        return best, best_n

    def touch(self, keys: list[bytes]) -> None:
        for key in reversed(keys):  # deepest first, so the root ends up the most recent
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def pin(self, keys: list[bytes], ttl_s: float) -> None:
        """Keep these blocks ahead of unpinned ones for `ttl_s` seconds from now (a later pin only extends)."""
        now = time.monotonic()
        self._pins = {k: t for k, t in self._pins.items() if t > now}  # the expired go: the dict stays small
        for key in keys:
            self._pins[key] = max(self._pins.get(key, 0.0), now + ttl_s)

    def pinned(self, key: bytes) -> bool:
        return self._pins.get(key, 0.0) > time.monotonic()

    def room_for(self, block_bytes: int) -> int:
        """How many blocks of `block_bytes` the whole budget holds."""
        return self.budget // block_bytes if block_bytes > 0 else 0

    def put(self, blocks: list[Block]) -> None:
        """Add a chain's blocks (root side first), then evict the least recent down to the budget.

        A block held without a snapshot is replaced by the same block with one."""
        if not self.enabled:
            return
        for block in blocks:
            old = self._blocks.get(block.key)
            if old is not None and (old.snapshot is not None or block.snapshot is None):
                continue  # held already; a block is replaced only to gain the snapshot it lacked
            if block.nbytes <= self.budget:
                self.nbytes += block.nbytes - (old.nbytes if old is not None else 0)
                self._blocks[block.key] = block
                self._children.setdefault(block.parent, set()).add(block.key)
        self.touch([b.key for b in blocks])
        passed = 0  # pinned blocks sent back to the recent end; once all were, the oldest goes anyway
        while self.nbytes > self.budget and self._blocks:
            key = next(iter(self._blocks))
            if passed < len(self._blocks) and self.pinned(key):
                self._blocks.move_to_end(key)
                passed += 1
                continue
            old = self._blocks.pop(key)
            self.nbytes -= old.nbytes
            siblings = self._children.get(old.parent)
            if siblings is not None:
                siblings.discard(old.key)
                if not siblings:
                    del self._children[old.parent]

    def clear(self) -> tuple[int, int]:
        """Drop every block; return (blocks, bytes) released."""
        released = (len(self._blocks), self.nbytes)
        self._blocks.clear()
        self._children.clear()
        self._pins.clear()
        self.nbytes = 0
        return released
