"""The worker's loop: ZeroMQ in, engine steps, ZeroMQ out, all on the main thread.

One thread owns the socket and the engine, so nothing here needs a lock. While requests are
in flight the loop polls the socket without waiting and steps the engine; idle, it waits on
the socket up to one heartbeat interval. Heartbeats come from this loop, so a heartbeat
proves the generation loop turns, not merely that a socket is open.

Each step is sized by the engine to a time target (worker/step_cost.py), so the loop turns
several times a second even while a long prompt is prefilled. A step predicted to take a
sizeable part of a heartbeat interval is announced first (StepStarted, with its prediction), so
the supervisor can tell a slow step from a stuck one; decode steps, short, are never announced.

Signals and the lifeline only flip flags (see worker/__main__.py); the loop acts on them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

import msgpack
import zmq

from protocol.codec import ProtocolError, VersionMismatch, decode, encode
from protocol.messages import (
    EXIT_OK,
    EXIT_PARENT_GONE,
    INTERNAL_ERROR,
    MODEL_EVICTED,
    WORKER_CRASHED,
    CACHE_TIERS,
    Abort,
    CacheCleared,
    ClearCache,
    Evict,
    Failed,
    Heartbeat,
    Message,
    Ready,
    StepStarted,
    Submit,
    Tokens,
)
from worker.mlx_engine.engine import Engine, RequestRejected, process_memory_bytes
from worker.shutdown import Shutdown

log = logging.getLogger(__name__)

ANNOUNCE_FRACTION = 0.5  # a step predicted to take more than this part of a heartbeat interval is announced


@dataclass
class Flags:
    """Set from signal handlers and the lifeline thread; read by the loop."""

    sigterm: threading.Event = field(default_factory=threading.Event)
    parent_gone: threading.Event = field(default_factory=threading.Event)


class WorkerLoop:
    def __init__(self, sock: zmq.Socket, engine: Engine, model_id: str, flags: Flags,
                 heartbeat_s: float = 1.0, faults: set[str] = frozenset()) -> None:
        self.sock = sock
        self.engine = engine
        self.model_id = model_id
        self.flags = flags
        self.heartbeat_s = heartbeat_s
        self.shutdown: Shutdown | None = None
        self._next_heartbeat = 0.0
        self._faults = faults

    def send(self, msg: Message) -> None:
        try:
            self.sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.error("[send] supervisor not reading; dropped kind=%s", msg.KIND)

    def announce(self) -> None:
        e = self.engine
        ready = Ready(self.model_id, os.getpid(), e.context_length, e.vocab_size, e.weights_bytes,
                      process_memory_bytes(), e.load_s)
        if "foreign-protocol" in self._faults:  # testing: a worker from another release
            body = msgpack.unpackb(encode(ready))
            self.sock.send(msgpack.packb({**body, "v": body["v"] + 1}))
            return
        self.send(ready)
        self._send_cache_stats()

    def _send_cache_stats(self) -> None:
        if self.engine.caches is not None:
            self.send(self.engine.caches.stats())

    def run(self) -> int:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        idle_ms = int(min(self.heartbeat_s, 0.25) * 1000)
        while True:
            self._check_flags()
            busy = len(self.engine) > 0
            if poller.poll(0 if busy else idle_ms):
                self._read_inbox()
            if self.shutdown is not None and len(self.engine) and self.shutdown.must_abort():
                for f in self.shutdown.abort_all(self.engine.fail_all):
                    self.send(f)
            if len(self.engine):
                self._step()
            self._maybe_heartbeat()
            if self.shutdown is not None and not len(self.engine):
                return self._exit()

    def _check_flags(self) -> None:
        if self.flags.parent_gone.is_set() and (self.shutdown is None or self.shutdown.reason != "parent_gone"):
            self.shutdown = Shutdown.request("parent_gone", "now", 0)
        elif self.flags.sigterm.is_set() and self.shutdown is None:
            self.shutdown = Shutdown.request("sigterm", "now", 0)

    def _read_inbox(self) -> None:
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(frame)
            except VersionMismatch as exc:
                log.error("[protocol] refused a message: %s", exc)
                continue
            except ProtocolError as exc:
                log.warning("[protocol] dropped a malformed message: %s", exc)
                continue
            self._on_message(msg)

    def _on_message(self, msg: Message) -> None:
        if isinstance(msg, Submit):
            self._on_submit(msg)
        elif isinstance(msg, Abort):
            self.engine.abort(msg.rid)
        elif isinstance(msg, ClearCache):
            self._on_clear_cache(msg)
        elif isinstance(msg, Evict):
            if self.shutdown is None:
                log.info("[evict] model=%s mode=%s deadline_s=%.1f", self.model_id, msg.mode, msg.deadline_s)
                self.shutdown = Shutdown.request("evict", msg.mode, msg.deadline_s)
            elif msg.mode == "now":
                self.shutdown.mode = "now"  # a second, harder evict tightens the first
        else:
            log.warning("[protocol] unexpected message kind=%s", msg.KIND)

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

    def _on_submit(self, msg: Submit) -> None:
        if self.shutdown is not None:
            self.send(Failed(msg.rid, MODEL_EVICTED, "the model is being evicted"))
            return
        try:
            self.engine.submit(msg)
        except RequestRejected as exc:
            self.send(Failed(msg.rid, exc.code, str(exc)))
        except Exception as exc:
            log.exception("[submit] rid=%s failed", msg.rid)
            self.send(Failed(msg.rid, INTERNAL_ERROR, f"the worker could not start the request: {exc}"))

    def _step(self) -> None:
        if "slow-steps" in self._faults:
            time.sleep(0.4)
        if "crash-in-loop" in self._faults:  # testing: an exception no handler here expects
            raise RuntimeError("fault: crash-in-loop")
        try:
            plan = self.engine.plan_step()
            if plan.predicted_s > ANNOUNCE_FRACTION * self.heartbeat_s:
                self.send(StepStarted(round(plan.predicted_s, 4), plan.prefill_tokens, plan.decoding))
            chunks, finished = self.engine.step()
            if "step-raises" in self._faults:  # testing: MLX or mlx-lm failing inside a step
                raise RuntimeError("fault: step-raises")
        except Exception as exc:
            # mlx-lm leaves a BatchGenerator that raised mid-step unusable: fail the batch, then end the
            # process (a crash the supervisor sees) rather than fail every later request while looking healthy
            for f in self.engine.fail_all(INTERNAL_ERROR, f"generation failed: {exc}"):
                self.send(f)
            raise
        if chunks:
            self.send(Tokens(chunks))
        for f in finished:
            self.send(f)
        if self.shutdown is not None and finished:
            self.shutdown.note_drained(len(finished))

    def _maybe_heartbeat(self) -> None:
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.heartbeat_s
        e = self.engine
        self.send(Heartbeat(active=len(e), waiting=e.waiting(), batch_size=e.batch_size(),
                            max_batch_size=e.peak_batch_size, generated_tokens=e.generated_tokens,
                            memory_bytes=process_memory_bytes()))
        self._send_cache_stats()

    def _exit(self) -> int:
        assert self.shutdown is not None
        if "hang-on-evict" in self._faults:  # testing the supervisor's kill ladder: a worker stuck in its exit
            log.warning("[fault] hanging instead of exiting")
            threading.Event().wait()
        bye = self.shutdown.finish(close_caches=self.engine.close_caches, settle=self.engine.settle)
        log.info("[evict] model=%s phase=bye reason=%s aborted=%d drained=%d phases=%s", self.model_id,
                 bye.reason, bye.aborted, bye.drained, {k: round(v, 4) for k, v in bye.phases.items()})
        if bye.reason == "parent_gone":
            return EXIT_PARENT_GONE
        self.send(bye)
        return EXIT_OK

    def fail_in_flight(self, exc: BaseException) -> None:
        """An unexpected error ends the worker: tell every request's client, best effort."""
        for rid in self.engine.rids:
            self.send(Failed(rid, WORKER_CRASHED, f"the worker crashed: {type(exc).__name__}: {exc}"))
