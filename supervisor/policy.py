"""Pure lifecycle decisions: does a load fit, which idle worker goes, who goes under pressure, who is hung.

Functions of plain values, no I/O, no logging, no clock: the router hands them a snapshot
(`WorkerView`s) and acts on the answer in the same loop turn. Invariants:
- a busy worker (leased: a request routed to it or waiting on its load; or owed: a request queued for it goes
  before every other model's waiter for it, slot.ModelSlot.owed) is never chosen by
  admission, TTL or soft pressure; only hard pressure may take one, and then the least
  recently used unpinned one; admission may name busy unpinned ones to wait for (`wait_for`:
  once their requests are done they are idle, and chosen then);
- a pinned worker is never chosen here at all (only an explicit evict removes it);
- memory of a worker already being evicted (or refused, and being killed) counts as used until it
  is gone, and as on its way back: decisions wait for it rather than evicting more;
- a worker is hung only when its loop is silent past hang_timeout_s and, if its last message
  announced a step, also far past what that step's work predicts (STEP_OVERRUN times);
- a loading worker is stopped once it measures past the ceiling or far past its estimate (load_overrun).
"""

from __future__ import annotations

from dataclasses import dataclass

LEAVING = frozenset({"evicting", "failed"})  # on their way out: their memory is coming back


@dataclass(frozen=True)
class WorkerView:
    id: str
    state: str  # "loading" | "ready" | "evicting" | "failed" (refused, on its way out)
    bytes: int  # measured footprint; the estimate while loading
    busy: bool
    pinned: bool
    last_used: float


@dataclass(frozen=True)
class Admission:
    evict: tuple[str, ...] = ()
    wait: bool = False  # room is on its way (workers being evicted): wait for them, then decide again
    missing_bytes: int = 0  # > 0: cannot fit even after evicting every idle worker
    too_many: bool = False  # the max_loaded_models limit cannot be met
    # not now, but once these busy workers' requests are done (least recently used first): wait for them to idle
    wait_for: tuple[str, ...] = ()

    @property
    def refused(self) -> bool:
        return self.missing_bytes > 0 or self.too_many


def idle_lru(views: list[WorkerView]) -> list[WorkerView]:
    """Workers that idle eviction may take, least recently used first."""
    return sorted((v for v in views if v.state == "ready" and not v.busy and not v.pinned),
                  key=lambda v: v.last_used)


def admit(need: int, views: list[WorkerView], ceiling: int, max_loaded: int | None) -> Admission:
    """Can a new worker needing `need` bytes start, which idle workers must go first, or which busy ones must it
    wait for (refused only when even with every unpinned worker gone it could not start)?"""
    used = sum(v.bytes for v in views)
    leaving = [v for v in views if v.state in LEAVING]
    staying = len(views) - len(leaving)
    over_bytes = used + need - ceiling
    over_count = staying + 1 - max_loaded if max_loaded else 0
    if need > ceiling:
        return Admission(missing_bytes=need - ceiling)
    if over_bytes <= 0 and over_count <= 0:
        return Admission()
    freed = sum(v.bytes for v in leaving)
    chosen: list[str] = []
    for v in idle_lru(views):
        if freed >= over_bytes and len(chosen) >= over_count:
            break
        chosen.append(v.id)
        freed += v.bytes
    if freed >= over_bytes and len(chosen) >= over_count:
        return Admission(evict=tuple(chosen), wait=not chosen)
    waited: list[str] = []  # the busy ones it may wait for: unpinned, loaded or loading, least recently used first
    for v in sorted((v for v in views if not v.pinned and (v.state == "loading" or v.busy and v.state == "ready")),
                    key=lambda v: v.last_used):
        if freed >= over_bytes and len(chosen) + len(waited) >= over_count:
            break
        waited.append(v.id)
        freed += v.bytes
    if freed < over_bytes:
        return Admission(missing_bytes=over_bytes - freed)
    if len(chosen) + len(waited) < over_count:
        return Admission(too_many=True)
    return Admission(wait_for=tuple(waited))


# a loading worker may pass its estimate by this much (or by the estimate, if more): imports, a CUDA context, a load's
# transient copies, and a vision model's probe of one image at the processor's largest size (vision.py) are not in it
LOAD_MARGIN_BYTES = 8 * 2**30


