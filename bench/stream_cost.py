"""python -m bench.stream_cost [--tokens 65536] [--rounds 3] [--out FILE.json]

The gateway's own cost per token (shaping, SSE, the call plumbing), without MLX or a
worker: the real Starlette app (build_app) driven through ASGI in process, with a stub router whose
lease hands out a real `Stream` fed by a fake token source. `paced`: the source puts the next delta
only once the gateway waits for it, as when a worker's step takes longer than the gateway's work (a
real stream's case: each token read as it comes); `burst`: 16 deltas a loop turn, the gateway
behind (a slow client), where deltas queue up and may be merged into one write. Every API (chat, completions, Anthropic messages, Responses) is run
streamed and whole; a long answer: 1/8 reasoning, 3/4 text, 1/8 one tool call's arguments, one
token a delta. Reported per token: CPU time (us, the process's: the gateway runs in one thread, and
its CPU time is what other processes on a shared machine change least), tasks created, response
writes (ASGI body messages). `floor` is the source alone, read by a bare `queue.get()` loop. Runs on any revision
whose gateway has build_app and supervisor.workers.Stream, so two trees compare with the same file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from protocol.messages import Finished
from supervisor.config import Settings
from supervisor.gateway.app import build_app
from supervisor.gateway.metrics import Metrics
from supervisor.workers import Stream

MODEL = "m"
ROUTES: dict[str, tuple[str, dict]] = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}),
    "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}),
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 10**6, "store": False}),
}


def script(tokens: int) -> list[tuple[str, dict | None]]:
    """The answer's deltas, one token each: reasoning, text, then one call's arguments in pieces."""
    reasoning, call = tokens // 8, tokens // 8
    deltas: list[tuple[str, dict | None]] = [("", {"reasoning": "hmm "})] * reasoning
    deltas += [("word ", None)] * (tokens - reasoning - call)
    deltas.append(("", {"calls": [[0, "call_1", "f", '{"a": "']]}))
    deltas += [("", {"calls": [[0, "", "", "xy"]]})] * (call - 2)
    deltas.append(("", {"calls": [[0, "", "", '"}']]}))
    return deltas


async def feed(stream: Stream, deltas: list[tuple[str, dict | None]], burst: int) -> None:
    for i, (text, extra) in enumerate(deltas):
        stream.put(text, [i], extra)
        if burst == 0:  # paced: the next delta once the reader waits on the queue (asyncio.Queue's getters)
            while not stream.queue._getters:  # type: ignore[attr-defined]  # noqa: ASYNC110 (no event to wait on)
                await asyncio.sleep(0)
        elif i % burst == burst - 1:
            await asyncio.sleep(0)
    stream.queue.put_nowait(Finished(rid=stream.rid, text="", finish_reason="tool_calls", prompt_tokens=2,
                                     completion_tokens=len(deltas)))


class StubLease:
    def __init__(self, deltas: list[tuple[str, dict | None]], burst: int) -> None:
        self.worker = SimpleNamespace(spec=SimpleNamespace(id=MODEL))
        self.deltas = deltas
        self.burst = burst
        self.source: asyncio.Task | None = None

    def submit(self, msg: Any) -> Stream:
        stream = Stream(msg.rid)
        self.source = asyncio.create_task(feed(stream, self.deltas, self.burst), name="fake-source")
        return stream

    def abort(self, rid: str) -> None:
        pass

    def release(self) -> None:
        pass


class StubRouter:
    """What the gateway's generation routes use of the router."""

    def __init__(self, deltas: list[tuple[str, dict | None]], burst: int) -> None:
        self.deltas = deltas
        self.burst = burst
        self.registry = SimpleNamespace(resolve=lambda name: SimpleNamespace(id=MODEL, sampling={}, model_sampling={}),
                                        specs={MODEL: None})
        self.metrics = Metrics()
        self.clock = SimpleNamespace(monotonic=time.monotonic)

    async def acquire(self, name: str, explicit: bool = False) -> StubLease:
        return StubLease(self.deltas, self.burst)

    def loading(self, name: str) -> None:
        return None

    def suspension(self, rid: str) -> None:
        return None


