"""Typed results of the router: an eviction's report, each model's status, the daemon's status.

The router builds them; the HTTP API turns them into JSON with one `to_dict()` at its edge
(`POST /api/models/{id}/evict`, `GET /api/status`), and the CLI reads that JSON back with
`from_dict()`. Invariants: `to_dict()` is the API's JSON shape, key order included (keys that
appear only in some states are left out in the others, as the API has always done); `from_dict`
accepts what `to_dict` writes and tolerates keys it does not know.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class EvictReport:
    """What one eviction gave back. `evicted` False: the model was not loaded (only `reason` says more)."""

    model: str
    evicted: bool
    reason: str | None  # api | ttl | admission | pressure-soft | pressure-hard | shutdown | "not loaded"
    pid: int | None = None
    mode: str | None = None  # drain | now
    memory_before_bytes: int | None = None
    duration_s: float | None = None
    exit: int | None = None
    signals: tuple[str, ...] = ()  # sent by the kill ladder, in order
    aborted: int | None = None  # the worker's Bye: requests aborted, drained
    drained: int | None = None
    phases_s: Mapping[str, float] = field(default_factory=dict)  # the worker's Bye: each exit phase's time
    memory_after_settle_bytes: int | None = None
    stranded_bytes: int = 0  # wired memory the exit did not give back (supervisor/stranded.py; macOS only)

    @classmethod
    def not_loaded(cls, model: str) -> EvictReport:
        return cls(model, False, "not loaded")

    def to_dict(self) -> dict[str, Any]:
        if not self.evicted:
            return {"model": self.model, "evicted": False, "reason": self.reason}
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(signals=list(self.signals), phases_s=dict(self.phases_s))
        return out

    def summary(self) -> dict[str, Any]:
        """The part a model's status keeps as its `last_eviction`."""
        return {"reason": self.reason, "mode": self.mode, "duration_s": self.duration_s, "exit": self.exit}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], model: str | None = None) -> EvictReport:
        """From `to_dict()` or `summary()` JSON (a summary names no model: pass it)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values.setdefault("model", model or "")
        values.setdefault("evicted", True)
        values.setdefault("reason", None)
        values["signals"] = tuple(values.get("signals", ()))
        return cls(**values)


@dataclass(frozen=True)
class LoadProgress:
    stage: str
    fraction: float


@dataclass(frozen=True)
class ModelStatus:
    """One model as `mlxsup status` shows it. Fields after `cache` are state-dependent keys in JSON."""

    id: str
    state: str  # loading | ready | evicting | stopped | failed
    kind: str = "chat"  # chat | embedding (protocol/modelkind.py)
    pid: int | None = None
    memory_bytes: int | None = None  # measured footprint of its worker
    in_flight: int = 0
    queued: int = 0  # in its worker's queue (its heartbeat's `waiting`)
    waiting: int = 0  # in the supervisor's queue for the model (slot.py): a load, room, a swap, a place on its worker
    oldest_wait_s: float = 0.0  # how long the first of them has waited
    queue_refused: int = 0  # requests the queue refused (full, or waited too long), in all
    leases: int = 0
    idle_s: float | None = None
    ttl_s: float | None = None
    ttl_remaining_s: float | None = None
    pinned: bool = False
    restarts: int = 0
    crashes: int = 0
    suspended: int = 0  # requests waiting to resume now (supervisor/resume.py)
    resumed: int = 0  # requests resumed on a later worker, in all
    resume_failed: int = 0  # requests that could not resume after all, in all
    last_error: str | None = None
    stderr_tail: tuple[str, ...] = ()
    last_eviction: EvictReport | None = None
    worker_active: int = 0
    batch_size: int = 0
    peak_batch_size: int = 0
    weights_bytes: int = 0  # the model's weights on disk
    cache: dict[str, Any] | None = None  # cache_admin.stats_view
    retry_in_s: float | None = None  # only while failed with no worker: when it is tried again
    generated_tokens: int | None = None  # with context_length: only while it has a worker
    context_length: int | None = None
    drafted_tokens: int = 0  # with generated_tokens: speculative decoding's tokens over the worker's life, drafted
    accepted_tokens: int = 0  # and kept; in JSON with `acceptance_rate`, their ratio (null: nothing drafted)
    drafting: str = ""  # its worker's speculative decoding: "off", "prompt-lookup", "draft" ("": generates no text)
    drafting_priced: bool = False  # and whether its costs are measured (its requests may draft from then on)
    progress: LoadProgress | None = None  # only while loading
    ranks: tuple[dict[str, Any], ...] = ()  # a worker group's ranks (rank, host, pid, memory_bytes); only then
    # a generating model's sampling for a request that sets none: {field: {"value", "source"}} (supervisor/sampling.py)
    sampling: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)[:_ALWAYS]}
        out.update(stderr_tail=list(self.stderr_tail),
                   last_eviction=self.last_eviction.summary() if self.last_eviction else None)
        if self.retry_in_s is not None:
            out["retry_in_s"] = self.retry_in_s
        if self.generated_tokens is not None:
            out.update(generated_tokens=self.generated_tokens, context_length=self.context_length,
                       drafted_tokens=self.drafted_tokens, accepted_tokens=self.accepted_tokens,
                       acceptance_rate=self.acceptance_rate, drafting=self.drafting,
                       drafting_priced=self.drafting_priced)
        if self.progress is not None:
            out["progress"] = {"stage": self.progress.stage, "fraction": self.progress.fraction}
        if self.ranks:
            out["ranks"] = [dict(r) for r in self.ranks]
        if self.sampling is not None:
            out["sampling"] = self.sampling
        return out

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelStatus:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["stderr_tail"] = tuple(values.get("stderr_tail") or ())
        values["ranks"] = tuple(values.get("ranks") or ())
        if values.get("last_eviction") is not None:
            values["last_eviction"] = EvictReport.from_dict(values["last_eviction"], model=data["id"])
        if values.get("progress") is not None:
            values["progress"] = LoadProgress(**values["progress"])
        return cls(**values)


_ALWAYS = [f.name for f in fields(ModelStatus)].index("cache") + 1  # the keys every model's JSON has


@dataclass(frozen=True)
class SpareStatus:
    pid: int | None
    standing_by: bool


@dataclass(frozen=True)
class RecentEviction:
    """One finished eviction as the status lists it: its report, and how long ago it ended.

    An eviction is reported only after its process was reaped, so each one here is a process gone."""

    ago_s: float
    report: EvictReport

    def to_dict(self) -> dict[str, Any]:
        return {"ago_s": self.ago_s, **self.report.to_dict()}


@dataclass(frozen=True)
class Status:
    """The daemon's memory and every model (`GET /api/status`, with the gateway's version and uptime)."""

    ceiling_bytes: int
    used_bytes: int
    system_available_bytes: int
    system_total_bytes: int
    max_loaded_models: int | None
    spare: SpareStatus | None
    models: list[ModelStatus]
    recent_evictions: list[RecentEviction] = field(default_factory=list)  # newest first
    stranded_bytes: int = 0  # wired memory that exits did not give back, taken off the ceiling (stranded.py; macOS)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(spare={"pid": self.spare.pid, "standing_by": self.spare.standing_by} if self.spare else None,
                   models=[m.to_dict() for m in self.models],
                   recent_evictions=[e.to_dict() for e in self.recent_evictions])
        return out
