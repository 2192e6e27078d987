"""The batch's lane: requests run as rows of mlx-lm's BatchGenerator, the engine's runner beside the solo lane
(solo.py's SoloLane), with the same calls: `start` an EngineRequest, `step`, what a row has `computed` (an abort's
cache), `drop` it, `finish` it (its cache and tokens for the prompt caches).

Drafting wraps its step: greedy rows of a small batch draft in lockstep (batch_drafting.py's BatchDrafting, `drafts`),
and a step of theirs, when they take one, stands for the generator's `next()`.

Invariants: a row the engine drops or finishes leaves the generator and the drafting rows at once; nothing here
knows the engine's records of its requests (engine.py keeps them by uid).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from mlx_lm.generate import BatchGenerator, StopSequences

from worker.mlx_engine.batch_drafting import BatchDrafting
from worker.mlx_engine.checkpoints import row_view

if TYPE_CHECKING:
    from worker.mlx_engine.request import EngineRequest


class Lane(Protocol):
    """What the engine asks the lane that runs a request (BatchLane, solo.py's SoloLane) about it."""

    def computed(self, uid: int) -> tuple[list | None, list[int] | None]: ...

    def row(self, uid: int, layers: Any) -> tuple[list, list[int]] | None: ...

    def finish(self, uid: int, r: Any) -> tuple[list | None, list[int] | None]: ...


class BatchLane:
    def __init__(self, gen: BatchGenerator, drafts: BatchDrafting, stop_none: StopSequences) -> None:
        self.gen = gen
        self.drafts = drafts
        self._stop_none = stop_none

    def start(self, r: EngineRequest, cached: int, prefix: list | None, points: list[int],
              stop_eos: StopSequences) -> int:
        """A request joins the batch, `cached` of its tokens in `prefix` (its starting cache), its prompt's rest in
        segments that end at each snapshot point, stopped by `stop_eos` (the engine's EOS; unless it ignores EOS); its
        uid in the generator."""
        tokens, d, drafting = r.tokens, r.decoding, r.drafting
        cuts = [0] + [p - cached for p in points] + [len(tokens) - cached]
        (uid,) = self.gen.insert_segments(
            [[tokens[cached + a:cached + b] for a, b in zip(cuts, cuts[1:]) if b > a]],  # prefill stops at each point
            max_tokens=[r.max_tokens],
            caches=[prefix] if prefix is not None else None,
            all_tokens=[tokens[:cached]],
            samplers=[drafting.draws if drafting is not None and drafting.draws is not None  # type: ignore[list-item]
                      else d.sampler],  # a seeded request's draws, which drafting steps draw on too; None: greedy
            logits_processors=[d.processors],
            stop_sequences=[self._stop_none if r.ignore_eos else stop_eos],
        )
        self.drafts.add(uid, drafting)
        return uid

    def step(self) -> tuple[list, list, bool]:
        """One step of the batch: (the generator's prefill progress, the responses, whether the rows drafted)."""
        drafted = self.drafts.step()
        if drafted is not None:
            return [], drafted, True
        progress, responses = self.gen.next()
        return progress, responses, False

    def computed(self, uid: int) -> tuple[list | None, list[int] | None]:
        """What a row has computed (its cache and the tokens in it), the row going on."""
        return self.gen.extract_cache([uid]).get(uid, (None, None))

    def row(self, uid: int, layers: Any) -> tuple[list, list[int]] | None:
        """A prefilling row's cache as it stands, for a prefill checkpoint (checkpoints.py)."""
        return row_view(self.gen, uid, layers)

    def drop(self, uid: int) -> None:
        self.gen.remove([uid])
        self.drafts.drop(uid)

    def finish(self, uid: int, r: Any) -> tuple[list | None, list[int] | None]:
        """A row ended (`r`: the response that ended it; None, or one without a reason: a stop string ended it and the
        generator still runs it): its cache and tokens."""
        self.drafts.drop(uid)
        if r is None or r.finish_reason is None:
            return self.gen.remove([uid], return_prompt_caches=True).get(uid, (None, None))
        return r.prompt_cache, r.all_tokens
