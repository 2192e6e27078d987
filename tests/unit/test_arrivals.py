"""supervisor/gateway/arrivals.py: a Submit says how many generation requests for its model are still between
their body read and their submit, through a real Starlette app and HTTP client (httpx over ASGI), and through the
real gateway (build_app) on a stub router."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from types import SimpleNamespace

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from protocol.messages import Finished, Submit
from protocol.sampling import Sampling
from supervisor.config import Settings
from supervisor.gateway.app import build_app
from supervisor.gateway.arrivals import Arrivals, expect, still_coming
from supervisor.gateway.metrics import Metrics
from supervisor.workers import Stream


def test_each_submit_counts_the_generation_requests_still_behind_it() -> None:
    gates = {"a": asyncio.Event(), "b": asyncio.Event(), "c": asyncio.Event()}
    entered = asyncio.Queue()

    async def chat(request: Request) -> JSONResponse:
        rid = (await request.json())["rid"]
        expect("m")  # read whole, on its way to model m (as a Call says it)
        expect("m")  # its second choice: counted once
        await entered.put(rid)
        await gates[rid].wait()
        if rid == "c":  # a request that fails before its submit leaves the count as it ends
            return JSONResponse({"error": "bad"}, status_code=400)
        return JSONResponse({"more": await still_coming("m"), "again": await still_coming("m")})

    async def embeddings(request: Request) -> JSONResponse:
        return JSONResponse({"more": await still_coming("m")})

    app = Arrivals(Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                                     Route("/v1/embeddings", embeddings, methods=["POST"])]))

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            post = lambda rid: asyncio.create_task(client.post("/v1/chat/completions", json={"rid": rid}))  # noqa: E731
            tasks = {rid: post(rid) for rid in ("a", "b", "c")}
            assert {await entered.get() for _ in range(3)} == {"a", "b", "c"}
            assert app.coming == {"m": 3}
            gates["a"].set()
            assert (await tasks["a"]).json() == {"more": 2, "again": 2}  # b and c behind it; counted once
            gates["c"].set()
            assert (await tasks["c"]).status_code == 400
            assert app.coming == {"m": 1}
            gates["b"].set()
            assert (await tasks["b"]).json() == {"more": 0, "again": 0}
            assert (await client.post("/v1/embeddings", json={})).json() == {"more": 0}  # not a generation
            assert not app.coming

    asyncio.run(main())


class Lease:
    def __init__(self, router: Router, model: str) -> None:
        self.router = router
        self.worker = SimpleNamespace(spec=SimpleNamespace(id=model))

    def submit(self, msg: Submit) -> Stream:
        self.router.submitted.append((self.worker.spec.id, msg.more))
        stream = Stream(msg.rid)
        stream.queue.put_nowait(Finished(rid=msg.rid, text="", finish_reason="stop", prompt_tokens=1,
                                         completion_tokens=0))
        return stream

    def abort(self, rid: str) -> None:
        pass

    def release(self) -> None:
        pass


class Router:
    """What the generation routes use of the router, for models `a` (ready) and `b` (loading until `loaded`)."""

    def __init__(self) -> None:
        self.registry = SimpleNamespace(resolve=lambda name: SimpleNamespace(id=name, sampling=Sampling(),
                                        model_sampling=Sampling()), specs={"a": None, "b": None})
        self.metrics = Metrics()
        self.loaded = asyncio.Event()
        self.submitted: list[tuple[str, int]] = []

    async def acquire(self, name: str, explicit: bool = False) -> Lease:
        if name == "b":
            await self.loaded.wait()
        return Lease(self, name)

    def loading(self, name: str) -> None:
        return None

    def suspension(self, rid: str) -> None:
        return None


def request(model: str, upload: asyncio.Event | None = None) -> tuple[dict, Callable[[], Awaitable[dict]]]:
    """An ASGI chat request for `model`; with `upload`, its body stops half way until `upload` is set."""
    raw = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()
    headers = [(b"host", b"127.0.0.1:8800"), (b"content-type", b"application/json"),
               (b"content-length", str(len(raw)).encode())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "headers": headers, "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8800)}
    parts = [raw[:10], raw[10:]] if upload is not None else [raw]
    never = asyncio.Event()

    async def receive() -> dict:
        if not parts:
            await never.wait()  # the client stays: no disconnect
        if upload is not None and len(parts) == 1:
            await upload.wait()  # the upload stalls here
        return {"type": "http.request", "body": parts.pop(0), "more_body": len(parts) > 0}

    return scope, receive


async def answered(app: ASGIApp, scope: dict, receive: Callable[[], Awaitable[dict]]) -> int:
    status = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app(scope, receive, send)
    return status[0]


def test_a_submit_counts_only_requests_read_whole_and_on_their_way_to_its_model() -> None:
    """Catches: Submit.more counting every generation request from its arrival, for any model: a stalled upload
    and a request waiting on another model's load made every idle worker wait out its burst window."""

    async def main() -> None:
        router = Router()
        app = build_app(router, Settings())  # type: ignore[arg-type]
        upload = asyncio.Event()
        stalled = asyncio.create_task(answered(app, *request("a", upload)))
        waiting = asyncio.create_task(answered(app, *request("b")))
        for _ in range(20):
            await asyncio.sleep(0)
        assert router.submitted == [] and not stalled.done() and not waiting.done()

        assert await answered(app, *request("a")) == 200
        assert router.submitted == [("a", 0)]  # neither the upload nor b's request is coming to a's worker

        together = [asyncio.create_task(answered(app, *request("a"))) for _ in range(3)]
        assert await asyncio.gather(*together) == [200, 200, 200]
        assert router.submitted[1:] == [("a", 2), ("a", 1), ("a", 0)]  # a burst for a's worker is still told

        upload.set()
        router.loaded.set()
        assert await stalled == 200 and await waiting == 200
        assert sorted(router.submitted[4:]) == [("a", 0), ("b", 0)]

    asyncio.run(main())
