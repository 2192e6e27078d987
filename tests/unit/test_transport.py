"""supervisor/transport.py with a real ZeroMQ socket: a backlog of worker frames is drained in stretches, each
followed by a turn of the event loop, so one worker's flood cannot hold the loop (and /health, and every other
stream) for the length of the whole backlog; and the socket file it bound is removed at close only if it is still
the one it bound."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from protocol.codec import encode
from protocol.messages import Heartbeat
from supervisor.transport import READ_BATCH, Transport
from tests.conftest import wait_for

BACKLOG = 50_000


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A run dir whose socket path fits the ipc limit (pytest's tmp paths may not)."""
    path = Path(tempfile.mkdtemp(prefix="mlxsup-t-"))
    os.chmod(path, 0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_backlog_of_frames_is_drained_in_stretches_that_let_the_loop_run(run_dir: Path) -> None:
    """Catches: a reader that takes queued frames without yielding (recv of a queued frame completes at once),
    which held the event loop for 16.5 s over a backlog of 50,000 frames."""

    transport = Transport(run_dir)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"w1")
    dealer.setsockopt(zmq.SNDHWM, 0)
    dealer.connect(transport.endpoint)
    frame = encode(Heartbeat(active=1, waiting=0, batch_size=1, max_batch_size=8, generated_tokens=1,
                             memory_bytes=1))
    for _ in range(BACKLOG):
        dealer.send(frame)
    # every frame is in the router's queue before its reader starts: the whole backlog is ready at once
    wait_for(lambda: transport.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN, 30, what="the frames to arrive")
    time.sleep(0.5)

    async def main() -> tuple[int, float, float, int]:
        got = 0
        drained = asyncio.Event()

        def on_message(identity: bytes, msg: object) -> None:
            nonlocal got
            got += 1
            if got == BACKLOG:
                drained.set()

        gaps: list[float] = []

        async def ticker() -> None:
            last = time.perf_counter()
            while not drained.is_set():
                await asyncio.sleep(0)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        t0 = time.perf_counter()
        transport.start(on_message, lambda identity, why: None)
        await asyncio.wait_for(drained.wait(), 120)
        drain_s = time.perf_counter() - t0
        await tick
        await transport.close()
        return got, drain_s, max(gaps), len(gaps)

    got, drain_s, longest, ticks = asyncio.run(main())
    dealer.close(linger=0)
    ctx.term()
    print(f"drained {got} frames in {drain_s:.2f}s: {ticks} ticks, longest gap {longest * 1e3:.1f} ms")
    assert got == BACKLOG
    assert ticks >= BACKLOG // READ_BATCH // 2, "the reader did not yield while frames were queued"
    assert longest < drain_s / 8, "one stretch of the drain held the loop for most of it"


def test_close_leaves_a_socket_file_another_transport_bound_since(run_dir: Path) -> None:
    """Catches: a daemon shutting down that unlinked its successor's `run/router.sock` (the path is the same)."""
    if not zmq.has("ipc"):
        pytest.skip("no ipc transport here")

    first = Transport(run_dir)
    path = Path(first.endpoint[len("ipc://"):])
    path.unlink()
    path.write_text("a successor's socket")  # bound at the same path since
    asyncio.run(first.close())
    assert path.read_text() == "a successor's socket"
    path.unlink()
    second = Transport(run_dir)
    assert path.exists()
    asyncio.run(second.close())
    assert not path.exists()  # its own socket is removed
