"""The engine's record of one request in flight (engine.py): where its prompt and its reply stand, what it has
streamed, and what the prompt caches and usage will need of it when it finishes. Main thread only."""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.mlx_engine.guided import GrammarProcessor
from worker.mlx_engine.speculative import DraftCounts
from worker.request_output import RequestOutput


@dataclass(slots=True)
class Request:
    rid: str
    uid: int
    prompt_tokens: int
    out: RequestOutput
    completion_tokens: int = 0
    cached_tokens: int = 0
    prefill_left: int = 0  # prompt tokens still to prefill (the last one is decoded, not prefilled)
    position: int = 0  # prompt tokens in its cache so far
    start: int = 0  # prompt tokens in its cache when it joined the generator (its progress counts from there)
    snapshot_at: frozenset[int] = frozenset()  # prompt positions where its prefill stops for a cache snapshot
    snapshots: dict = field(default_factory=dict)  # block index -> the snapshot taken at that block's end
    reply_snapshot: int = -1  # the block of the one snapshot kept from its decoding (-1: none yet)
    unsent: list[int] = field(default_factory=list)  # generated ids whose text has not gone out yet
    grammar: GrammarProcessor | None = None
    clamped: bool = False  # its max_tokens reaches the context's end: stopping there is the context's doing
    drafts: DraftCounts = field(default_factory=DraftCounts)  # its speculative decoding (speculative.py), in its usage
    cache_written: int = 0  # prompt tokens past its cached ones, up to its last breakpoint, that the caches keep
    keys: list[int] | None = None  # its tokens as the prompt caches know them, where not its tokens (vision.py)
    checkpointed: int = 0  # prompt tokens in its cache when its computed blocks last went to the caches

