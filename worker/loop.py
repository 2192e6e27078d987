"""The worker's loop: frames in, engine steps, frames out, all on the main thread (the engine has a batch's text
made on a thread of its own, worker/text_thread.py, and returns it from a later step).

One thread owns the channel and the engine, so nothing here needs a lock. Each turn asks the
shutdown first (`while self._handle_shutdown()`, worker/shutdown.py: it acts on signals and
evicts, aborts what is due, and says when the exit can run), then steps the engine if anything
is in flight, sends a heartbeat when one is due and reads the inbox: without waiting while
requests are in flight or an exit is under way, else up to one idle interval. After a submit,
further ones are awaited for `admit_window_ms` (up to `admit_max`), so a burst of arrivals is
prefilled together rather than a few per step, each step a batch shape of its own; `burst_wait_ms`
instead when the engine was idle and the submit says the gateway has more behind it (Submit.more: its
clients reach the gateway together, but the gateway hands them over one at a time, a few ms apart); with streams
decoding, arrivals join a step at a time, as no stream's next token waits for them. Idle for
IDLE_WORK_QUIET_S, with the inbox empty, the engine does its idle work a step per turn (`warm_step`:
the batch-shape warm-up on a GPU), so a request waits for at most one such step, and a client that
sends its next request at once never does. Heartbeats come
from this loop, so a heartbeat proves the generation loop turns, not merely that a socket is open.

Each step is sized by the engine to a time target (worker/step_cost.py), so the loop turns
several times a second even while a long prompt is prefilled. A step predicted to take a
sizeable part of a heartbeat interval is announced first (StepStarted, with its prediction), so
the supervisor can tell a slow step from a stuck one; decode steps, short, are never announced.

Messages are handled by a table from kind to `_on_<kind>`. The loop knows the engine only as
worker/engine_api.py's EngineApi and the link only as worker/channel.py's Channel, and imports
no MLX: tests/unit/test_worker_loop.py drives it with fakes. Invariants: every Submit is
answered (admitted, or Failed with a code); every Tokenize by Tokenized (a count, or why not),
with no step; every Embed by Embedded and every Rerank by Reranked: queued by an embedding engine
(worker/embedding_engine.py), which answers it from one of its batches, each turn's step being one
batch across every pending request (so an Abort, answered with its code, or an Evict is read between
batches and heartbeats come between them); a refusal at once from any other engine or while exiting;
a step that raises fails its batch and ends the worker; any other unexpected exception fails every
request in flight (worker_crashed) while the channel still works, then ends the worker.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from protocol.codec import ProtocolError, VersionMismatch, decode, encode
from protocol.messages import (
    ABORTED,
    CACHE_TIERS,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    MODEL_EVICTED,
    WORKER_CRASHED,
    Abort,
    CacheCleared,
    ClearCache,
    Embed,
    Embedded,
    Evict,
    Failed,
    Heartbeat,
    Message,
    Ready,
    Rerank,
    Reranked,
    Speak,
    Spoken,
    SpokenPart,
    StepStarted,
    Submit,
    Tokenize,
    Tokenized,
    Tokens,
    Transcribe,
    Transcribed,
)
from worker.channel import Channel
from worker.engine_api import EmbedderApi, EngineApi, RequestRejected
from worker.faults import NO_FAULTS, Faults
from worker.memory import process_memory_bytes
from worker.shutdown import Shutdown

log = logging.getLogger(__name__)

# each question an EmbedderApi answers: its reply's class, and what a chat model's refusal says it does not serve
REPLIES: dict[type, type] = {Embed: Embedded, Rerank: Reranked, Transcribe: Transcribed, Speak: Spoken}
SERVES = {Embed: "embeddings", Rerank: "rerank", Transcribe: "audio transcriptions", Speak: "audio speech"}
ANNOUNCE_FRACTION = 0.5  # a step predicted to take more than this part of a heartbeat interval is announced
MAX_IDLE_WAIT_S = 0.25  # idle, the inbox is waited on this long at most (so signals are seen soon)
IDLE_WORK_QUIET_S = 1.0  # idle work (warm_step) waits for this long without requests: a client's next one comes sooner


class WorkerLoop:
    """One model's serving loop. Its effects are parameters: the channel, the engine, the shutdown,
    the faults, the clock and the memory probe (the defaults are the real ones)."""

    def __init__(self, channel: Channel, engine: EngineApi, model_id: str, shutdown: Shutdown, *,
                 heartbeat_s: float = 1.0, faults: Faults = NO_FAULTS, admit_window_ms: int = 0, admit_max: int = 8,
                 burst_wait_ms: int = 0,
                 clock: Callable[[], float] = time.monotonic,
                 memory: Callable[[], int] = process_memory_bytes) -> None:
        self.channel = channel
        self.engine = engine
        self.embedder = engine if isinstance(engine, EmbedderApi) else None  # asked once: the step path is hot
        self.model_id = model_id
        self.shutdown = shutdown
        self.heartbeat_s = heartbeat_s
        self.faults = faults
        self.clock = clock
        self.memory = memory
        self._idle_ms = int(min(heartbeat_s, MAX_IDLE_WAIT_S) * 1000)
        self._warming = True  # the engine may have idle work (warm_step) until it says it has none
        self._busy_at = clock()  # when a request was last in flight or a frame last came
        self.admit_window_ms = admit_window_ms  # after a submit, wait this long for more before the next step
        self.admit_max = admit_max  # ... until this many came (a prefill batch)
        self.burst_wait_ms = burst_wait_ms  # ... or this long, when the last submit said more are coming
        self._more = False  # the last submit's Submit.more
        self._next_heartbeat = 0.0
        self.turn_at = clock()  # when the current turn began: worker/watchdog.py reads it from its thread
        self._handlers: dict[str, Callable[[Any], None]] = {
            Submit.KIND: self._on_submit,
            Abort.KIND: self._on_abort,
            ClearCache.KIND: self._on_clear_cache,
            Tokenize.KIND: self._on_tokenize,
            Embed.KIND: self._on_embed,
            Rerank.KIND: self._on_embed,
            Transcribe.KIND: self._on_embed,  # an audio model's engine (worker/audio_engine.py) is an EmbedderApi too
            Speak.KIND: self._on_embed,
            Evict.KIND: self._on_evict,
        }

    def send(self, msg: Message) -> None:
        if not self.channel.send(encode(msg)):
            log.error("[send] supervisor not reading; dropped kind=%s", msg.KIND)

    def announce(self) -> None:
        """Ready (and the caches' first stats): the model is loaded and the loop about to run."""
        e = self.engine
        ready = Ready(self.model_id, os.getpid(), e.context_length, e.vocab_size, e.weights_bytes,
                      self.memory(), e.load_s, e.drafting)
        foreign = self.faults.foreign_ready_frame(encode(ready))
        if foreign is not None:
            self.channel.send(foreign)
            return
        self.send(ready)
        self._send_cache_stats()

    def run(self) -> int:
        """Serve until the shutdown lets the exit run, run it, return the exit code."""
        try:
            while self._handle_shutdown():
                self.turn_at = self.clock()
                self._step()
                self._maybe_heartbeat()
                self._read_inbox()
            self.faults.before_exit()
            return self.shutdown.finish(self.engine, self.send, self.model_id)
        except Exception as exc:
            self.fail_in_flight(exc)  # the clients hear of it now, while the channel still works
            raise

    def fail_in_flight(self, exc: BaseException) -> None:
        """An unexpected error ends the worker: tell every request's client, best effort."""
        message = f"the worker crashed: {type(exc).__name__}: {exc}"
        if self.embedder is not None:  # its queue is plain data: each asker gets its own kind of answer
            for reply in self.embedder.fail_all(WORKER_CRASHED, message):
                self.send(reply)
            return
        for rid in self.engine.rids:
            self.send(Failed(rid, WORKER_CRASHED, message))

    def _handle_shutdown(self) -> bool:
        return self.shutdown.keep_running(self.engine, self.send)

    # --- the inbox -----------------------------------------------------------------------

    def _read_inbox(self) -> None:
        idle = not len(self.engine) and self.shutdown.admitting
        wait_ms, warm = (self._idle_ms if idle else 0), False
        if idle and self._warming:  # idle work waits for a quiet IDLE_WORK_QUIET_S, then runs a step per turn
            quiet_left = IDLE_WORK_QUIET_S - (self.clock() - self._busy_at)
            warm = quiet_left <= 0
            wait_ms = 0 if warm else max(1, min(wait_ms, int(quiet_left * 1000)))
        if not self.channel.wait(wait_ms):
            if warm:
                self._warming = self.engine.warm_step()
            return
        if self._warming:
            self._busy_at = self.clock()
        admitted = self._take_frames()
        # arrivals a few milliseconds apart join one prefill, not one step each (new batch shapes each time)
        while 0 < admitted < self.admit_max and (wait := self._admit_wait(idle)) and self.channel.wait(wait):
            more = self._take_frames()
            if not more:
                break
            admitted += more
        if admitted and log.isEnabledFor(logging.DEBUG):  # when a burst reached the engine, and how much of it
            log.debug("[admit] at_ms=%.1f submits=%d in_flight=%d", time.perf_counter() * 1e3, admitted,
                      len(self.engine))

    def _admit_wait(self, idle: bool) -> int:
        """How long to wait for the next submit: the burst wait only at an idle engine (no stream's decode to hold)."""
        return max(self.admit_window_ms, self.burst_wait_ms if self._more and idle else 0)

    def _take_frames(self) -> int:
        """Handle every frame waiting; return how many were submits."""
        submits = 0
        while (frame := self.channel.recv()) is not None:
            try:
                msg = decode(frame)
            except VersionMismatch as exc:
                log.error("[protocol] refused a message: %s", exc)
                continue
            except ProtocolError as exc:
                log.warning("[protocol] dropped a malformed message: %s", exc)
                continue
            handler = self._handlers.get(msg.KIND)
            if handler is None:
                log.warning("[protocol] unexpected message kind=%s", msg.KIND)
                continue
            submits += msg.KIND == Submit.KIND
            handler(msg)
        return submits

    def _on_submit(self, msg: Submit) -> None:
        self._more = msg.more > 0
        if not self.shutdown.admitting:
            self.send(Failed(msg.rid, MODEL_EVICTED, "the model is being evicted"))
            return
        try:
            self.engine.submit(msg)
        except RequestRejected as exc:
            self.send(Failed(msg.rid, exc.code, str(exc)))
        except Exception as exc:
            log.exception("[submit] rid=%s failed", msg.rid)
            self.send(Failed(msg.rid, INTERNAL_ERROR, f"the worker could not start the request: {exc}"))

    def _on_tokenize(self, msg: Tokenize) -> None:
        """Count a prompt between steps: the tokenizer only, so the batch goes on as it was."""
        probe = Submit(msg.rid, 0, messages=msg.messages, prompt=msg.prompt, tools=msg.tools,
                       template_kwargs=msg.template_kwargs)
        try:
            ids = self.engine.tokenize(probe)
        except RequestRejected as exc:
            self.send(Tokenized(msg.rid, 0, code=exc.code, message=str(exc)))
            return
        except Exception as exc:
            log.exception("[tokenize] rid=%s failed", msg.rid)
            self.send(Tokenized(msg.rid, 0, code=INTERNAL_ERROR, message=f"the worker could not tokenize: {exc}"))
            return
        self.send(Tokenized(msg.rid, len(ids), ids if msg.ids else []))

    def _on_embed(self, msg: Embed | Rerank | Transcribe | Speak) -> None:
        """Queue an Embed, a Rerank, a Transcribe or a Speak for its engine; refuse it at once where it cannot go."""
        reply = REPLIES[type(msg)]
        if self.embedder is None:
            serves = SERVES[type(msg)]
            self.send(reply(msg.rid, code=INVALID_REQUEST,
                            message=f"'{self.model_id}' is a chat model: it does not serve {serves}"))
            return
        if not self.shutdown.admitting:
            self.send(reply(msg.rid, code=MODEL_EVICTED, message="the model is being evicted"))
            return
        try:
            self.embedder.enqueue(msg)
        except RequestRejected as exc:
            self.send(reply(msg.rid, code=exc.code, message=str(exc)))
        except Exception as exc:
            log.exception("[embed] rid=%s failed", msg.rid)
            self.send(reply(msg.rid, code=INTERNAL_ERROR, message=f"the worker could not take the request: {exc}"))

    def _on_abort(self, msg: Abort) -> None:
        if self.embedder is not None:  # a question's asker waits for its answer: it gets one, with a code
            reply = self.embedder.withdraw(msg.rid, ABORTED, "the request was aborted")
            if reply is not None:
                self.send(reply)
            return
        self.engine.abort(msg.rid)

    def _on_clear_cache(self, msg: ClearCache) -> None:
        entries = reclaimed = 0
        caches = self.engine.caches
        if msg.which not in CACHE_TIERS:
            log.warning("[cache] model=%s clear refused which=%r (not a cache tier)", self.model_id, msg.which)
        elif caches is not None:
            try:
                entries, reclaimed = caches.clear(msg.which)
            except Exception:
                log.exception("[cache] model=%s clear failed which=%s", self.model_id, msg.which)
        self.send(CacheCleared(msg.rid, msg.which, entries, reclaimed))
        self._send_cache_stats()

    def _on_evict(self, msg: Evict) -> None:
        if self.shutdown.admitting:
            log.info("[evict] model=%s mode=%s deadline_s=%.1f", self.model_id, msg.mode, msg.deadline_s)
        self.shutdown.on_evict(msg.mode, msg.deadline_s)

    # --- the engine and the heartbeat ----------------------------------------------------

    def _step(self) -> None:
        if not len(self.engine):
            return
        if self.embedder is not None:
            self._embed_step(self.embedder)
            return
        self.faults.before_step()  # testing: crash-in-loop raises here, outside the step's own handling
        try:
            plan = self.engine.plan_step()
            if plan.predicted_s > ANNOUNCE_FRACTION * self.heartbeat_s:
                self.send(StepStarted(round(plan.predicted_s, 4), plan.prefill_tokens, plan.decoding))
            chunks, finished = self.engine.step()
            self.faults.after_step()
        except Exception as exc:
            # mlx-lm leaves a BatchGenerator that raised mid-step unusable: fail the batch, then end the
            # process (a crash the supervisor sees) rather than fail every later request while looking healthy
            for failed in self.engine.fail_all(INTERNAL_ERROR, f"generation failed: {exc}"):
                self.send(failed)
            raise
        if chunks:
            self.send(Tokens(chunks))
        for done in finished:
            self.send(done)
        self.engine.after_send()  # the finished sequences' caches are stored once their clients have the end
        self.shutdown.note_finished(len(finished))
        if self._warming:  # once the idle work is over, the per-token path reads no clock for it
            self._busy_at = self.clock()

    def _embed_step(self, embedder: EmbedderApi) -> None:
        """One batch across the pending embeddings (their failures are answered by the engine, which goes on)."""
        self.faults.before_step()  # testing: slow-steps (a batch that takes long), crash-in-loop (a crash mid-batch)
        replies = embedder.embed_step()
        for reply in replies:
            self.send(reply)
        self.shutdown.note_finished(sum(not isinstance(r, SpokenPart) for r in replies))

    def _maybe_heartbeat(self) -> None:
        now = self.clock()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.heartbeat_s
        e = self.engine
        self.send(Heartbeat(active=len(e), waiting=e.waiting(), batch_size=e.batch_size(),
                            max_batch_size=e.peak_batch_size, generated_tokens=e.generated_tokens,
                            memory_bytes=self.memory(), priced=e.priced))
        self._send_cache_stats()

    def _send_cache_stats(self) -> None:
        if self.engine.caches is not None:
            self.send(self.engine.caches.stats())
