"""Blocks on their way from the generation thread to the SSD writer, without stalling a step.

Storing a finished sequence used to copy its new blocks to numpy on the generation thread: an
`mx.eval` that waited for the decode step in flight, then a copy of every block (7.8% of the
loop on the GPU, and a stall of the whole batch when many requests finished together). Now:

1. `lend` (in the step where the sequence finishes): the blocks' arrays (bfloat16 as its 16-bit
   view) are scheduled with `mx.async_eval` and nothing waits for them;
2. `hand_off` (at the next step, after the generator's own wait): they are evaluated by then, so
   `mx.eval` returns at once; the writer gets zero-copy numpy views of them (`np.asarray` reads
   an evaluated MLX array's buffer in place) and does the only copy, to the file, on its thread;
3. the MLX arrays stay referenced here until the writer no longer holds a view of them
   (`SsdCache.writing`), so they are released on this thread, never on the writer's.

Invariants: every MLX call is on the main thread; the writer sees only numpy views of evaluated
arrays; blocks reach `SsdCache.enqueue` in the order their sequences finished (the writer's order
is kept); `close` hands off everything lent before the writer is flushed, `drop` forgets what was
not handed off yet (the SSD tier was cleared).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from worker.mlx_engine.kv_blocks import Block
from worker.mlx_engine.layer_state import dtype_name
from worker.ssd_cache import SsdCache
from worker.ssd_format import SNAPSHOT_PREFIX, BlockData

KV_PREFIX = "kv:"


@dataclass(slots=True)
class _Lent:
    """One chain's blocks for the disk: as MLX arrays (being evaluated) until handed off."""

    blocks: list[Block]
    arrays: list[dict[str, mx.array]]  # per block, by file name: what the writer gets views of
    dtypes: list[dict[str, str]]


class DiskHandoff:
    def __init__(self, ssd: SsdCache, block_tokens: int) -> None:
        self.ssd = ssd
        self.block = block_tokens
        self._lent: deque[_Lent] = deque()  # scheduled, not handed off yet, oldest first
        self._held: deque[tuple[list[bytes], list[mx.array]]] = deque()  # handed off: (keys, arrays) the writer reads

    def __len__(self) -> int:
        return len(self._lent)

    @property
    def held(self) -> int:
        """Chains handed off whose arrays the writer may still read (kept alive here till then)."""
        return len(self._held)

    def lend(self, blocks: list[Block]) -> None:
        """Schedule a chain's blocks (root side first; a tail, fewer tokens than a block, last) for the disk;
        nothing waits."""
        lent = _Lent([], [], [])
        for block in blocks:
            named = {KV_PREFIX + n: a for n, a in block.kv.items()}
            if block.snapshot is not None:
                named.update({SNAPSHOT_PREFIX + n: a for n, a in block.snapshot.arrays.items()})
            lent.blocks.append(block)
            lent.dtypes.append({n: dtype_name(a) for n, a in named.items()})
            lent.arrays.append({n: a.view(mx.uint16) if a.dtype == mx.bfloat16 else a for n, a in named.items()})
        mx.async_eval([a for arrays in lent.arrays for a in arrays.values()])
        self._lent.append(lent)

    def hand_off(self) -> int:
        """Give the writer what was lent (evaluated by now, so no wait); release what it wrote. Returns blocks taken."""
        self._release_written()
        if not self._lent:
            return 0
        lent_now, self._lent = self._lent, deque()
        mx.eval([a for lent in lent_now for arrays in lent.arrays for a in arrays.values()])
        taken = 0
        for lent in lent_now:
            data = [BlockData(block.key, block.parent, block.depth, block.tokens,
                              {n: np.asarray(a) for n, a in arrays.items()}, dtypes,
                              block.snapshot.meta if block.snapshot is not None else None,
                              tail=len(block.tokens) < self.block)
                    for block, arrays, dtypes in zip(lent.blocks, lent.arrays, lent.dtypes, strict=True)]
            taken += self.ssd.enqueue(data)
            self._held.append(([b.key for b in lent.blocks], [a for d in lent.arrays for a in d.values()]))
        return taken

    def _release_written(self) -> None:
        while self._held and not self.ssd.writing(self._held[0][0]):
            self._held.popleft()

    def drop(self) -> int:
        """Forget the blocks not handed off yet (the tier was cleared); return how many."""
        dropped = sum(len(lent.blocks) for lent in self._lent)
        self._lent.clear()
        return dropped

    def close(self, deadline_s: float) -> None:
        """Hand off everything lent, let the writer flush within `deadline_s`, then release what it read."""
        self.hand_off()
        self.ssd.close(deadline_s)
        self._release_written()
