"""The engine of an embedding or rerank model: requests checked and queued, one batch across them per loop turn.

worker/loop.py drives it as its EngineApi (a generation batch that stays empty: a chat request is refused with a
message that says what this model serves) and as an EmbedderApi: `enqueue` for an Embed or a Rerank (checked
and tokenized at once, so a bad input is refused before any batch), `embed_step` once per loop turn while
requests are pending, `withdraw` for an Abort. The model is anything with the scorer interface below: the BERT
family's Embedder (worker/mlx_engine/embedder.py) and the decoders' DecoderEmbedder and DecoderReranker
(worker/mlx_engine/decoder_pool.py). This module imports no MLX, so tests drive it with a fake model.

Invariants: every queued request is answered exactly once, by its Embedded or Reranked: with its rows, in its
inputs' order, when the batch that held its last input is done; or with a code when it is withdrawn (abort,
evict) or when a batch of that one input alone raised (the worker goes on: a scorer keeps no state between
batches); a failing batch of several inputs (the device out of memory) is not an error: its inputs are queued
again and every later batch is at most half its size. A batch is sized to the measured speed (worker/embed_queue.py's `budget`), so the loop's heartbeat
comes between batches, never a minute apart. A vector is normalised, and normalised again after `dimensions`
cuts it.
"""

from __future__ import annotations

import gc
import logging
import math
import re
import time
from collections.abc import Callable
from typing import Protocol, cast

from protocol.messages import (
    CONTEXT_LENGTH_EXCEEDED,
    INPUT_TYPES,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    Embed,
    Embedded,
    Failed,
    Finished,
    Rerank,
    Reranked,
    Submit,
)
from worker.embed_queue import BATCH_TOKENS, EmbedQueue, Pending, budget
from worker.engine_api import PromptCacheApi, RequestRejected
from worker.memory import process_memory_bytes
from worker.step_cost import StepPlan

log = logging.getLogger(__name__)

Reply = Embedded | Reranked
# a query prompt in the "Instruct: <task>\nQuery:" form (Qwen3-Embedding, gte-Qwen, e5-mistral): an instruction
# replaces its task and keeps the model's own framing
INSTRUCT_PROMPT = re.compile(r"^(Instruct: ?)(.*)(\n\s*Query: ?)$", re.DOTALL)


class Scorer(Protocol):
    """What the engine needs of a model: a window, tokens, and rows for a batch of id lists (a unit vector per
    row for an embedder, whose `dim` is its width; [score] per row for a reranker, whose `dim` is None)."""

    window: int
    vocab_size: int
    tokens_per_s: float | None  # padded tokens per second on the last batch, None before one

    @property
    def dim(self) -> int | None: ...

    def forward(self, batch: list[list[int]], dimensions: int | None) -> list[list[float]]: ...


class TextEmbedder(Scorer, Protocol):
    def encode(self, texts: list[str], limit: int | None = None) -> list[list[int]]: ...


class Reranker(Scorer, Protocol):
    def pairs(self, query: str, docs: list[str], limit: int, instruction: str | None = None) -> list[list[int]]: ...


def timed_forward(model: Scorer, batch: list[list[int]], dimensions: int | None) -> list[list[float]]:
    """`model.forward(batch)`, its speed (padded tokens per second) kept in `model.tokens_per_s` for the next budget."""
    started = time.perf_counter()
    rows = model.forward(batch, dimensions)
    model.tokens_per_s = len(batch) * max(map(len, batch)) / max(time.perf_counter() - started, 1e-6)
    return rows


def run_alone(model: Scorer, seqs: list[list[int]], dimensions: int | None = None,
              between: Callable[[], None] = lambda: None) -> list[list[float]]:
    """`model`'s rows for `seqs` as the worker computes them for a request alone (its queue, budget and batches):
    the in-process reference; `between` runs after each batch."""
    queue = EmbedQueue()
    queue.add("in-process", seqs, None)
    while True:
        picks = queue.take(budget(model.tokens_per_s))
        rows = timed_forward(model, [p.seqs[i] for p, i in picks], dimensions)
        between()
        if done := queue.fill(picks, rows):
            return done[0].rows


def prefixed(prompts: dict[str, str], input_type: str | None, instruction: str | None) -> str:
    """The text a text input is prefixed with (see Embed in protocol/messages.py)."""
    if instruction is not None and input_type != "document":
        found = INSTRUCT_PROMPT.match(prompts.get("query", ""))
        return f"{found.group(1)}{instruction}{found.group(3)}" if found else instruction
    return prompts.get(input_type or "", "") if input_type else ""