def load_overrun(measured: int | None, estimate: int, ceiling: int) -> str | None:
    """Why a loading worker must be stopped for its memory, or None while it may go on.

    Admission let it start on its estimate (weights, runtime, overhead); a load that keeps growing (a hostile
    config's model being built) is stopped once its measured footprint passes the memory ceiling (alone it can
    never fit) or its estimate by a margin: the estimate again or LOAD_MARGIN_BYTES, whichever is more."""
    if measured is None:
        return None
    if measured > ceiling:
        return f"it measures {measured / 2**20:.0f} MiB while loading, past the memory ceiling of {ceiling / 2**20:.0f} MiB"
    allowed = estimate + max(estimate, LOAD_MARGIN_BYTES)
    if measured > allowed:
        return (f"it measures {measured / 2**20:.0f} MiB while loading, past the {allowed / 2**20:.0f} MiB its "
                f"estimate of {estimate / 2**20:.0f} MiB allows")
    return None


MIN_CONTEXT = 512  # the least context the memory cap leaves a model (its config's may be less)


def context_cap(kv_bytes_per_token: int, estimate: int, ceiling: int) -> int | None:
    """The most context a model's worker publishes for its memory: the tokens whose KV fits in what the ceiling
    leaves past the model's estimate (one request's worth, the most any single request can use), at least
    MIN_CONTEXT; None when its KV is not known (the worker caps it at modelconfig.MAX_CONTEXT anyway)."""
    if kv_bytes_per_token <= 0:
        return None
    return max(MIN_CONTEXT, (ceiling - estimate) // kv_bytes_per_token)


def pressure_victim(views: list[WorkerView], level: str | None) -> tuple[str, bool] | None:
    """Under memory pressure, the worker to evict and whether it is busy (then abort, don't drain)."""
    if level is None or any(v.state in LEAVING for v in views):
        return None  # nothing to do, or memory is already on its way back
    idle = idle_lru(views)
    if idle:
        return idle[0].id, False
    if level != "hard":
        return None
    busy = sorted((v for v in views if v.state == "ready" and v.busy and not v.pinned), key=lambda v: v.last_used)
    return (busy[0].id, True) if busy else None


def pressure_level(available: int, total: int, soft: float, hard: float) -> str | None:
    used = 1.0 - available / total if total else 0.0
    if used >= hard:
        return "hard"
    if used >= soft:
        return "soft"
    return None


def ttl_expired(views: list[WorkerView], ttls: dict[str, float | None], now: float) -> list[str]:
    """Idle, unpinned workers whose idle time passed their TTL (counted from their last request's end)."""
    return [v.id for v in idle_lru(views) if (ttl := ttls.get(v.id)) and now - v.last_used >= ttl]


RELEASE_BYTES_PER_S = 8 * 2**30  # what an exiting worker is given to hand back, on top of the kill timeout


def kill_timeout(kill_timeout_s: float, model_bytes: int) -> float:
    """How long SIGTERM waits before SIGKILL for a worker of `model_bytes`: its exit synchronizes the device and hands
    back what MLX holds (worker/mlx_engine/release.py), which takes longer the bigger the model; a SIGKILL in the middle
    is what strands wired memory on macOS (supervisor/stranded.py)."""
    return kill_timeout_s + model_bytes / RELEASE_BYTES_PER_S


STEP_OVERRUN = 4.0  # a step announced with a prediction is hung once silent this many times that long


def hang_reason(now: float, last_seen: float, hang_timeout_s: float, step_started: float | None = None,
                step_predicted_s: float = 0.0) -> str | None:
    """Why a ready worker counts as hung, or None while it is not.

    `last_seen`: its last message of any kind; `step_started`: when it last announced a step
    (StepStarted) predicted to take `step_predicted_s`. That step is still running while no
    message came after it; it is allowed max(hang_timeout_s, STEP_OVERRUN * prediction).
    """
    silent = now - last_seen
    if step_started is not None and step_started >= last_seen:
        allowed = max(hang_timeout_s, STEP_OVERRUN * step_predicted_s)
        if silent > allowed:
            return (f"a step predicted to take {step_predicted_s:.1f}s has run {silent:.1f}s "
                    f"(allowed {allowed:.1f}s)")
        return None
    if silent > hang_timeout_s:
        return f"no message from its generation loop for {silent:.1f}s"
    return None
