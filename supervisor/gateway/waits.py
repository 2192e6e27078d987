"""What a streamed request waits for, in words: the text of its keep-alives' SSE comment.

Every API's keep-alive is an event the API defines (sse.py's Writers: a chat chunk with an empty delta, a
Responses `response.in_progress`, Anthropic's `ping`), which its clients count as activity; none of them has a
field for why nothing came, so that is said in an SSE comment beside it (clients skip comments; a person
reading the stream, curl's or a log's, sees it). Read from the router's state at each keep-alive, nothing
tracked for it, so it says what the router knows then:
- not routed yet: the model's worker loading (its stage and fraction), the model's previous worker exiting,
  other models' workers exiting to make room for it (memory, or max_loaded_models: admission waits for them),
  a restart's back-off;
- sent to its worker, no token yet: prefilling, or queued with the other requests the worker's last heartbeat
  counted not yet decoding (prefilling or waiting for the batch: the worker says how many, not in which order);
- suspended (its worker ended under it, supervisor/resume.py): why, and for how long (also after its first token).
Invariant: only what the router shows is said: "loading" only while the model's worker loads, "waiting for room"
only while workers are on their way out and this model has none (what admission waits for then).
"""

from __future__ import annotations

from supervisor import errors
from supervisor.gateway.call import Call, Calls
from supervisor.router import Router
from supervisor.workers import State

RESUME_CAUSES = {"crash": "its worker crashed", "hang": "its worker hung",
                 "pressure": "its model was evicted under memory pressure"}
LEAVING = (State.EVICTING, State.FAILED)  # a worker on its way out (admission waits for these to be gone)


def comment(text: str | None) -> bytes:
    return f": {text}\n\n".encode() if text else b""


class Waits:
    """The keep-alive comments of one request's stream (`calls`), naming the model by its id (the local model an
    agent's name for one was mapped to, not that name)."""

    def __init__(self, router: Router, calls: Calls) -> None:
        self.router = router
        self.calls = calls
        self._model: str | None = None

    @property
    def model(self) -> str:
        """The model's id in the registry (resolved once; the name itself if it resolves to none)."""
        if self._model is None:
            try:
                self._model = self.router.registry.resolve(self.calls.parsed.model).id
            except errors.MlxsupError:
                self._model = self.calls.parsed.model
        return self._model

    def waiting(self) -> bytes:
        """The comment while the request has not started (a choice without its first event)."""
        return comment(self.resuming() or next((said for c in self.calls.calls if (said := self.before_first(c))),
                                               None))

    def idle(self) -> bytes:
        """The comment while a started request says nothing: only a suspension is known to say (a slow step is not)."""
        return comment(self.resuming())

    def resuming(self) -> str | None:
        for call in self.calls.calls:
            suspension = self.router.suspension(call.submit.rid)
            if suspension is not None:
                paused = self.router.clock.monotonic() - suspension.since
                return f"resuming {self.model}: {RESUME_CAUSES[suspension.cause]}; paused {paused:.0f}s"
        return None

    def before_first(self, call: Call) -> str | None:
        """What `call` waits for before its first event; None once it has one."""
        if call.first is not None:
            return None
        if call.lease is None:
            return self.routing()
        heartbeat = call.lease.worker.heartbeat  # its `waiting`: the requests not yet decoding, this one among them
        if heartbeat is not None and heartbeat.waiting > 1:
            return (f"waiting for the first token of {self.model}: prefilling or queued with "
                    f"{heartbeat.waiting - 1} other request(s) not yet decoding")
        return f"waiting for the first token of {self.model}: prefilling"

    def routing(self) -> str:
        """What a request not yet given a worker waits for (router.acquire's and admission's waits)."""
        router, model = self.router, self.model
        worker = router.workers.get(model)
        if worker is not None:
            if worker.state is State.LOADING:
                return f"loading {model}: {worker.progress.stage} {worker.progress.fraction:.0%}"
            if worker.state in LEAVING:
                return f"waiting for {model}'s last worker to exit"
            slot = router.slots.get(model)
            if slot is not None and len(slot.queue) > 1:
                return f"queued for {model} with {len(slot.queue) - 1} other request(s)"
            return f"waiting for {model}"  # ready: the lease is taken in this very turn
        record = router.slots.get(model)
        now = router.clock.monotonic()
        if record is not None and record.backoff_until > now:
            return f"waiting {record.backoff_until - now:.0f}s to restart {model} after a crash"
        leaving = sorted(w.spec.id for w in router.workers.values() if w.state in LEAVING)
        if leaving:
            return f"waiting for room to load {model}: {', '.join(leaving)} exiting"
        if record is not None and record.queue:
            busy = sorted({s.worker.spec.id for w in record.queue for s in w.waits_for if s.worker is not None})
            if busy:
                return f"waiting for room to load {model}: {', '.join(busy)} finishing its requests"
        return f"waiting to load {model}"
