"""The embedding engine's queue: pending requests (Embed, Rerank) and which of their inputs the next batch takes.

Pure logic, no MLX: worker/embedding_engine.py adds each request's token-id sequences, asks `take` for a batch
each loop turn, runs the model's `forward` on it and hands the rows back to `fill`, which says which requests
are now complete. Batching is across requests: one batch packs the inputs of every pending request.

The packing (`take`): the batch's anchor is the pending request served least recently (round-robin by request,
arrival counting as a serving), its shortest pending input first; then every other pending input, shortest first
(the least recently served request first among equal lengths), while the padded batch (inputs x its longest)
fits the token budget. So a short request that arrives behind a long one rides in the next batch, shortest
first, and is answered before the long one ends; and a long request, or one with long inputs, is anchored at
least once every `len(queue)` batches, however many short ones keep coming: nobody starves.

Invariants: every input is taken exactly once; a batch holds at least one input, whatever the budget; a
request leaves the queue when its last row comes back (`fill`) or when it is withdrawn (`remove`, `clear`);
rows come back in each request's own input order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

BATCH_TOKENS = 8192  # padded tokens per forward pass at most: bounds a batch's activations
BATCH_TARGET_S = 0.5  # a batch's target duration: heartbeats (1 s) keep coming, far inside the hang timeout
FIRST_BATCH_TOKENS = 256  # before any batch has been timed: small, on any device


def budget(tokens_per_s: float | None) -> int:
    """Padded tokens for the next batch: what the last batch's speed computes in BATCH_TARGET_S."""
    if tokens_per_s is None:
        return FIRST_BATCH_TOKENS
    return max(1, min(BATCH_TOKENS, int(tokens_per_s * BATCH_TARGET_S)))


@dataclass(eq=False)
class Pending:
    """One request's inputs as token ids, the rows computed so far, and what it answers (the engine's to read)."""

    rid: str
    seqs: list[list[int]]
    request: object
    served_at: int = 0  # the queue's tick of its arrival or its last batch
    left: list[int] = field(default_factory=list)  # inputs not yet taken
    rows: list[list[float]] = field(default_factory=list)
    missing: int = 0  # rows not yet filled

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.seqs)


Pick = tuple[Pending, int]  # a request and the index of one of its inputs


class EmbedQueue:
    """Pending requests in arrival order (see the module docstring)."""

    def __init__(self) -> None:
        self._pending: dict[str, Pending] = {}
        self._tick = 0

    def __len__(self) -> int:
        return len(self._pending)

    def __iter__(self) -> Iterator[Pending]:
        return iter(list(self._pending.values()))

    def add(self, rid: str, seqs: list[list[int]], request: object) -> Pending:
        if not seqs or rid in self._pending:
            raise ValueError(f"a request needs inputs and a rid of its own (rid={rid!r})")
        self._tick += 1
        pending = Pending(rid, seqs, request, self._tick, list(range(len(seqs))), [[] for _ in seqs], len(seqs))
        self._pending[rid] = pending
        return pending

    def take(self, budget_tokens: int) -> list[Pick]:
        """The next batch's inputs (none when nothing is pending), marked taken."""
        candidates = [p for p in self._pending.values() if p.left]
        if not candidates:
            return []
        anchor = min(candidates, key=lambda p: p.served_at)
        first = min(anchor.left, key=lambda i: len(anchor.seqs[i]))
        picks: list[Pick] = [(anchor, first)]
        width = len(anchor.seqs[first])
        rest = sorted(((p, i) for p in candidates for i in p.left if (p, i) != (anchor, first)),
                      key=lambda pick: (len(pick[0].seqs[pick[1]]), pick[0].served_at, pick[1]))
        for p, i in rest:  # by length: once one does not fit, no longer one will
            wider = max(width, len(p.seqs[i]))
            if wider * (len(picks) + 1) > budget_tokens:
                break
            picks.append((p, i))
            width = wider
        self._tick += 1
        for p, i in picks:
            p.left.remove(i)
            p.served_at = self._tick
        return picks

    def untake(self, picks: list[Pick]) -> None:
        """A batch that was not computed: its inputs are left to take again (a withdrawn request's are dropped)."""
        for p, i in picks:
            if self._pending.get(p.rid) is p:
                p.left.append(i)

    def fill(self, picks: list[Pick], rows: list[list[float]]) -> list[Pending]:
        """Store a batch's rows (one per pick, in order); the requests this completed, removed from the queue.
        A pick whose request was withdrawn meanwhile is dropped."""
        done = []
        for (p, i), row in zip(picks, rows, strict=True):
            if self._pending.get(p.rid) is not p:
                continue
            p.rows[i] = row
            p.missing -= 1
            if not p.missing:
                done.append(self._pending.pop(p.rid))
        return done

    def remove(self, rid: str) -> Pending | None:
        return self._pending.pop(rid, None)

    def clear(self) -> list[Pending]:
        gone = list(self._pending.values())
        self._pending.clear()
        return gone
