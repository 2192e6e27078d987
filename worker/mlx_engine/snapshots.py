"""The engine's copies of its snapshot layers' state (sliding windows, recurrent layers) for the prompt caches.

A model whose layers cannot be cut back to a prefix (prompt_cache.py's snapshot layouts) is cached at the points
where their state was copied: where a prompt's prefill stopped at a snapshot point (the engine inserts the prompt
as segments ending there; a solo's prefill chunks end there too, solo.py), and at the last block boundary each
reply's decoding has crossed. A request keeps its snapshots (`Request.snapshots`, by block index) until it finishes
and the caches store them with its tokens.

Invariants: a copy is taken of a sequence's cache exactly when it holds a block boundary's tokens (plain steps
grow a cache by one token; a drafting step, in the batch or the solo, ends no further than a boundary:
batch_drafting.py, solo.py); a failure costs only the caches' benefit (logged, generation goes on).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from mlx_lm.generate import BatchGenerator

from worker.mlx_engine.prompt_cache import PromptCaches
from worker.mlx_engine.solo import Solo, SoloLane

if TYPE_CHECKING:
    from worker.mlx_engine.request_state import Request

log = logging.getLogger(__name__)


class Snapshots:
    """Takes the snapshots of the engine's requests (`by_uid`: the engine's own dict, by the generator's uid)."""

    def __init__(self, caches: PromptCaches, gen: BatchGenerator, lane: SoloLane, by_uid: dict[int, Request]) -> None:
        self.caches, self.gen, self.lane, self.by_uid = caches, gen, lane, by_uid

    def at_prefill_stops(self, progress: list) -> None:
        """Copy the snapshot layers' state of the prompts whose prefill just stopped at a snapshot point."""
        due = {}
        for p in progress:
            req = self.by_uid.get(p.uid)
            if req is not None and p.end_of_segment and not p.end_of_prompt:
                position = req.start + p.progress[0]
                if position in req.snapshot_at:
                    due[p.uid] = (req, position)
        if not due:
            return
        try:
            for uid, (cache, _) in self.gen.extract_cache(list(due)).items():
                req, position = due[uid]
                req.snapshots[position // self.caches.block - 1] = self.caches.snapshot(cache)
        except Exception:
            log.exception("[cache] taking a prefill snapshot failed; going on without it")

    def at_solo_stop(self, req: Request, solo: Solo) -> None:
        """Copy the solo's snapshot layers' state if its prefill just stopped at a snapshot point (it stops at each)."""
        block = self.caches.block
        if solo.fed not in req.snapshot_at or solo.fed // block - 1 in req.snapshots:
            return
        try:
            req.snapshots[solo.fed // block - 1] = self.caches.snapshot(solo.cache_now())
        except Exception:
            log.exception("[cache] taking a prefill snapshot failed; going on without it")

    def of_replies(self) -> None:
        """Keep each reply's snapshot layers' state at the last block boundary its decoding has crossed: a
        conversation's next turn carries this prompt and this reply, so it picks its prefix up there, not at this
        prompt's end, and prefills only its own new tokens (and under a block). One per reply: each replaces the
        last. Checked after every step, which meets every boundary (the module says how)."""
        caches = self.caches
        if not caches.layout.snapshots:
            return
        solo, batch = self.lane.solo, self.gen._generation_batch  # the tokens in each sequence's cache
        fill = ({solo.uid: solo.fed} if solo is not None and solo.decoding
                else dict(zip(batch.uids, map(len, batch.tokens))))
        due = {uid: req for uid, n in fill.items() if n % caches.block == 0 and (req := self.by_uid.get(uid))
               is not None and n // caches.block - 1 not in req.snapshots}
        if not due:
            return
        try:
            if solo is not None:
                taken = {solo.uid: caches.snapshot(solo.cache_now())}
            else:
                taken = {uid: caches.snapshot(cache) for uid, (cache, _) in self.gen.extract_cache(list(due)).items()}
        except Exception:
            log.exception("[cache] taking a reply snapshot failed; going on without it")
            return
        for uid, snapshot in taken.items():
            req = due[uid]
            req.snapshots.pop(req.reply_snapshot, None)
            req.reply_snapshot = fill[uid] // caches.block - 1
            req.snapshots[req.reply_snapshot] = snapshot
