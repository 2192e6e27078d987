"""The one SSE loop (gateway/sse.py) alone: its keep-alives, its error event, the abort when the client
leaves, and one write for deltas queued together.

In process: real `Calls` and `Stream`s on the stub router of test_call.py (pure logic, the real
router's streams are tested against real workers elsewhere), and a recording `Writer` whose bytes
name the method that made them, so a test reads the loop's writes as the calls it made."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

from protocol.messages import Finished
from supervisor import errors
from supervisor.gateway.call import Calls
from supervisor.gateway.openai_api import parse_chat
from supervisor.gateway.sse import stream, streamed
from supervisor.gateway.transcript import Delta
from tests.unit.test_call import CHAT, StubRouter, fin

LIMIT_S = 10  # only so that a broken loop fails instead of hanging


class Recorder:
    """A Writer whose every write says which method made it."""

    def opening(self) -> bytes:
        return b"open;"

    def waiting(self) -> bytes:
        return b"waiting;"

    def idle(self) -> bytes:
        return b"idle;"

    def delta(self, index: int, delta: Delta, first: bool) -> bytes:
        return f"delta {delta[0]};".encode()

    def end(self, index: int, fin: Finished, first: bool) -> bytes:
        return b"end;"

    def done(self) -> bytes:
        return b"done;"

    def failed(self, exc: errors.MlxsupError) -> bytes:
        return f"failed {exc.code};".encode()


class GatedRouter(StubRouter):
    """A router whose acquire waits for `ready` (a cold load) and says when it was cancelled."""

    def __init__(self, queued: list) -> None:
        super().__init__(queued)
        self.ready = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def acquire(self, name: str, explicit: bool = False) -> Any:
        try:
            await self.ready.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return self.lease


def calls_on(router: StubRouter) -> Calls:
    return Calls(router, parse_chat({**CHAT, "stream": True}), "/v1/chat/completions")  # type: ignore[arg-type]


async def next_write(body: AsyncIterator[bytes]) -> bytes:
    return await asyncio.wait_for(anext(body), LIMIT_S)


def test_a_keepalive_is_written_while_the_start_waits_and_while_a_step_is_slow() -> None:
    async def main() -> list[bytes]:
        router = GatedRouter([("a", 1, None)])
        calls = calls_on(router)
        starting = asyncio.create_task(calls.start())
        body = stream(calls, starting, Recorder(), keepalive_s=0.01)
        writes = [await next_write(body), await next_write(body)]  # the opening, a keep-alive of the cold load
        router.ready.set()
        while (write := await next_write(body)) == b"waiting;":
            pass
        writes.append(write)  # the first delta, then nothing comes for a while
        writes.append(await next_write(body))
        assert router.lease.stream is not None
        router.lease.stream.queue.put_nowait(fin(1))
        writes += [w async for w in body]
        calls.close()
        return writes

    assert asyncio.run(main()) == [b"open;", b"waiting;", b"delta a;", b"idle;", b"end;", b"done;"]


def test_a_failure_after_the_first_token_is_the_apis_error_event_and_the_end() -> None:
    async def main() -> list[bytes]:
        calls = calls_on(StubRouter([("a", 1, None), errors.WorkerDied("gone")]))
        starting = asyncio.create_task(calls.start())
        await starting
        writes = [w async for w in stream(calls, starting, Recorder(), 30)]
        calls.close()
        return writes

    assert asyncio.run(main()) == [b"open;", b"delta a;", b"failed worker_crashed;"]


def test_a_start_that_fails_after_the_stream_began_is_an_error_event() -> None:
    async def main() -> list[bytes]:
        router = GatedRouter([errors.WorkerDied("gone")])
        calls = calls_on(router)
        body = stream(calls, asyncio.create_task(calls.start()), Recorder(), keepalive_s=0.01)
        writes = [await next_write(body), await next_write(body)]
        router.ready.set()
        writes += [w async for w in body if w != b"waiting;"]
        calls.close()
        return writes

    assert asyncio.run(main()) == [b"open;", b"waiting;", b"failed worker_crashed;"]


def test_deltas_queued_together_are_one_write() -> None:
    async def main() -> list[bytes]:
        router = StubRouter([("a", 1, None)])
        calls = calls_on(router)
        starting = asyncio.create_task(calls.start())
        await starting
        body = stream(calls, starting, Recorder(), 30)
        writes = [await next_write(body), await next_write(body)]
        assert router.lease.stream is not None
        for i in range(6):  # queued while the client is behind: the loop reads them at once
            router.lease.stream.put(f"w{i} ", [i], None)
        router.lease.stream.queue.put_nowait(fin(7))
        writes += [w async for w in body]
        calls.close()
        return writes

    merged = "".join(f"w{i} " for i in range(6)).encode()
    assert asyncio.run(main()) == [b"open;", b"delta a;", b"delta " + merged + b";", b"end;", b"done;"]


async def serve_until_gone(router: StubRouter, keepalive_s: float) -> list[bytes]:
    """A streamed response through ASGI whose client leaves after its first write: the writes it got."""
    calls = calls_on(router)
    response = await streamed(calls, Recorder(), keepalive_s)
    writes: list[bytes] = []
    wrote = asyncio.Event()

    async def receive() -> dict:
        await wrote.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            writes.append(message["body"])
            wrote.set()

    await asyncio.wait_for(response({"type": "http"}, receive, send), LIMIT_S)
    return writes


def test_a_client_that_leaves_mid_stream_aborts_the_request_and_releases_its_lease() -> None:
    async def main() -> None:
        router = StubRouter([("a", 1, None)])  # then nothing: the generation runs on
        await serve_until_gone(router, keepalive_s=30)
        assert router.lease.aborted == [router.lease.stream.rid]  # type: ignore[union-attr]

    asyncio.run(main())


def test_a_client_that_leaves_during_a_cold_load_cancels_the_start() -> None:
    async def main() -> None:
        router = GatedRouter([])
        writes = await serve_until_gone(router, keepalive_s=0.01)
        assert writes[:1] == [b"open;"]
        await asyncio.wait_for(router.cancelled.wait(), LIMIT_S)
        assert router.lease.stream is None  # never submitted

    asyncio.run(main())
