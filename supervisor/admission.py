"""Admission: may a model with no worker start one now, and what must go first.

A collaborator the Router (router.py) owns and calls from `acquire` when the model has no worker.
It owns no state: it reads the model's record and the lifecycle's memory picture, and acts through
core_api.AdmissionHost (start a worker, evict idle ones); the decision itself is policy.admit's.
It imports none of the other collaborators. Invariants:
- a worker is started in the very turn whose decision allowed it (no await in between);
- a model marked failed is refused at once, a back-off is waited out, and workers on their way
  out are waited for, never evicted twice; after any wait the caller decides again;
- a model that fits once busy workers are idle is not refused: the caller is told whom to wait for (Busy);
  refused (InsufficientMemory, 507) is only what cannot fit with every unpinned worker gone.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from supervisor import errors, policy
from supervisor.core_api import AdmissionHost
from supervisor.effects import Clock
from supervisor.registry import ModelSpec
from supervisor.slot import ModelSlot
from supervisor.workers import State, Worker


@dataclass(frozen=True)
class Busy:
    """The model fits once these (busy) models' workers are idle and can be evicted."""

    models: tuple[str, ...]


class Admission:
    def __init__(self, host: AdmissionHost, clock: Clock) -> None:
        self.host = host
        self.clock = clock

    async def start(self, spec: ModelSpec, record: ModelSlot) -> Worker | Busy | None:
        """The model's new worker, started in this turn; None after a wait (back-off, evictions): decide again; Busy:
        it fits once these busy workers are idle (the caller waits for them, then decides again).

        Raises ModelLoadFailed while the model is marked failed, InsufficientMemory when it cannot fit even then.
        """
        now = self.clock.monotonic()
        if record.failed_until > now:
            raise errors.ModelLoadFailed(
                f"the model '{spec.id}' is marked failed ({record.last_error}); it is tried again in "
                f"{record.failed_until - now:.0f}s, or now with an explicit load")
        if record.backoff_until > now:
            await self.clock.sleep(record.backoff_until - now)
            return None
        host = self.host
        decision = policy.admit(host.estimate(spec), host.views(), host.ceiling, host.settings.max_loaded_models)
        if decision.refused:
            raise self._insufficient(spec, decision)
        if decision.wait_for:
            return Busy(decision.wait_for)
        if decision.evict or decision.wait:
            for victim in decision.evict:
                host.begin_evict(host.workers[victim], "drain", None, "admission")
            await self._evictions_done()
            return None
        return host.start_worker(spec)

    async def _evictions_done(self) -> None:
        """Wait until every worker on its way out (evicting, or refused: policy.LEAVING) is gone."""
        await asyncio.gather(*(w.gone.wait() for w in list(self.host.workers.values())
                               if w.state in (State.EVICTING, State.FAILED)))

    def _insufficient(self, spec: ModelSpec, decision: policy.Admission) -> errors.InsufficientMemory:
        host = self.host
        views = host.views()
        loaded = ", ".join(f"{v.id} ({v.state}{', busy' if v.busy else ''}{', pinned' if v.pinned else ''}, "
                           f"{v.bytes / 2**20:.0f} MiB)" for v in views) or "nothing"
        if decision.too_many:
            why = (f"the limit of {host.settings.max_loaded_models} loaded models is reached by models that cannot "
                   "go (pinned)")
        else:
            why = f"{decision.missing_bytes / 2**20:.0f} MiB are missing with every model that can go gone"
        err = errors.InsufficientMemory(
            f"cannot load '{spec.id}' (needs about {host.estimate(spec) / 2**20:.0f} MiB, ceiling "
            f"{host.ceiling / 2**20:.0f} MiB): {why}. Loaded: {loaded}.")
        err.extra = {"missing_bytes": decision.missing_bytes, "loaded": [v.__dict__ for v in views]}
        return err
