"""Ollama's `keep_alive` (issue 51) through the router's public calls: 0 unloads the model once the request is
answered (the orderly evict, `router.evict(..., "drain")`), a negative value keeps it loaded (no idle TTL: only an
evict, or memory pressure, unloads it), a duration sets its idle TTL. The TTL is what `settings.model_ttl` says
of the model, which the lifecycle's housekeeping and `mlxsup status` read, so a request's keep_alive shows in
/api/ps's expires_at and in `mlxsup status` at once. Unset, the model keeps the TTL it has.

A keep_alive holds for the worker that served its request, as Ollama's holds for the model while it stays loaded:
once that worker is gone (evicted, crashed), the model's next load has its own TTL again until a request says
otherwise.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from supervisor import errors
from supervisor.config import Settings
from supervisor.registry import ModelSpec
from supervisor.router import Router

log = logging.getLogger(__name__)


class KeepAlive:
    def __init__(self, router: Router, settings: Settings) -> None:
        self.router = router
        # model id -> (the worker's pid, its TTL as the last keep_alive set it: None, never)
        self.ttls: dict[str, tuple[int | None, float | None]] = {}
        self._tasks: set[asyncio.Task] = set()
        base: Callable[[ModelSpec], float | None] = settings.model_ttl

        def model_ttl(spec: ModelSpec) -> float | None:
            kept = self.ttls.get(spec.id)
            if kept is None:
                return base(spec)
            worker = router.workers.get(spec.id)
            if worker is None or worker.pid != kept[0]:  # that worker is gone: the model's own TTL again
                del self.ttls[spec.id]
                return base(spec)
            return kept[1]

        # the one place the server's TTL rule is read (lifecycle, status): a keep_alive goes there, for this model only
        settings.model_ttl = model_ttl  # type: ignore[method-assign]

    def after(self, model_id: str, seconds: float | None) -> None:
        """Apply a request's keep_alive once it is answered (None: unset, nothing changes)."""
        if seconds is None:
            return
        if seconds == 0:
            task = asyncio.get_running_loop().create_task(self._unload(model_id), name=f"keep_alive[{model_id}]")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        worker = self.router.workers.get(model_id)
        if worker is not None:
            self.ttls[model_id] = (worker.pid, None if seconds < 0 else seconds)

    async def _unload(self, model_id: str) -> None:
        try:
            report = await self.router.evict(model_id, "drain", None, reason="keep_alive")
        except errors.MlxsupError as exc:
            log.info("[ollama] keep_alive 0: %s was not unloaded: %s", model_id, exc.message)
            return
        log.info("[ollama] keep_alive 0: %s unloaded (%s)", model_id, report.to_dict().get("outcome", "done"))
