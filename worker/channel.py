"""The worker's end of its link to the supervisor, as the loop uses it: frames in, frames out.

`Channel` is the seam: the loop (worker/loop.py) sends and receives encoded frames through it and
never touches ZeroMQ itself, so tests drive the loop through an in-memory channel. `ZmqChannel`
is the real one, over the worker's DEALER socket. Invariants: nothing here blocks except `wait`,
and only up to its timeout; a frame the peer cannot take now is refused (send returns False),
never queued behind the loop's back.
"""

from __future__ import annotations

from typing import Protocol, cast

import zmq


class Channel(Protocol):
    def send(self, frame: bytes) -> bool:
        """Hand one frame over without waiting; False when it cannot be taken now (dropped)."""
        ...

    def recv(self) -> bytes | None:
        """The next frame that has arrived, or None at once when there is none."""
        ...

    def wait(self, timeout_ms: int) -> bool:
        """Wait up to timeout_ms (0: not at all) for a frame to arrive; True when one can be read."""
        ...


class ZmqChannel:
    """A Channel over a connected ZeroMQ socket (the worker's DEALER); the poller is made once."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)

    def send(self, frame: bytes) -> bool:
        try:
            self.sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def recv(self) -> bytes | None:
        try:
            return self.sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def wait(self, timeout_ms: int) -> bool:
        if timeout_ms <= 0:  # the busy loop's check, once a step: the socket's state, no poll (which releases the GIL)
            return bool(cast(int, self.sock.get(zmq.EVENTS)) & zmq.POLLIN)
        return bool(self._poller.poll(timeout_ms))