def cut(row: list[float], dimensions: int | None) -> list[float]:
    """Matryoshka: the leading `dimensions` components, unit length again."""
    if dimensions is None or dimensions >= len(row):
        return row
    head = row[:dimensions]
    norm = max(math.sqrt(sum(x * x for x in head)), 1e-12)
    return [x / norm for x in head]


class EmbeddingEngine:
    """worker/engine_api.py's EngineApi (no generation batch) and EmbedderApi, over a Scorer."""

    def __init__(self, model: TextEmbedder | Reranker, prompts: dict[str, str] | None = None, *, weights_bytes: int = 0,
                 load_s: float = 0.0, release: Callable[[], None] = lambda: None,
                 unload: Callable[[Callable[[], None]], object] = lambda drop: drop()) -> None:
        self.model = model
        self.release = release  # the device's buffer cache back to the system (embedder.py: MLX's clear_cache)
        self.unload = unload  # settle's last step: the model dropped, MLX given back (embedder.py: release.py's)
        self.reranks = model.dim is None
        self.prompts = prompts or {}
        self.queue = EmbedQueue()
        self.context_length = model.window
        self.vocab_size = model.vocab_size
        self.weights_bytes = weights_bytes
        self.load_s = load_s
        self.drafting, self.priced = "", False
        self.generated_tokens = 0
        self.peak_batch_size = 0  # the most inputs one batch has held
        self.ceiling = BATCH_TOKENS  # padded tokens per batch at most: halved by each batch the device failed
        self.prefill_batch_size = 1
        self.embedded_tokens = 0

    # --- EmbedderApi -------------------------------------------------------------------------

    def enqueue(self, msg: Embed | Rerank) -> None:
        """Check and tokenize a request and queue it; RequestRejected for a bad one (nothing is queued)."""
        if isinstance(msg, Rerank) != self.reranks:
            raise RequestRejected(INVALID_REQUEST, "this model is a reranker: it serves /v1/rerank, not embeddings"
                                  if self.reranks else "this model is an embedding model: it serves /v1/embeddings, "
                                  "not rerank")
        seqs = self._rerank_ids(msg) if isinstance(msg, Rerank) else self._embed_ids(msg)
        self.queue.add(msg.rid, seqs, msg)

    def embed_step(self) -> list[Reply]:
        """One batch across the pending requests; the replies of those it completed."""
        picks = self.queue.take(min(budget(self.model.tokens_per_s), self.ceiling))
        if not picks:
            return []
        batch = [p.seqs[i] for p, i in picks]
        try:
            rows = timed_forward(self.model, batch, None)  # `dimensions` differ by request: cut per request below
        except Exception as exc:
            if len(batch) > 1:  # out of device memory, most likely: its inputs again, in batches half as large
                self.ceiling = max(1, len(batch) * max(map(len, batch)) // 2)
                log.warning("[embed] batch failed inputs=%d (%s); ceiling=%d tokens, inputs queued again",
                            len(batch), exc, self.ceiling)
                self.queue.untake(picks)
                self.release()
                return []
            log.exception("[embed] batch failed inputs=%d", len(batch))
            hit = {p.rid: p for p, _ in picks}
            return [self._refusal(p, INTERNAL_ERROR, f"the worker could not compute the batch: {exc}")
                    for p in hit.values() if self.queue.remove(p.rid) is not None]
        self.peak_batch_size = max(self.peak_batch_size, len(batch))
        return [self._answer(p) for p in self.queue.fill(picks, rows)]

    def withdraw(self, rid: str, code: str, message: str) -> Reply | None:
        """Remove one request; the reply its client is owed (None: not pending)."""
        pending = self.queue.remove(rid)
        return None if pending is None else self._refusal(pending, code, message)

    def fail_all(self, code: str, message: str) -> list[Reply]:
        return [self._refusal(p, code, message) for p in self.queue.clear()]

    # --- checks and answers --------------------------------------------------------------------

    def _embed_ids(self, msg: Embed) -> list[list[int]]:
        m = cast(TextEmbedder, self.model)  # an embedder: `reranks` is False (enqueue checked)
        dim = m.dim or 0
        if msg.dimensions is not None and not 0 < msg.dimensions <= dim:
            raise RequestRejected(INVALID_REQUEST, f"dimensions must be between 1 and {dim} for this model "
                                                   f"(got {msg.dimensions})")
        if msg.input_type is not None and msg.input_type not in INPUT_TYPES:
            raise RequestRejected(INVALID_REQUEST, f"input_type must be one of {', '.join(INPUT_TYPES)}")
        limit = self._limit(msg.truncate)
        prefix = prefixed(self.prompts, msg.input_type, msg.instruction)
        texts = [(i, prefix + x) for i, x in enumerate(msg.inputs) if isinstance(x, str)]
        seqs: list[list[int]] = [x if isinstance(x, list) else [] for x in msg.inputs]
        for (i, _), ids in zip(texts, m.encode([t for _, t in texts], limit if msg.truncate is not None else None)):
            seqs[i] = ids
        for i, seq in enumerate(seqs):
            if not seq:
                raise RequestRejected(INVALID_REQUEST, f"input[{i}] is empty")
            if isinstance(msg.inputs[i], list) and not all(type(t) is int and 0 <= t < m.vocab_size for t in seq):
                raise RequestRejected(INVALID_REQUEST, f"input[{i}] holds a token id outside 0..{m.vocab_size - 1}")
            if len(seq) > limit:
                if msg.truncate is None:
                    raise RequestRejected(CONTEXT_LENGTH_EXCEEDED,
                                          f"input[{i}] has {len(seq)} tokens; this model's window is {m.window} "
                                          "(send truncate to cut it)")
                seqs[i] = seq[:limit]
        return seqs

    def _rerank_ids(self, msg: Rerank) -> list[list[int]]:
        if not msg.documents or not all(isinstance(d, str) for d in msg.documents):
            raise RequestRejected(INVALID_REQUEST, "documents must be a non-empty list of strings")
        limit = self._limit(msg.truncate or 0)
        reranker = cast(Reranker, self.model)  # `reranks`: enqueue checked
        try:
            seqs = reranker.pairs(msg.query, list(msg.documents), limit, msg.instruction)
        except ValueError as exc:  # a limit that leaves no room for the pair in the model's prompt
            raise RequestRejected(INVALID_REQUEST, str(exc)) from None
        for i, seq in enumerate(seqs):
            if len(seq) <= limit:
                continue
            # the query and the prompt alone pass the limit: cutting the document cannot help
            if limit < self.model.window:  # the request's own limit, not the model's window
                raise RequestRejected(INVALID_REQUEST, f"the query with documents[{i}] takes {len(seq)} tokens "
                                      "before any of the document's, over the request's limit of "
                                      f"{limit} token{'s' if limit != 1 else ''} per query-document pair "
                                      f"(max_tokens_per_doc or truncate_prompt_tokens; this model's window is "
                                      f"{self.model.window}): raise it or shorten the query")
            raise RequestRejected(CONTEXT_LENGTH_EXCEEDED, f"the query with documents[{i}] takes {len(seq)} "
                                                           f"tokens; this model's window is {limit}")
        return seqs

    def _limit(self, truncate: int | None) -> int:
        if truncate is not None and truncate < 0:
            raise RequestRejected(INVALID_REQUEST, "truncate must be 0 (the window) or a positive token count")
        return self.model.window if not truncate else min(truncate, self.model.window)

    def _answer(self, p: Pending) -> Reply:
        self.embedded_tokens += p.tokens
        if isinstance(p.request, Rerank):
            return Reranked(p.rid, [row[0] for row in p.rows], p.tokens)
        assert isinstance(p.request, Embed)
        return Embedded(p.rid, [cut(row, p.request.dimensions) for row in p.rows], p.tokens)

    @staticmethod
    def _refusal(p: Pending, code: str, message: str) -> Reply:
        return Reranked(p.rid, code=code, message=message) if isinstance(p.request, Rerank) else \
            Embedded(p.rid, code=code, message=message)

    # --- EngineApi: no generation ----------------------------------------------------------

    def _refuse(self) -> RequestRejected:
        serves = "a reranker: it serves /v1/rerank" if self.reranks else "an embedding model: it serves /v1/embeddings"
        return RequestRejected(INVALID_REQUEST, f"this model is {serves}, not chat or completions")

    @property
    def caches(self) -> PromptCacheApi | None:
        return None

    @property
    def rids(self) -> list[str]:
        return [p.rid for p in self.queue]

    def __len__(self) -> int:
        return len(self.queue)

    def batch_size(self) -> int:
        return 0

    def waiting(self) -> int:
        return len(self.queue)

    def submit(self, msg: Submit) -> None:
        raise self._refuse()

    def tokenize(self, msg: Submit) -> list[int]:
        raise self._refuse()

    def abort(self, rid: str) -> bool:
        return self.queue.remove(rid) is not None

    def plan_step(self) -> StepPlan:
        return StepPlan(0, 0, 0, 0, 0.0, 0.0)

    def step(self) -> tuple[list[list], list[Finished | Failed]]:
        return [], []

    def after_send(self) -> None:
        pass

    def warm_step(self) -> bool:
        return False

    def close_caches(self) -> None:
        pass

    def settle(self) -> int:
        """Give back everything: the model dropped and MLX's memory released (mlx_engine/release.py's order)."""
        def drop() -> None:
            vars(self)["model"] = None  # the engine serves nothing after settle

        self.unload(drop)
        gc.collect()
        self.release()
        return process_memory_bytes()
