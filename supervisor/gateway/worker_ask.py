"""One question to a model's worker outside generation (count a prompt's tokens, embed inputs, rerank).

The model is held by a lease while it is asked (loaded first if it is not), and every way the asking can end is
one of the API's errors: a value the wire cannot carry is the request's fault (400), no answer in time (or, for work
of many batches, no heartbeat from the worker for that long) a 504, a
worker gone before it answered WorkerDied, a client gone before the answer RequestAborted, and a refusal the
worker sends back its own code. Invariant: a question nobody waits for any more (timed out, or its client
disconnected) is withdrawn from the worker (Router.ask sends the Abort), and its lease is released at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.requests import Request

from protocol.codec import ProtocolError
from protocol.messages import Message
from supervisor import errors
from supervisor.router import Router


async def ask_worker(router: Router, model: str, build: Callable[[str], Message], timeout_s: float, doing: str,
                     param: str | None = None, request: Request | None = None, silence: bool = False,
                     on_lease: Callable[[], None] | None = None,
                     on_part: Callable[[Message], None] | None = None) -> Message:
    """`build(rid)` sent to `model`'s worker, and its reply; `doing` names the work in errors ("count the prompt").
    With `request` (its body already read), the question is withdrawn when that client disconnects. With `silence`,
    `timeout_s` counts from the worker's last heartbeat, not from the asking (Router.ask): work of many batches.
    `on_part` is given the parts the worker sends before its reply (Router.ask)."""
    lease = await router.acquire(model)
    if on_lease is not None:  # the caller's clock: the worker is had (a load's end)
        on_lease()
    try:
        asking = asyncio.ensure_future(router.ask(lease.worker.spec.id, build, timeout_s, silence, on_part))
        if request is not None:
            gone = asyncio.ensure_future(_disconnected(request))
            try:
                await asyncio.wait({asking, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
            if not asking.done():  # the client left: Router.ask, cancelled, withdraws the question
                asking.cancel()
                await asyncio.gather(asking, return_exceptions=True)
                raise errors.RequestAborted(f"the client disconnected before the worker could {doing}")
        reply = await asking
    except ProtocolError as exc:  # a value the wire cannot carry: the request's fault, not the worker's
        raise errors.InvalidRequest(f"the request cannot be sent to the worker: {exc}", param=param) from None
    except TimeoutError:
        if silence:
            raise errors.WorkerTimeout(f"the worker of '{model}' did not {doing}: it showed no progress for "
                                       f"{timeout_s:.0f}s (no heartbeat; [server] embed_timeout_s)") from None
        raise errors.WorkerTimeout(f"the worker of '{model}' did not {doing} in {timeout_s:.0f}s") from None
    finally:
        lease.release()
    if reply is None:
        raise errors.WorkerDied(f"the worker of '{model}' ended before it could {doing}")
    code = getattr(reply, "code", None)
    if code is not None:
        raise errors.from_worker(code, getattr(reply, "message", None) or "the worker refused the request")
    return reply


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects: once the body is read, the server's next message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