def _scope(path: str, body: bytes) -> dict:
    headers = [(b"host", b"127.0.0.1:8800"), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), (b"anthropic-version", b"2023-06-01")]
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
            "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8800)}


async def one(api: str, stream: bool, deltas: list[tuple[str, dict | None]], burst: int) -> dict:
    """One request through the app: us per token, tasks and writes per token, the response checked whole."""
    path, body = ROUTES[api]
    raw = json.dumps({"model": MODEL, "stream": stream, **body}).encode()
    app: Any = build_app(StubRouter(deltas, burst), Settings())  # type: ignore[arg-type]
    stays = asyncio.Event()  # the client never leaves
    received = False
    out: list[bytes] = []
    writes = 0

    async def receive() -> dict:
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await stays.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal writes
        if message["type"] == "http.response.body" and message.get("body"):
            writes += 1
            out.append(message["body"])

    loop = asyncio.get_running_loop()
    tasks = 0
    default = loop.get_task_factory()

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kw: Any) -> asyncio.Future:
        nonlocal tasks
        tasks += 1
        return default(loop, coro, **kw) if default else asyncio.Task(coro, loop=loop, **kw)

    loop.set_task_factory(counting)
    t0 = time.process_time()
    try:
        await app(_scope(path, raw), receive, send)
    finally:
        elapsed = time.process_time() - t0
        loop.set_task_factory(default)
    _check(api, stream, b"".join(out), len(deltas))
    n = len(deltas)
    return {"us_per_token": elapsed / n * 1e6, "tasks_per_token": tasks / n, "writes_per_token": writes / n}


def _check(api: str, stream: bool, body: bytes, tokens: int) -> None:
    """The answer arrived whole (a bench of a broken path measures nothing)."""
    text = body.decode()
    ends = {"chat": "[DONE]", "completions": "[DONE]", "messages": "message_stop", "responses": "response.completed"}
    if stream:
        assert ends[api] in text, (api, text[-500:])
        return
    whole = json.loads(text)
    said = {"chat": lambda w: w["choices"][0]["message"]["content"],
            "completions": lambda w: w["choices"][0]["text"],
            "messages": lambda w: next(b["text"] for b in w["content"] if b["type"] == "text"),
            "responses": lambda w: next(i["content"][0]["text"] for i in w["output"] if i["type"] == "message")}[api]
    assert said(whole).count("word ") == tokens - 2 * (tokens // 8), (api, text[:300])


async def floor(deltas: list[tuple[str, dict | None]], burst: int) -> float:
    """The fake source alone, read by a bare loop: us per token."""
    stream = Stream("floor")
    t0 = time.process_time()
    source = asyncio.create_task(feed(stream, deltas, burst))
    while not isinstance(await stream.queue.get(), Finished):
        pass
    await source
    return (time.process_time() - t0) / len(deltas) * 1e6


MODES = {"paced": 0, "burst": 16}


async def run(tokens: int, rounds: int) -> dict:
    deltas = script(tokens)
    cells: dict[str, list[dict]] = {}
    for _ in range(rounds):
        for mode, burst in MODES.items():
            cells.setdefault(f"floor {mode}", []).append({"us_per_token": await floor(deltas, burst)})
            for api in ROUTES:
                for stream in (True, False):
                    name = f"{api} {'stream' if stream else 'whole'} {mode}"
                    cells.setdefault(name, []).append(await one(api, stream, deltas, burst))
    results = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in cells.items()}
    return {"tokens": tokens, "rounds": rounds, "results": results}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.stream_cost", description=__doc__.split("\n\n")[1])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here too")
    args = ap.parse_args()
    got = asyncio.run(run(args.tokens, args.rounds))
    print(f"{args.tokens} tokens, median of {args.rounds} (floor: the fake source alone)")
    print(f"{'':<26}{'us/token':>10}{'tasks/token':>13}{'writes/token':>14}")
    for name, r in sorted(got["results"].items(), key=lambda kv: kv[0].split()[-1]):
        print(f"{name:<26}{r['us_per_token']:>10.1f}{r.get('tasks_per_token', 0):>13.3f}"
              f"{r.get('writes_per_token', 0):>14.3f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(got, indent=1) + "\n")


if __name__ == "__main__":
    main()
