"""The supervisor's ZeroMQ ROUTER socket: bind, read, decode, dispatch; encode and send.

Bound on `ipc://` inside the private runtime directory (0700), or on tcp://127.0.0.1 where
ipc is unavailable or the path would pass the ~100-byte socket path limit (macOS: 104).
Invariant: a malformed, oversized or foreign-version frame is logged and dropped, never fatal;
the reader only moves bytes to the router's handler, which never awaits. A frame already queued is received
without a turn of the event loop, so the reader yields every READ_BATCH frames: a backlog of 50,000 frames
otherwise held the loop (every stream, /health) for 16.5 s in one stretch. The socket file is removed at close
only while it is still the one this transport bound (a successor on the same state directory binds the same path).
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import cast

import zmq
import zmq.asyncio

from protocol.codec import ProtocolError, VersionMismatch, decode, encode
from protocol.messages import Message
from supervisor.config import router_socket
from supervisor.effects import Handler, Refusal
from supervisor.tasks import background

log = logging.getLogger(__name__)
READ_BATCH = 128  # frames read between two turns of the event loop (vLLM's output handler yields every 128 too)


def choose_endpoint(runtime_dir: Path) -> str:
    path = router_socket(runtime_dir)
    if zmq.has("ipc") and path is not None:
        return f"ipc://{path}"
    return "tcp://127.0.0.1:0"


class Transport:
    """Bound when made (so its endpoint can go on workers' command lines); reads once started."""

    def __init__(self, runtime_dir: Path) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 64 * 1024 * 1024)
        endpoint = choose_endpoint(runtime_dir)
        if endpoint.startswith("ipc://"):
            Path(endpoint[len("ipc://"):]).unlink(missing_ok=True)  # a stale socket from a dead run
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._bound = _file_id(self.endpoint)  # the socket file this transport made, if any
        self._reader: asyncio.Task | None = None
        self.dropped = 0

    def start(self, on_message: Handler, on_refused: Refusal) -> None:
        self._reader = background(self._read(on_message, on_refused), name="reader[router]")

    async def _read(self, on_message: Handler, on_refused: Refusal) -> None:
        read = 0
        while True:
            read += 1
            if read % READ_BATCH == 0:
                await asyncio.sleep(0)  # a queued frame is received without a turn of the loop: give it one
            frames = await self.sock.recv_multipart(copy=True)
            if len(frames) != 2:
                self.dropped += 1
                log.warning("[transport] dropped a message of %d frames", len(frames))
                continue
            identity, frame = frames
            try:
                msg = decode(frame)
            except VersionMismatch as exc:
                self.dropped += 1
                on_refused(identity, str(exc))
                continue
            except ProtocolError as exc:
                self.dropped += 1
                log.warning("[transport] dropped a malformed message from %r: %s", identity, exc)
                continue
            try:
                on_message(identity, msg)
            except Exception:
                log.exception("[transport] handler failed on kind=%s from %r", msg.KIND, identity)

    def send(self, identity: bytes, msg: Message) -> bool:
        """Send without waiting; False when the worker is gone or not yet connected (EHOSTUNREACH)."""
        fut = cast(asyncio.Future, self.sock.send_multipart([identity, encode(msg)], flags=zmq.NOBLOCK))
        if fut.done() and fut.exception() is not None:
            log.warning("[transport] could not send kind=%s to %r: %s", msg.KIND, identity, fut.exception())
            return False
        return True

    async def close(self) -> None:
        if self._reader:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self.sock.close(linger=0)
        self.ctx.term()
        if self._bound is not None and _file_id(self.endpoint) == self._bound:  # not a successor's socket
            Path(self.endpoint[len("ipc://"):]).unlink(missing_ok=True)  # noqa: ASYNC240 - one local unlink


def _file_id(endpoint: str) -> tuple[int, int] | None:
    """(device, inode) of an ipc endpoint's socket file; None for another transport or no file."""
    if not endpoint.startswith("ipc://"):
        return None
    try:
        st = os.stat(endpoint[len("ipc://"):])
    except OSError:
        return None
    return st.st_dev, st.st_ino
