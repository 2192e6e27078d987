"""A request's claim on a worker (Lease), and what a lease may ask of the router that gave it (LeaseHost).

Invariants: a Lease counts in at most one worker's `leases` (`held`); it is released once, however
often `release` is called; a suspended request's lease holds nothing until its resume moves it to
the model's next worker (`take_over`, supervisor/resume.py).
"""

from __future__ import annotations

from typing import Protocol

from protocol.messages import Submit
from supervisor.workers import Stream, Worker


class LeaseHost(Protocol):
    """The router's calls a Lease makes (router.Router is the one)."""

    def submit(self, lease: Lease, msg: Submit) -> Stream:
        """Send the request to the lease's worker: its Stream (failed at once if it cannot be sent)."""
        ...

    def abort(self, lease: Lease, rid: str) -> None:
        """The client left: stop the request, wherever it is (on the worker, or suspended)."""
        ...

    def lease_ended(self, worker: Worker) -> None:
        """A lease stopped counting on `worker` (it may idle from now on)."""
        ...


class Lease:
    """A request's claim on a worker, taken when routed and released when its response ends."""

    def __init__(self, host: LeaseHost, worker: Worker) -> None:
        self._host = host
        self.worker = worker
        self.released = False
        self.held = True

    def submit(self, msg: Submit) -> Stream:
        return self._host.submit(self, msg)

    def abort(self, rid: str) -> None:
        self._host.abort(self, rid)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.let_go()

    def let_go(self) -> None:
        """Stop counting in the worker's leases (its request is done there, or suspended)."""
        if self.held:
            self.held = False
            self._host.lease_ended(self.worker)

    def take_over(self, other: Lease) -> None:
        """The request moves to `other`'s worker: this lease holds it from now on, `other` is spent."""
        self.let_go()
        self.worker, self.held = other.worker, True
        other.held, other.released = False, True
