"""Lifecycle policy as tables: pure functions of worker snapshots, and the hang verdict."""

from __future__ import annotations

import pytest

from supervisor.policy import (
    LOAD_MARGIN_BYTES,
    MIN_CONTEXT,
    STEP_OVERRUN,
    Admission,
    WorkerView,
    admit,
    context_cap,
    hang_reason,
    load_overrun,
    pressure_level,
    pressure_victim,
    ttl_expired,
)

MiB = 2**20


def w(id: str, mib: int, *, state: str = "ready", busy: bool = False, pinned: bool = False,
      used: float = 0.0) -> WorkerView:
    return WorkerView(id, state, mib * MiB, busy, pinned, used)


@pytest.mark.parametrize("need, views, ceiling, max_loaded, expected", [
    (100, [], 1000, None, Admission()),
    (100, [w("a", 500)], 1000, None, Admission()),
    # least recently used idle worker goes first, and only as many as needed
    (400, [w("a", 500, used=2), w("b", 300, used=1)], 1000, None, Admission(evict=("b",))),
    (700, [w("a", 500, used=2), w("b", 300, used=1)], 1000, None, Admission(evict=("b", "a"))),
    # busy and pinned workers are never chosen: a busy one is waited for (once idle it can go), a pinned one never
    (400, [w("a", 500, busy=True), w("b", 300, pinned=True)], 1000, None, Admission(wait_for=("a",))),
    (800, [w("a", 500, busy=True), w("b", 300, pinned=True)], 1000, None, Admission(missing_bytes=100 * MiB)),
    (400, [w("a", 500, busy=True, used=0), w("b", 300, used=5)], 1000, None, Admission(evict=("b",))),
    # idle ones cannot free enough: the least recently used busy ones are waited for, as few as do
    (700, [w("a", 500, busy=True, used=3), w("b", 300, busy=True, used=1), w("c", 100, used=9)], 1000, None,
     Admission(wait_for=("b", "a"))),
    # a loading worker is busy by definition (a request waits on it) and not ready: never evicted, but waited for
    (400, [w("a", 700, state="loading")], 1000, None, Admission(wait_for=("a",))),
    (400, [w("a", 700, state="loading", pinned=True)], 1000, None, Admission(missing_bytes=100 * MiB)),
    # memory already on its way back: wait for it rather than evicting more
    (400, [w("a", 700, state="evicting"), w("b", 100)], 1000, None, Admission(wait=True)),
    # ... as is a refused worker's, being killed (it is neither evictable nor staying)
    (400, [w("a", 700, state="failed"), w("b", 100)], 1000, None, Admission(wait=True)),
    # larger than the ceiling itself: refused outright
    (2000, [], 1000, None, Admission(missing_bytes=1000 * MiB)),
    # the count limit
    (1, [w("a", 1, used=1), w("b", 1, used=0)], 1000, 2, Admission(evict=("b",))),
    (1, [w("a", 1, busy=True, used=2), w("b", 1, busy=True, used=1)], 1000, 2, Admission(wait_for=("b",))),
    (1, [w("a", 1, busy=True, pinned=True), w("b", 1, pinned=True)], 1000, 2, Admission(too_many=True)),
])
def test_admit(need, views, ceiling, max_loaded, expected) -> None:
    assert admit(need * MiB, views, ceiling * MiB, max_loaded) == expected


def test_pressure_prefers_idle_and_takes_busy_only_when_hard() -> None:
    views = [w("busy", 100, busy=True, used=0), w("idle", 100, used=5), w("pin", 100, pinned=True, used=-1)]
    assert pressure_victim(views, None) is None
    assert pressure_victim(views, "soft") == ("idle", False)
    only_busy = [w("b1", 1, busy=True, used=3), w("b2", 1, busy=True, used=1), w("p", 1, pinned=True, busy=True)]
    assert pressure_victim(only_busy, "soft") is None
    assert pressure_victim(only_busy, "hard") == ("b2", True)
    assert pressure_victim([*only_busy, w("x", 1, state="evicting")], "hard") is None
    assert pressure_victim([*only_busy, w("x", 1, state="failed")], "hard") is None


def test_pressure_level() -> None:
    assert pressure_level(50, 100, 0.9, 0.97) is None
    assert pressure_level(9, 100, 0.9, 0.97) == "soft"
    assert pressure_level(2, 100, 0.9, 0.97) == "hard"


def test_ttl_skips_busy_pinned_and_unset() -> None:
    views = [w("old", 1, used=0), w("busy", 1, busy=True, used=0), w("pin", 1, pinned=True, used=0),
             w("fresh", 1, used=9), w("never", 1, used=0)]
    ttls = {"old": 5, "busy": 5, "pin": 5, "fresh": 5, "never": None}
    assert ttl_expired(views, ttls, now=10) == ["old"]


