"""Streams that wait before their first token (issue 47, "slow machines lose no work": clients are kept waiting, not
made to retry). Every keep-alive, each API's stream carries an event that API defines and its clients count as
activity (a chat or completion chunk that says nothing, the Responses API's `response.in_progress`, Anthropic's
`ping`), beside an SSE comment saying truly what the request waits for; the official clients still read the
whole stream and its text.

In process: the real gateway (build_app) through ASGI on test_call.py's stub router, its acquire held while the
model's worker "loads", then its Stream fed by the test once the worker "prefilled": each phase ends on writes
seen on the wire, never on a sleep. The same with a real worker's slow prefill: tests/integration/test_keepalive.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from protocol.messages import Progress
from supervisor import errors
from supervisor.config import Settings
from supervisor.gateway.app import build_app
from supervisor.gateway.call import Calls
from supervisor.gateway.openai_api import parse_chat
from supervisor.gateway.waits import Waits
from supervisor.resume import Suspension
from supervisor.workers import State
from tests.unit.test_call import CHAT, ManyStreamsLease, StubLease, StubRouter, fin

KEEPALIVE_S = 0.01
LIMIT_S = 10  # only so that a broken stream fails instead of hanging
WAITED = 3  # keep-alives each phase (the load, the prefill) lasts at least
TEXTS = ["Once", " upon", " a time"]


class Held(StubRouter):
    """A router whose acquire waits for `routed` (the model's worker loads meanwhile, as `workers` shows)."""

    def __init__(self, lease: StubLease | None = None) -> None:
        super().__init__([])
        if lease is not None:
            self.lease = lease
        self.lease.worker.heartbeat = None  # type: ignore[attr-defined]
        self.workers: dict[str, Any] = {}
        self.slots: dict[str, Any] = {}
        self.clock = SimpleNamespace(monotonic=time.monotonic)
        self.suspensions: dict[str, Suspension] = {}
        self.routed = asyncio.Event()
        self.choices = 1  # the streams a request submits

    async def acquire(self, name: str, explicit: bool = False) -> StubLease:
        await self.routed.wait()
        return self.lease

    def suspension(self, rid: str) -> Suspension | None:  # type: ignore[override]
        return self.suspensions.get(rid)

    def streams(self) -> list:
        lease = self.lease
        return list(lease.streams) if isinstance(lease, ManyStreamsLease) else [s for s in [lease.stream] if s]


def worker(state: State, model: str = "m") -> SimpleNamespace:
    return SimpleNamespace(spec=SimpleNamespace(id=model), state=state, progress=Progress("weights", 0.5))


class Wire:
    """What a response wrote, and a way to wait until its writes say something."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.status: int | None = None
        self._wrote = asyncio.Event()

    def add(self, body: bytes) -> None:
        self.writes.append(body)
        self._wrote.set()
        self._wrote = asyncio.Event()

    async def until(self, predicate: Callable[[], bool]) -> None:
        async with asyncio.timeout(LIMIT_S):
            while not predicate():
                await self._wrote.wait()

    def count(self, marker: bytes) -> int:
        """The writes that say `marker` (a keep-alive is one write)."""
        return sum(marker in w for w in self.writes)


async def serve(router: Held, path: str, body: dict, drive: Callable[[Wire], Awaitable[None]]) -> Wire:
    """One request through the app while `drive` moves the router's state on: the response's status and writes."""
    app = build_app(router, Settings(sse_keepalive_s=KEEPALIVE_S))  # type: ignore[arg-type]
    raw = json.dumps(body).encode()
    headers = [(b"host", b"127.0.0.1:8800"), (b"content-type", b"application/json"),
               (b"content-length", str(len(raw)).encode())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8800)}
    wire, stays, sent = Wire(), asyncio.Event(), False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await stays.wait()  # the client stays to the end
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            wire.status = message["status"]
        elif message.get("body"):
            wire.add(message["body"])

    serving = asyncio.create_task(app(scope, receive, send))
    try:
        await drive(wire)
        await asyncio.wait_for(serving, LIMIT_S)
    finally:
        serving.cancel()
    return wire


def load_then_prefill(router: Held, marker: bytes, texts: list[str] = TEXTS) -> Callable[[Wire], Awaitable[None]]:
    """The request waits WAITED keep-alives (each one `marker`) for its model's load, WAITED more for its prefill on
    the loaded worker (busy: the worker's heartbeat counts 3 requests not yet decoding), then gets `texts`."""
    async def drive(wire: Wire) -> None:
        router.workers["m"] = worker(State.LOADING)
        await wire.until(lambda: wire.count(marker) >= WAITED)
        router.workers["m"].state = State.READY
        router.lease.worker.heartbeat = SimpleNamespace(waiting=3)  # type: ignore[attr-defined]
        router.routed.set()
        loaded = wire.count(marker)
        await wire.until(lambda: wire.count(marker) >= loaded + WAITED and len(router.streams()) == router.choices)
        for stream in router.streams():
            for text in texts:
                stream.put(text, [0], None)
            stream.queue.put_nowait(fin(len(texts)))

    return drive


def blocks(raw: bytes) -> list[tuple[str, Any]]:
    """The SSE stream's blocks in order: ("comment", text), or (event name or "data", the data parsed)."""
    out: list[tuple[str, Any]] = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        if block.startswith(":"):
            out.append(("comment", block[1:].strip()))
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        data = fields["data"]
        out.append((fields.get("event", "data"), data if data == "[DONE]" else json.loads(data)))
    return out


def before_first_text(said: list[tuple[str, Any]], is_text: Callable[[str, Any], bool]) -> list[tuple[str, Any]]:
    return said[:next(i for i, (kind, data) in enumerate(said) if is_text(kind, data))]


def replayed(raw: bytes, http: Any = httpx) -> Any:
    """An HTTP client that answers any request with this stream (for the official clients to parse it whole);
    `http`: the client's HTTP package (the anthropic SDK's is httpx2)."""
    return http.Client(transport=http.MockTransport(
        lambda request: http.Response(200, headers={"content-type": "text/event-stream"}, content=raw)))


def assert_truthful(comments: list[str]) -> None:
    """The load's comments say it loads, the prefill's that it waits for its first token; nothing waits for memory."""
    assert comments[0] == "loading m: weights 50%"
    assert comments[-1] == "waiting for the first token of m: prefilling or queued with 2 other request(s) not yet decoding"
    assert not [c for c in comments if "memory" in c or "room" in c]


def test_a_chat_stream_that_waits_gets_a_chunk_every_keepalive_and_its_role_once() -> None:
    router = Held()
    wire = asyncio.run(serve(router, "/v1/chat/completions",
                             {**CHAT, "stream": True, "stream_options": {"include_usage": True}},
                             load_then_prefill(router, b"chat.completion.chunk")))
    assert wire.status == 200
    said = blocks(b"".join(wire.writes))
    waited = before_first_text(said, lambda kind, data: kind == "data" and bool(data["choices"])
                               and data["choices"][0]["delta"].get("content"))
    chunks = [data for kind, data in waited if kind == "data"]
    assert len(chunks) >= 2 * WAITED  # an event the chat API defines, every keep-alive: Qwen Code counts chunks
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]  # the first chunk says the role, as OpenAI's does
    assert all(c["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}] for c in chunks[1:])
    assert_truthful([data for kind, data in waited if kind == "comment"])
    every = [data for kind, data in said if kind == "data" and data != "[DONE]"]
    assert {c["id"] for c in every} == {every[0]["id"]} and {c["created"] for c in every} == {every[0]["created"]}
    assert sum("role" in c["choices"][0]["delta"] for c in every if c["choices"]) == 1  # said once, never repeated
    assert every[-1]["usage"]["completion_tokens"] == len(TEXTS)

    client = openai.OpenAI(base_url="http://m/v1", api_key="x", max_retries=0, http_client=replayed(b"".join(wire.writes)))
    got = list(client.chat.completions.create(model="m", messages=CHAT["messages"], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in got if c.choices) == "".join(TEXTS)
    with client.chat.completions.stream(model="m", messages=CHAT["messages"]) as stream:  # the accumulating helper
        message = stream.get_final_completion().choices[0].message
    assert message.role == "assistant" and message.content == "".join(TEXTS)


def test_each_of_several_chat_choices_gets_its_keepalive_chunks_and_its_role_once() -> None:
    router = Held(ManyStreamsLease([]))
    router.choices = 2
    wire = asyncio.run(serve(router, "/v1/chat/completions", {**CHAT, "stream": True, "n": 2},
                             load_then_prefill(router, b"chat.completion.chunk")))
    said = [data for kind, data in blocks(b"".join(wire.writes)) if kind == "data" and data != "[DONE]"]
    for index in (0, 1):
        mine = [c["choices"][0] for c in said if c["choices"][0]["index"] == index]
        first_text = next(i for i, c in enumerate(mine) if c["delta"].get("content"))
        assert first_text >= 2 * WAITED and mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert sum("role" in c["delta"] for c in mine) == 1
    client = openai.OpenAI(base_url="http://m/v1", api_key="x", max_retries=0, http_client=replayed(b"".join(wire.writes)))
    texts = ["", ""]
    for chunk in client.chat.completions.create(model="m", messages=CHAT["messages"], stream=True, n=2):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == ["".join(TEXTS)] * 2


def test_a_completion_stream_that_waits_gets_an_empty_text_chunk_every_keepalive() -> None:
    router = Held()
    wire = asyncio.run(serve(router, "/v1/completions", {"model": "m", "prompt": "hi", "stream": True},
                             load_then_prefill(router, b"text_completion")))
    assert wire.status == 200
    said = blocks(b"".join(wire.writes))
    waited = before_first_text(said, lambda kind, data: kind == "data" and bool(data["choices"][0]["text"]))
    chunks = [data for kind, data in waited if kind == "data"]
    assert len(chunks) >= 2 * WAITED
    assert all(c["object"] == "text_completion" and c["choices"] == [
        {"index": 0, "text": "", "logprobs": None, "finish_reason": None}] for c in chunks)
    assert_truthful([data for kind, data in waited if kind == "comment"])
    client = openai.OpenAI(base_url="http://m/v1", api_key="x", max_retries=0, http_client=replayed(b"".join(wire.writes)))
    got = list(client.completions.create(model="m", prompt="hi", stream=True))
    assert "".join(c.choices[0].text for c in got if c.choices) == "".join(TEXTS)


def test_a_responses_stream_that_waits_gets_response_in_progress_every_keepalive_in_sequence() -> None:
    router = Held()
    wire = asyncio.run(serve(router, "/v1/responses", {"model": "m", "input": "hi", "stream": True},
                             load_then_prefill(router, b"event: response.in_progress")))
    assert wire.status == 200
    said = blocks(b"".join(wire.writes))
    events = [(kind, data) for kind, data in said if kind != "comment"]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))  # the keep-alives' too
    waited = before_first_text(said, lambda kind, data: kind == "response.output_text.delta")
    kinds = [kind for kind, _ in waited if kind != "comment"]
    assert kinds[0] == "response.created" and kinds.count("response.in_progress") >= 2 * WAITED  # the opening's, then each
    # keep-alive's: Codex counts events, not comments
    assert set(kinds[1:]) <= {"response.in_progress", "response.output_item.added", "response.content_part.added"}
    progress = [data["response"] for kind, data in waited if kind == "response.in_progress"]
    assert {(r["id"], r["status"]) for r in progress} == {(said[0][1]["response"]["id"], "in_progress")}
    assert_truthful([data for kind, data in waited if kind == "comment"])
    assert events[-1][0] == "response.completed"

    client = openai.OpenAI(base_url="http://m/v1", api_key="x", max_retries=0, http_client=replayed(b"".join(wire.writes)))
    typed = list(client.responses.create(model="m", input="hi", stream=True))
    assert [e.type for e in typed] == [kind for kind, _ in events]
    with client.responses.stream(model="m", input="hi") as stream:  # the accumulating helper
        assert stream.get_final_response().output_text == "".join(TEXTS)


def test_a_messages_stream_that_waits_gets_a_ping_every_keepalive_before_its_first_token() -> None:
    router = Held()
    wire = asyncio.run(serve(router, "/v1/messages", {**CHAT, "max_tokens": 50, "stream": True},
                             load_then_prefill(router, b"event: ping")))
    assert wire.status == 200
    said = blocks(b"".join(wire.writes))
    waited = before_first_text(said, lambda kind, data: kind == "content_block_delta")
    kinds = [kind for kind, _ in waited if kind != "comment"]
    assert kinds[0] == "message_start" and kinds.count("ping") >= 2 * WAITED  # the opening's, then each keep-alive
    assert set(kinds[1:]) <= {"ping", "content_block_start"}
    assert_truthful([data for kind, data in waited if kind == "comment"])

    client = anthropic.Anthropic(base_url="http://m", api_key="x", max_retries=0, http_client=replayed(b"".join(wire.writes), httpx2))
    with client.messages.stream(model="m", max_tokens=50, messages=CHAT["messages"]) as stream:
        assert stream.get_final_text() == "".join(TEXTS)


REFUSAL = {"/v1/chat/completions": {**CHAT, "stream": True}, "/v1/completions": {"model": "m", "prompt": "hi", "stream": True},
           "/v1/responses": {"model": "m", "input": "hi", "stream": True},
           "/v1/messages": {**CHAT, "max_tokens": 50, "stream": True}}


@pytest.mark.parametrize("path", list(REFUSAL))
def test_an_admission_refusal_within_the_first_keepalive_is_still_http_507(path: str) -> None:
    class Refused(Held):
        async def acquire(self, name: str, explicit: bool = False) -> StubLease:
            raise errors.InsufficientMemory("cannot load 'm': 100 MiB are missing")

    async def nothing(wire: Wire) -> None:
        pass

    wire = asyncio.run(serve(Refused(), path, REFUSAL[path], nothing))
    assert wire.status == 507 and b"100 MiB are missing" in b"".join(wire.writes)


# --- what the keep-alive's comment says, in each state of the router ----------------------------------------


def waits_in(router: Held, choices: int = 1) -> tuple[Waits, Calls]:
    calls = Calls(router, parse_chat({**CHAT, "stream": True, "n": choices}), "/v1/chat/completions")  # type: ignore[arg-type]
    return Waits(router, calls), calls


def test_the_comment_says_what_the_request_waits_for_and_no_more() -> None:
    router = Held()
    waits, calls = waits_in(router)
    call = calls.calls[0]
    assert waits.waiting() == b": waiting to load m\n\n"  # not routed, no worker yet: nothing waits for memory
    router.workers["m"] = worker(State.LOADING)
    assert waits.waiting() == b": loading m: weights 50%\n\n"
    router.workers["m"].state = State.EVICTING
    assert waits.waiting() == b": waiting for m's last worker to exit\n\n"
    router.workers = {"other": worker(State.EVICTING, "other"), "third": worker(State.FAILED, "third")}
    assert waits.waiting() == b": waiting for room to load m: other, third exiting\n\n"  # admission waits for them
    router.workers = {}
    router.slots["m"] = SimpleNamespace(backoff_until=time.monotonic() + 5.4)
    assert waits.waiting() == b": waiting 5s to restart m after a crash\n\n"

    call.lease = router.lease  # type: ignore[assignment]
    assert waits.waiting() == b": waiting for the first token of m: prefilling\n\n"  # no heartbeat yet
    router.lease.worker.heartbeat = SimpleNamespace(waiting=1)  # type: ignore[attr-defined]
    assert waits.waiting() == b": waiting for the first token of m: prefilling\n\n"  # only this one not decoding
    router.lease.worker.heartbeat = SimpleNamespace(waiting=5)  # type: ignore[attr-defined]
    assert waits.waiting() == b": waiting for the first token of m: prefilling or queued with 4 other request(s) " \
                              b"not yet decoding\n\n"
    call.first = ("a", 1, None)
    assert waits.waiting() == b"" and waits.idle() == b""  # it started: a slow step says nothing more

    router.suspensions[call.submit.rid] = SimpleNamespace(cause="crash", since=time.monotonic() - 3.2)  # type: ignore[assignment]
    assert waits.idle() == waits.waiting() == b": resuming m: its worker crashed; paused 3s\n\n"


def test_a_started_chat_stream_that_waits_for_its_resume_gets_chunks_and_the_resume_comment() -> None:
    router = Held()
    router.routed.set()

    async def drive(wire: Wire) -> None:
        await wire.until(lambda: router.lease.stream is not None)
        stream = router.lease.stream
        assert stream is not None
        stream.put("Once", [0], None)
        await wire.until(lambda: b"Once" in b"".join(wire.writes))
        router.suspensions[stream.rid] = SimpleNamespace(cause="hang", since=time.monotonic())  # type: ignore[assignment]
        await wire.until(lambda: wire.count(b": resuming m: its worker hung") >= WAITED)
        router.suspensions.clear()
        stream.queue.put_nowait(fin(1))

    wire = asyncio.run(serve(router, "/v1/chat/completions", {**CHAT, "stream": True}, drive))
    said = blocks(b"".join(wire.writes))
    after = said[next(i for i, (k, d) in enumerate(said) if k == "data" and "Once" in json.dumps(d)) + 1:]
    resumed = [i for i, (k, d) in enumerate(after) if k == "comment" and d.startswith("resuming m: its worker hung")]
    assert len(resumed) >= WAITED and all(after[i + 1][1]["choices"][0]["delta"] == {} for i in resumed)
