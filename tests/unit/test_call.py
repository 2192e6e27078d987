"""A Call's hot path (issue 25): no task per token, a keep-alive that still fires, and deltas queued
together read as one, both by a Call and on the wire (one write, one SSE event).

In process: real `Call`s and `Stream`s, and the real gateway (build_app) driven through ASGI, on a
stub router whose lease hands out a Stream the test feeds itself. The stub is pure logic; the real
router's streams are tested against real workers elsewhere."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from protocol.messages import Finished
from protocol.sampling import Sampling
from supervisor.config import Settings
from supervisor.gateway.anthropic_shape import MessageShaper
from supervisor.gateway.app import build_app
from supervisor.gateway.call import Calls
from supervisor.gateway.metrics import Metrics
from supervisor.gateway.openai_api import parse_chat
from supervisor.gateway.openai_shape import Shaper
from supervisor.gateway.responses_shape import ResponseShaper
from supervisor.gateway.transcript import Transcript
from supervisor.workers import Stream

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def fin(n: int) -> Finished:
    return Finished(rid="r", text="", finish_reason="stop", prompt_tokens=1, completion_tokens=n)


class StubLease:
    def __init__(self, queued: list) -> None:
        self.worker = SimpleNamespace(spec=SimpleNamespace(id="m"))
        self.queued = queued
        self.stream: Stream | None = None
        self.aborted: list[str] = []

    def submit(self, msg: Any) -> Stream:
        """A Stream with `queued` already in it (deltas as the router puts them, then the end)."""
        self.stream = Stream(msg.rid)
        for item in self.queued:
            self.stream.queue.put_nowait(item)
        return self.stream

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    def release(self) -> None:
        pass


class StubRouter:
    """What Call, Calls and the generation routes use of the router."""

    def __init__(self, queued: list) -> None:
        self.lease = StubLease(queued)
        spec = SimpleNamespace(id="m", sampling=Sampling(), model_sampling=Sampling())  # no defaults: the server's
        self.registry = SimpleNamespace(resolve=lambda name: spec, specs={"m": None})
        self.metrics = Metrics()

    async def acquire(self, name: str, explicit: bool = False) -> StubLease:
        return self.lease

    async def acquire_many(self, name: str, count: int) -> list[StubLease]:
        return [self.lease] * count

    def loading(self, name: str) -> None:
        return None

    def suspension(self, rid: str) -> None:
        return None


async def started(queued: list) -> tuple[Calls, StubRouter]:
    router = StubRouter(queued)
    calls = Calls(router, parse_chat({**CHAT, "stream": True}), "/v1/chat/completions")  # type: ignore[arg-type]
    await calls.start()
    return calls, router


def counting_tasks() -> Callable[[], int]:
    """Count the tasks the running loop creates from now on."""
    loop = asyncio.get_running_loop()
    made = 0

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kw: Any) -> asyncio.Task:
        nonlocal made
        made += 1
        return asyncio.Task(coro, loop=loop, **kw)

    loop.set_task_factory(factory)
    return lambda: made


async def stream_tokens(n: int, keepalive_s: float) -> tuple[int, int]:
    """Stream n tokens through a Call, each put only once the Call waits for it (a real stream's case):
    (tasks created meanwhile, events read)."""
    calls, router = await started([("t", 1, None)])
    stream = router.lease.stream
    assert stream is not None
    loop = asyncio.get_running_loop()
    tasks = counting_tasks()
    read = 0
    try:
        async for _, item in calls.events(keepalive_s):
            read += 1
            if isinstance(item, Finished):
                break
            # the next token comes after this turn, when the Call already waits on its queue
            loop.call_soon(stream.put, "t", [read]) if read < n else loop.call_soon(stream.queue.put_nowait, fin(n))
        return tasks(), read
    finally:
        loop.set_task_factory(None)
        calls.close()


def test_streaming_tokens_with_a_keepalive_creates_no_task_per_token() -> None:
    few, read_few = asyncio.run(stream_tokens(50, keepalive_s=30))
    many, read_many = asyncio.run(stream_tokens(2000, keepalive_s=30))
    assert (read_few, read_many) == (51, 2001)  # every token one event: none was queued behind another
    assert many == few <= 1


def test_the_keepalive_fires_after_many_waits_and_the_event_is_not_lost() -> None:
    async def main() -> list:
        calls, router = await started([("a", 1, None)])
        stream = router.lease.stream
        assert stream is not None
        loop = asyncio.get_running_loop()
        call = calls.calls[0]
        try:
            for i in range(200):  # many waits, each moving the one keep-alive timer on
                loop.call_soon(stream.put, "t", [i])
                assert await call.next_within(0.05) == ("t", 1, None)
            quiet = await call.next_within(0.05)  # nothing comes: the timer, moved on, fires
            loop.call_soon(stream.put, "late", [0])
            late = await call.next_within(0.05)
            return [quiet, late]
        finally:
            calls.close()

    assert asyncio.run(main()) == [None, ("late", 1, None)]


def test_deltas_queued_together_are_read_as_one() -> None:
    queued = [("Hel", 1, None), ("lo", 1, None), (" you", 1, {"logprobs": [["x", -1.0, []]]}),
              ("", 1, {"reasoning": "hm"}),  # reasoning after text cannot join it ...
              ("!", 1, None),  # ... but text after that reasoning can
              ("", 1, {"calls": [[0, "c1", "f", "{"]]}), ("", 1, {"calls": [[0, "", "", "}"]]}),
              ("\n", 1, None),  # whitespace-only text: held back by the shapers, never merged
              fin(8)]

    async def main() -> list:
        calls, _ = await started(queued)
        try:
            return [item async for _, item in calls.events(30)]
        finally:
            calls.close()

    got = asyncio.run(main())
    assert got[:3] == [("Hello you", 3, {"logprobs": [["x", -1.0, []]]}),
                       ("!", 4, {"reasoning": "hm", "calls": [[0, "c1", "f", "{}"]]}), ("\n", 1, None)]
    assert isinstance(got[3], Finished) and len(got) == 4

    async def apart() -> list:  # an extra a merge does not know stays alone: nothing of it is lost
        calls, _ = await started([("x", 1, {"future": 1}), ("", 1, {"logprobs": [["x", -1.0, []]]}), fin(2)])
        try:
            return [item async for _, item in calls.events(30)]
        finally:
            calls.close()

    assert asyncio.run(apart())[:2] == [("x", 1, {"future": 1}), ("", 1, {"logprobs": [["x", -1.0, []]]})]


DELTAS = [("word", None), (" ", None), ("\n\n", None), ("", {"reasoning": "think"}),
          ("", {"calls": [[0, "CALL", "f", '{"a": ']]}), ("", {"calls": [[0, "", "", "1"]]}),
          ("", {"calls": [[0, "", "", "}"]]}), ("x", {"reasoning": "r"}), ("", {"logprobs": [["t", -0.5, []]]})]


def test_merged_deltas_say_what_the_deltas_say_one_by_one_in_every_api() -> None:
    rng = random.Random(7)
    ids = itertools.count()

    def answer() -> list[tuple[str, int, dict | None]]:
        out = []
        for text, extra in (rng.choice(DELTAS) for _ in range(rng.randint(1, 30))):
            if extra and "calls" in extra and extra["calls"][0][1]:  # each call its own id
                extra = {"calls": [[0, f"call_{next(ids)}", "f", extra["calls"][0][3]]]}
            out.append((text, 1, extra))
        return out

    def said(deltas: list) -> list:
        anthropic, responses, chat = MessageShaper("m", "m"), ResponseShaper("r", "m", {}), Transcript()
        for text, _, extra in deltas:
            anthropic.feed(text, extra)
            responses.feed(text, extra)
            chat.feed(text, extra)
        shaper = Shaper(parse_chat({**CHAT, "logprobs": True}), "m")
        whole = responses.whole(fin(len(deltas)))
        return [anthropic.whole(fin(len(deltas)))["content"], [{**i, "id": ""} for i in whole["output"]],
                shaper.whole([chat], [fin(len(deltas))])["choices"]]

    async def read(deltas: list) -> list:
        calls, _ = await started([*deltas, fin(len(deltas))])
        try:
            return [item async for _, item in calls.events(30) if not isinstance(item, Finished)]
        finally:
            calls.close()

    merges = 0
    for _ in range(300):
        deltas = answer()
        merged = asyncio.run(read(deltas))
        merges += len(deltas) - len(merged)
        assert sum(d[1] for d in merged) == len(deltas)
        assert said(merged) == said(deltas), deltas
    assert merges > 1000  # the answers did merge (and said the same)


async def asgi(app: Any, path: str, body: dict) -> list[bytes]:
    """One request through the app; the bodies it wrote, one entry a write."""
    raw = json.dumps(body).encode()
    headers = [(b"host", b"127.0.0.1:8800"), (b"content-type", b"application/json"),
               (b"content-length", str(len(raw)).encode())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8800)}
    stays = asyncio.Event()
    first = True
    writes: list[bytes] = []

    async def receive() -> dict:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": raw, "more_body": False}
        await stays.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            writes.append(message["body"])

    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return writes


def on_the_wire(path: str, body: dict) -> list[bytes]:
    words = [(f"w{i} ", 1, None) for i in range(12)]

    async def main() -> list[bytes]:
        return await asgi(build_app(StubRouter([*words, fin(12)]), Settings()), path, body)  # type: ignore[arg-type]

    return asyncio.run(main())


def test_deltas_queued_together_are_one_write_of_one_event() -> None:
    chat_writes = on_the_wire("/v1/chat/completions", {**CHAT, "stream": True})
    said = [w for w in chat_writes if b"w0 " in w]
    assert len(said) == 1 and said[0].count(b"data: ") == 1
    assert json.loads(said[0][6:])["choices"][0]["delta"]["content"] == "".join(f"w{i} " for i in range(12))

    messages = on_the_wire("/v1/messages", {**CHAT, "max_tokens": 50, "stream": True})
    said = [w for w in messages if b"w0 " in w]
    assert len(said) == 1 and said[0].count(b"text_delta") == 1  # the block's start and its one delta: one write
    assert len(messages) == 3  # the opening, the answer, the end


class ManyStreamsLease(StubLease):
    """A lease whose every submit (one per choice) gets a Stream of its own, kept in order."""

    def __init__(self, queued: list) -> None:
        super().__init__(queued)
        self.streams: list[Stream] = []

    def submit(self, msg: Any) -> Stream:
        self.streams.append(super().submit(msg))
        return self.streams[-1]


async def stream_choices(n: int, keepalive_s: float) -> tuple[int, list[int]]:
    """Stream n tokens through each of two choices, each token put only once the request waits for it:
    (tasks created meanwhile, events read per choice)."""
    router = StubRouter([("t", 1, None)])
    lease = router.lease = ManyStreamsLease([("t", 1, None)])
    calls = Calls(router, parse_chat({**CHAT, "stream": True, "n": 2}), "/v1/chat/completions")  # type: ignore[arg-type]
    await calls.start()
    loop = asyncio.get_running_loop()
    tasks = counting_tasks()
    read = [0, 0]
    try:
        async for i, item in calls.events(keepalive_s):
            assert i in (0, 1), "no keep-alive: a token always comes within it"
            read[i] += 1
            if not isinstance(item, Finished):
                stream = lease.streams[i]
                if read[i] < n:
                    loop.call_soon(stream.put, "t", [read[i]])
                else:
                    loop.call_soon(stream.queue.put_nowait, fin(n))
        return tasks(), read
    finally:
        loop.set_task_factory(None)
        calls.close()


def test_several_choices_stream_with_one_waiter_and_no_task_per_token() -> None:
    few, read_few = asyncio.run(stream_choices(50, keepalive_s=30))
    many, read_many = asyncio.run(stream_choices(1000, keepalive_s=30))
    assert read_few == [51, 51] and read_many == [1001, 1001]
    assert many == few <= 1


def test_several_choices_get_a_keepalive_when_none_speaks() -> None:
    async def main() -> list:
        router = StubRouter([])
        lease = router.lease = ManyStreamsLease([("t", 1, None)])
        calls = Calls(router, parse_chat({**CHAT, "stream": True, "n": 2}), "/v1/chat/completions")  # type: ignore[arg-type]
        await calls.start()
        seen: list = []
        try:
            async for i, item in calls.events(0.05):
                seen.append((i, item))
                if i == -1:  # quiet: both finish now
                    for stream in lease.streams:
                        stream.queue.put_nowait(fin(1))
                if sum(isinstance(x, Finished) for _, x in seen) == 2:
                    break
            return seen
        finally:
            calls.close()

    seen = asyncio.run(main())
    assert seen[:3] == [(0, ("t", 1, None)), (1, ("t", 1, None)), (-1, None)]
    assert sorted(i for i, x in seen[3:]) == [0, 1] and all(isinstance(x, Finished) for _, x in seen[3:])
