"""The worker's ZeroMQ channel (worker/channel.py) over a real socket pair: `wait(0)` (the busy loop's check, read
from the socket's state rather than polled) says whether a frame can be read, and `wait(ms)` waits for one."""

from __future__ import annotations

import time

import zmq

from worker.channel import ZmqChannel


def test_wait_says_when_a_frame_can_be_read_with_and_without_a_timeout() -> None:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        router.bind("inproc://channel-test")
        dealer.setsockopt(zmq.IDENTITY, b"w")
        dealer.connect("inproc://channel-test")
        channel = ZmqChannel(dealer)
        assert not channel.wait(0) and channel.recv() is None
        for n in range(2):
            router.send_multipart([b"w", b"frame%d" % n])
        deadline = time.monotonic() + 5
        while not channel.wait(0):  # delivered by ZeroMQ's own thread: polled with a deadline
            assert time.monotonic() < deadline
        assert channel.recv() == b"frame0" and channel.wait(0) and channel.recv() == b"frame1"
        assert not channel.wait(0) and not channel.wait(20)  # nothing left: a timed wait runs out
        router.send_multipart([b"w", b"late"])
        assert channel.wait(2000) and channel.recv() == b"late"
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()
