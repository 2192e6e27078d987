"""supervisor/gateway/arrivals.py: a Submit says how many generation requests are still between arrival and
submit, through a real Starlette app and HTTP client (httpx over ASGI)."""

from __future__ import annotations

import asyncio

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from supervisor.gateway.arrivals import Arrivals, still_coming


def test_each_submit_counts_the_generation_requests_still_behind_it() -> None:
    gates = {"a": asyncio.Event(), "b": asyncio.Event(), "c": asyncio.Event()}
    entered = asyncio.Queue()

    async def chat(request: Request) -> JSONResponse:
        rid = (await request.json())["rid"]
        await entered.put(rid)
        await gates[rid].wait()
        if rid == "c":  # a request that fails before its submit leaves the count as it ends
            return JSONResponse({"error": "bad"}, status_code=400)
        return JSONResponse({"more": await still_coming(), "again": await still_coming()})

    async def embeddings(request: Request) -> JSONResponse:
        return JSONResponse({"more": await still_coming()})

    app = Arrivals(Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                                     Route("/v1/embeddings", embeddings, methods=["POST"])]))

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            post = lambda rid: asyncio.create_task(client.post("/v1/chat/completions", json={"rid": rid}))  # noqa: E731
            tasks = {rid: post(rid) for rid in ("a", "b", "c")}
            assert {await entered.get() for _ in range(3)} == {"a", "b", "c"}
            assert app.coming == 3
            gates["a"].set()
            assert (await tasks["a"]).json() == {"more": 2, "again": 2}  # b and c behind it; counted once
            gates["c"].set()
            assert (await tasks["c"]).status_code == 400
            assert app.coming == 1
            gates["b"].set()
            assert (await tasks["b"]).json() == {"more": 0, "again": 0}
            assert (await client.post("/v1/embeddings", json={})).json() == {"more": 0}  # not a generation
            assert app.coming == 0

    asyncio.run(main())