@pytest.mark.parametrize("now, last_seen, step_started, predicted, hung", [
    # no step announced: silent past hang_timeout_s (5 s) is a hang, whatever the loop was doing
    (104.9, 100.0, None, 0.0, False),
    (105.1, 100.0, None, 0.0, True),
    # a step announced as short: the hang timeout still rules (a SIGSTOP mid-step is caught in time)
    (105.1, 100.0, 100.0, 0.3, True),
    # a long step announced: allowed STEP_OVERRUN x its prediction, never less than hang_timeout_s
    (130.0, 100.0, 100.0, 10.0, False),
    (139.9, 100.0, 100.0, 10.0, False),
    (140.1, 100.0, 100.0, 10.0, True),
    (104.0, 100.0, 100.0, 0.5, False),
    # a message after the announced step ended it: back to the plain timeout
    (106.1, 101.0, 100.0, 10.0, True),
    (105.9, 101.0, 100.0, 10.0, False),
])
def test_hang_verdict(now: float, last_seen: float, step_started: float | None, predicted: float,
                      hung: bool) -> None:
    reason = hang_reason(now, last_seen, 5.0, step_started, predicted)
    assert (reason is not None) is hung
    assert STEP_OVERRUN == 4.0


def test_hang_reason_says_what_the_loop_was_doing() -> None:
    assert hang_reason(140.1, 100.0, 5.0, 100.0, 10.0).startswith("a step predicted to take 10.0s has run 40.1s")
    assert hang_reason(106.0, 100.0, 5.0) == "no message from its generation loop for 6.0s"


GiB = 2**30


@pytest.mark.parametrize("measured, estimate, ceiling, stopped", [
    (None, 100 * MiB, 2 * GiB, False),  # not measured (yet): nothing to go on
    (100 * MiB, 100 * MiB, 2 * GiB, False),
    # a small model may pass its estimate by LOAD_MARGIN_BYTES (imports, a CUDA context, a vision probe), not more ...
    (100 * MiB + LOAD_MARGIN_BYTES, 100 * MiB, 16 * GiB, False),
    (101 * MiB + LOAD_MARGIN_BYTES, 100 * MiB, 16 * GiB, True),
    (100 * MiB + 6 * GiB, 100 * MiB, 16 * GiB, False),
    # ... a large one by its estimate again (a load's transient copies)
    (2 * 10 * GiB, 10 * GiB, 64 * GiB, False),
    (2 * 10 * GiB + MiB, 10 * GiB, 64 * GiB, True),
    # past the ceiling it can never fit, however small its estimate
    (2 * GiB, 100 * MiB, 2 * GiB, False),
    (2 * GiB + 1, 100 * MiB, 2 * GiB, True),
    (6 * GiB, 100 * MiB, 2 * GiB, True),  # issue 48: a loading worker at 6.0 GB under a 2 GiB ceiling
])
def test_a_load_that_outgrows_its_memory_is_stopped(measured: int | None, estimate: int, ceiling: int,
                                                     stopped: bool) -> None:
    assert (load_overrun(measured, estimate, ceiling) is not None) is stopped


def test_load_overrun_says_what_it_measured_and_what_was_allowed() -> None:
    assert load_overrun(6 * GiB, 100 * MiB, 2 * GiB) == (
        "it measures 6144 MiB while loading, past the memory ceiling of 2048 MiB")
    assert load_overrun(9 * GiB, 100 * MiB, 16 * GiB) == (
        "it measures 9216 MiB while loading, past the 8292 MiB its estimate of 100 MiB allows")


@pytest.mark.parametrize("kv, estimate, ceiling, cap", [
    (0, 100 * MiB, GiB, None),  # its KV is not known: only the worker's MAX_CONTEXT caps it
    (MiB, 100 * MiB, 1000 * MiB, 900),  # the tokens whose KV fits in what the ceiling leaves past the estimate
    (512, 100 * MiB, 20 * GiB, (20 * GiB - 100 * MiB) // 512),
    (MiB, 999 * MiB, 1000 * MiB, MIN_CONTEXT),  # never less than MIN_CONTEXT
    (MiB, 2000 * MiB, 1000 * MiB, MIN_CONTEXT),  # a pinned model started past the ceiling (no admission)
])
def test_the_context_a_model_publishes_is_what_its_kv_can_have_of_the_ceiling(kv: int, estimate: int, ceiling: int,
                                                                              cap: int | None) -> None:
    assert context_cap(kv, estimate, ceiling) == cap
