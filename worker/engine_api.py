"""What the worker loop needs of an engine, without MLX: the interface and the rejection it raises.

The loop (worker/loop.py) drives an engine only through `EngineApi`, so it runs against the MLX
engine (worker/mlx_engine/engine.py) in a worker and against a fake in tests/unit/test_worker_loop.py.
This module imports nothing that imports MLX, and neither does anything the loop imports.

What an engine promises the loop:
- every request `submit` admits ends in exactly one Finished or Failed (from `step`: a request it
  had to end, such as one whose grammar failed mid-request) or Failed (from `fail_all`), unless the
  loop withdraws it with `abort` (the client is gone: nothing is sent);
- `submit` raises RequestRejected for a request the engine refuses (its code goes to the client
  in Failed); any other exception from it is the engine's own failure;
- `tokenize` encodes a request's prompt as `submit` would (raising RequestRejected as it would), and
  neither generates nor touches the batch;
- `plan_step` sizes the next step and says what it predicts; `step` then runs it. A step that
  raises leaves the engine unusable: the loop fails the batch and ends the worker;
- `fail_all` and `abort` remove requests at once, so `len(engine)` counts only live ones;
- `warm_step` runs only while nothing waits in the inbox, and never delays more than one step;
- `close_caches` and `settle` run once, at the end, after the last request has left.

An embedding or rerank model's engine (worker/embedding_engine.py) is an EngineApi whose generation batch stays
empty (it refuses every Submit and Tokenize; `len` counts its queued requests) and an EmbedderApi too; a chat
engine is never an EmbedderApi, so the loop answers an Embed or a Rerank sent to it with a refusal. An audio model's
engine (worker/audio_engine.py) is one too, for Transcribe and Speak. Its
`fail_all` answers with Embedded or Reranked (a code, no rows), which is why `fail_all` returns messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from protocol.messages import (
    CacheStats,
    Embed,
    Embedded,
    Failed,
    Finished,
    Message,
    Rerank,
    Reranked,
    Speak,
    Spoken,
    SpokenPart,
    Submit,
    Transcribe,
    Transcribed,
)
from worker.step_cost import StepPlan


class RequestRejected(Exception):
    """The engine refuses a request (too long for the context, a template that rejects it, ...):
    the client gets Failed(code, message); the worker goes on."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class PromptCacheApi(Protocol):
    """The engine's prompt caches, as the loop reports and clears them."""

    def stats(self) -> CacheStats: ...

    def clear(self, which: str) -> tuple[int, int]:
        """Drop every entry of one tier (`which` in CACHE_TIERS); (entries, bytes) given back."""
        ...


class EngineApi(Protocol):
    """One model and the batch it generates for; everything on the loop's thread."""

    context_length: int
    vocab_size: int
    weights_bytes: int
    load_s: float  # seconds its load took
    generated_tokens: int  # completion tokens produced since the start
    peak_batch_size: int  # the most sequences one step has produced tokens for

    @property
    def drafting(self) -> str:
        """Speculative decoding's mode, resolved ("off", "prompt-lookup", "draft"; "": no text generated)."""
        ...

    @property
    def priced(self) -> bool:
        """Whether what drafting costs here is measured, so that a request may draft (False: not yet, or never)."""
        ...

    @property
    def caches(self) -> PromptCacheApi | None: ...

    @property
    def rids(self) -> list[str]:
        """The requests in flight (admitted, not yet finished, failed or aborted)."""
        ...

    def __len__(self) -> int: ...

    def batch_size(self) -> int:
        """Sequences in the generation batch now."""
        ...

    def waiting(self) -> int:
        """Requests in flight that are not yet in the generation batch."""
        ...

    def submit(self, msg: Submit) -> None: ...

    def tokenize(self, msg: Submit) -> list[int]:
        """The prompt's token ids, encoded and checked as `submit` would; nothing else happens."""
        ...

    def abort(self, rid: str) -> bool:
        """Withdraw one request at once; False when it is not in flight."""
        ...

    def plan_step(self) -> StepPlan: ...

    def step(self) -> tuple[list[list], list[Finished | Failed]]:
        """Run the planned step: text chunks [[rid, text, n_tokens], ...] and the requests that ended."""
        ...

    def after_send(self) -> None:
        """Work the last step left for after its messages were sent (the loop calls it before reading any)."""
        ...

    def fail_all(self, code: str, message: str) -> Sequence[Message]:
        """Remove every request in flight; the Failed (an embedder: Embedded, Reranked) each client is owed."""
        ...

    def warm_step(self) -> bool:
        """Idle work (a warm-up step), run by the loop only while its inbox is empty; False once there is none."""
        ...

    def close_caches(self) -> None: ...

    def settle(self) -> int:
        """Release what the engine holds; the process footprint left, in bytes."""
        ...


@runtime_checkable
class EmbedderApi(Protocol):
    """An engine that embeds or reranks: requests queue (`enqueue`), and the loop runs `embed_step`, one batch
    across every pending request, once per turn while any is pending, so Abort and Evict are read between
    batches and the heartbeat comes between them."""

    def enqueue(self, msg: Embed | Rerank | Transcribe | Speak) -> None:
        """Check, tokenize and queue a request; RequestRejected for a bad one (nothing is queued)."""
        ...

    def embed_step(self) -> Sequence[Embedded | Reranked | Transcribed | Spoken | SpokenPart]:
        """One batch; the replies of the requests it completed (or failed: a code and no rows), and the parts of
        replies sent as they are made (SpokenPart: a request is answered by its reply, after its parts)."""
        ...

    def withdraw(self, rid: str, code: str, message: str) -> Embedded | Reranked | Transcribed | Spoken | None:
        """Remove a pending request; the reply (with `code`) its client is owed, None when it is not pending."""
        ...
