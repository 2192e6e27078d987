"""Ollama's `keep_alive` through the router's public calls: 0 unloads the model once the request is answered (the
orderly evict, `router.evict(..., "drain")`), a negative value keeps it loaded (pinned: only an explicit evict
unloads it), a duration sets its idle TTL (`router.keep_alive`: the worker's own, which the lifecycle's housekeeping
and status read, so a request's keep_alive shows in /api/ps's expires_at and in `mlxsup status` at once). Unset,
the model keeps the TTL it has.

A keep_alive holds for the worker that served its request, as Ollama's holds for the model while it stays loaded:
once that worker is gone (evicted, crashed), the model's next load has its own TTL again until a request says
otherwise.
"""

from __future__ import annotations

import asyncio
import logging

from supervisor import errors
from supervisor.router import Router

log = logging.getLogger(__name__)


class KeepAlive:
    def __init__(self, router: Router) -> None:
        self.router = router
        self._tasks: set[asyncio.Task] = set()

    def after(self, model_id: str, seconds: float | None) -> None:
        """Apply a request's keep_alive once it is answered (None: unset, nothing changes)."""
        if seconds is None:
            return
        if seconds == 0:
            task = asyncio.get_running_loop().create_task(self._unload(model_id), name=f"keep_alive[{model_id}]")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        self.router.keep_alive(model_id, seconds)  # the worker's: its TTL, or pinned (router.Router.keep_alive)

    async def _unload(self, model_id: str) -> None:
        try:
            report = await self.router.evict(model_id, "drain", None, reason="keep_alive")
        except errors.MlxsupError as exc:
            log.info("[ollama] keep_alive 0: %s was not unloaded: %s", model_id, exc.message)
            return
        log.info("[ollama] keep_alive 0: %s unloaded (%s)", model_id, report.to_dict().get("outcome", "done"))
