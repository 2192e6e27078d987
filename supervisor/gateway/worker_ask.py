"""One question to a model's worker outside generation (count a prompt's tokens, embed inputs).

The model is held by a lease while it is asked (loaded first if it is not), and every way the asking can end is
one of the API's errors: a value the wire cannot carry is the request's fault (400), no answer in time a 500, a
worker gone before it answered WorkerDied, and a refusal the worker sends back its own code.
"""

from __future__ import annotations

from collections.abc import Callable

from protocol.codec import ProtocolError
from protocol.messages import Message
from supervisor import errors
from supervisor.router import Router


async def ask_worker(router: Router, model: str, build: Callable[[str], Message], timeout_s: float, doing: str,
                     param: str | None = None) -> Message:
    """`build(rid)` sent to `model`'s worker, and its reply; `doing` names the work in errors ("count the prompt")."""
    lease = await router.acquire(model)
    try:
        reply = await router.ask(lease.worker.spec.id, build, timeout_s)
    except ProtocolError as exc:  # a value the wire cannot carry: the request's fault, not the worker's
        raise errors.InvalidRequest(f"the request cannot be sent to the worker: {exc}", param=param) from None
    except TimeoutError:
        raise errors.MlxsupError(f"the worker of '{model}' did not {doing} in {timeout_s:.0f}s") from None
    finally:
        lease.release()
    if reply is None:
        raise errors.WorkerDied(f"the worker of '{model}' ended before it could {doing}")
    code = getattr(reply, "code", None)
    if code is not None:
        raise errors.from_worker(code, getattr(reply, "message", None) or "the worker refused the request")
    return reply
