"""Suspending and resuming requests (supervisor/resume.py) against the router's fakes (test_router.py's
World): what is resubmitted, when, and every bound that ends a suspension with today's error.
Each test names, in its docstring, the handling it would catch missing."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from protocol.messages import Finished, Submit, Tokens
from supervisor import errors
from supervisor.workers import State, Stream, Worker
from tests.unit.test_router import (  # noqa: F401 - strict_states: its autouse fixture
    REFUSAL,
    World,
    fake,
    next_event,
    scenario,
    settle,
    strict_states,
)


def resumable(tmp_path: Path, **settings: Any) -> World:
    return World(tmp_path, **{"max_resumes": 2, "restart_backoff_s": 0.5, **settings})


def tokens(w: World, worker: Worker, rid: str, *chunks: tuple[str, list[int]]) -> None:
    w.transport.deliver(worker.identity, Tokens([[rid, text, len(ids), ids] for text, ids in chunks]))


async def crash_and_restart(w: World, model: str = "m") -> Worker:
    """SIGKILL the model's worker; after the back-off its next worker starts and says Ready."""
    w.process(model).exit(-9)
    await settle()
    w.clock.advance(w.settings.restart_backoff_s * 8)  # past any back-off of a few crashes
    await settle()
    worker = w.ready(model)
    await settle()
    return worker


def drain(stream: Stream) -> list:
    out = []
    while not stream.queue.empty():
        out.append(stream.queue.get_nowait())
    return out


@scenario
async def test_a_crash_suspends_the_stream_and_the_next_worker_gets_the_continuation(tmp_path: Path) -> None:
    """Catches: a crash that fails a resumable request; a continuation without the tokens sent, with the
    full max_tokens, or a lease left counted on the dead worker; the pause not measured."""
    w = resumable(tmp_path)
    lease = await w.load("m")
    first = w.worker("m")
    stream = lease.submit(Submit("r1", max_tokens=10, prompt="hi", temperature=0.0, stop=["!"]))
    tokens(w, first, "r1", ("He", [5, 6]), ("llo", [7]))
    assert drain(stream) == [("He", 2, None), ("llo", 1, None)]
    first.process.exit(-9)  # type: ignore[attr-defined]
    await settle()
    assert stream.queue.empty(), "the client must see a pause, not an error"
    assert w.router.model_status("m").suspended == 1 and first.leases == 0 and not lease.held
    assert w.sample("mlxsup_suspended_requests_total", model="m", cause="crash") == 1

    w.clock.advance(1.0)
    await settle()
    second = w.ready("m")
    await settle()
    (resubmitted,) = w.transport.to(second, Submit)
    assert resubmitted == Submit("r1", max_tokens=7, prompt="hi", temperature=0.0, stop=["!"], resume_tokens=[5, 6, 7])
    assert lease.worker is second and second.leases == 1 and second.streams == {"r1": stream}
    status = w.router.model_status("m")
    assert status.suspended == 0 and status.resumed == 1

    w.clock.advance(0.25)
    tokens(w, second, "r1", (" there", [8]))
    w.transport.deliver(second.identity, Finished("r1", "", "length", 2, 10))
    assert drain(stream) == [(" there", 1, None), Finished("r1", "", "length", 2, 10)]
    assert w.sample("mlxsup_resume_pause_seconds_count", model="m") == 1
    assert w.sample("mlxsup_resume_pause_seconds_sum", model="m") == 1.25  # suspended until its next token
    lease.release()
    assert second.leases == 0


@scenario
async def test_a_third_loss_fails_with_todays_error(tmp_path: Path) -> None:
    """Catches: resumes without a bound (a request that crashes its worker every time loops forever)."""
    w = resumable(tmp_path, crash_limit=10)
    lease = await w.load("m")
    stream = lease.submit(Submit("r1", max_tokens=0, prompt="hi"))
    for _ in range(2):
        worker = await crash_and_restart(w)
        assert stream.queue.empty() and worker.streams == {"r1": stream}
    w.process("m").exit(-9)
    await settle()
    (error,) = drain(stream)
    assert isinstance(error, errors.WorkerDied) and "resumed 2 time(s) already" in error.message
    assert w.router.model_status("m").resume_failed == 1
    lease.release()


@scenario
async def test_a_crash_loop_fails_the_suspended_request(tmp_path: Path) -> None:
    """Catches: a suspended request that keeps waiting on a model the crash-loop rule marked failed."""
    w = resumable(tmp_path, crash_limit=2)
    lease = await w.load("m")
    stream = lease.submit(Submit("r1", max_tokens=0, prompt="hi"))
    w.process("m").exit(-9)  # suspended; its resume waits out the back-off
    await settle()
    w.clock.advance(1.0)
    await settle()
    w.process("m").exit(1)  # the new worker dies loading: the second crash in the window marks it failed
    await settle()
    (error,) = drain(stream)
    assert isinstance(error, errors.WorkerDied) and "marked failed" in error.message
    assert w.router.suspended == {}
    lease.release()


@scenario
async def test_a_client_gone_while_suspended_ends_its_resume(tmp_path: Path) -> None:
    """Catches: a request resubmitted (and generated) for a client that has left."""
    w = resumable(tmp_path)
    lease = await w.load("m")
    lease.submit(Submit("r1", max_tokens=0, prompt="hi"))
    w.process("m").exit(-9)
    await settle()
    lease.abort("r1")
    lease.release()
    w.clock.advance(1.0)
    await settle()
    assert "m" not in w.router.workers, "a cold model was loaded for nobody"
    assert w.router.suspended == {} and not [t for t in asyncio.all_tasks() if t.get_name().startswith("resume")]


@scenario
async def test_shutdown_and_the_deadline_fail_suspended_requests(tmp_path: Path) -> None:
    """Catches: a suspension that outlives its deadline, or a shutdown that leaves a client waiting."""
    w = resumable(tmp_path, resume_timeout_s=30.0, crash_limit=10, restart_backoff_s=100.0)
    lease = await w.load("m")
    late = lease.submit(Submit("r1", max_tokens=0, prompt="hi"))
    w.process("m").exit(-9)
    await settle()
    w.clock.advance(30.0)  # the back-off (100 s) outlasts the deadline
    await settle()
    (error,) = drain(late)
    assert isinstance(error, errors.WorkerDied) and "resume_timeout_s" in error.message

    w.router.slots["m"].clear()
    lease = await w.load("m")
    waiting = lease.submit(Submit("r2", max_tokens=0, prompt="hi"))
    w.process("m").exit(-9)
    await settle()
    shutdown = asyncio.ensure_future(w.router.shutdown())
    await settle()
    (error,) = drain(waiting)
    assert isinstance(error, errors.WorkerDied) and "shutting down" in error.message
    await shutdown


@scenario
async def test_hard_pressure_suspends_and_resumes_only_once_the_pressure_is_over(tmp_path: Path) -> None:
    """Catches: a pressure eviction that fails resumable requests, or a reload while the pressure lasts
    (evicted again at once: thrash); an explicit evict that suspends instead of failing."""
    w = resumable(tmp_path)
    lease = await w.load("m")
    first = w.worker("m")
    stream = lease.submit(Submit("r1", max_tokens=0, prompt="hi"))
    tokens(w, first, "r1", ("a", [1]))
    w.memory.available = 20 * 2**20  # 98% in use: hard
    w.clock.advance(w.settings.housekeeping_s)
    await settle()
    assert first.state is State.EVICTING and first.streams == {} and w.router.suspended
    w.transport.deliver(first.identity, Tokens([["r1", "b", 1, [2]]]))  # sent before it saw the evict: dropped
    first.process.exit(0)  # type: ignore[attr-defined]
    await settle()
    for _ in range(4):
        w.clock.advance(w.settings.housekeeping_s)
        await settle()
    assert "m" not in w.router.workers, "reloaded under pressure"
    w.memory.available = 500 * 2**20
    w.clock.advance(w.settings.housekeeping_s)
    await settle()
    w.clock.advance(w.settings.housekeeping_s)
    await settle()
    second = w.ready("m")
    await settle()
    assert drain(stream) == [("a", 1, None)]
    (resubmitted,) = w.transport.to(second, Submit)
    assert resubmitted.resume_tokens == [1]

    evicting = asyncio.ensure_future(w.router.evict("m", "now"))
    await settle()
    assert second.streams == {"r1": stream}, "an explicit evict must leave the request to the worker's abort"
    second.process.exit(0)  # type: ignore[attr-defined]
    await evicting
    (error,) = drain(stream)
    assert isinstance(error, errors.ModelEvicted) and w.router.suspended == {}
    lease.release()


@scenario
async def test_a_request_sent_to_a_worker_that_just_died_waits_for_the_next(tmp_path: Path) -> None:
    """Catches: a request failed because its worker died an instant before the router saw it (unreachable),
    or resubmitted to that same worker before it is reaped (a loop of failed sends)."""
    w = resumable(tmp_path)
    lease = await w.load("m")
    dying = w.worker("m")
    w.transport.unreachable.add(dying.identity)
    stream = lease.submit(Submit("r1", max_tokens=0, prompt="hi"))
    await settle()
    assert stream.queue.empty() and w.router.suspended and w.router.workers["m"] is dying
    dying.process.exit(-9)  # type: ignore[attr-defined]
    await settle()
    w.clock.advance(1.0)
    await settle()
    second = w.ready("m")
    await settle()
    assert [m.rid for m in w.transport.to(second, Submit)] == ["r1"] and second.streams == {"r1": stream}
    lease.release()


@scenario
async def test_a_next_worker_that_dies_loading_is_followed_by_another(tmp_path: Path) -> None:
    """Catches: a suspended request failed because the worker meant to take it crashed while loading,
    though the model is not marked failed (a SIGKILL now and then under load)."""
    w = resumable(tmp_path, crash_limit=5)
    lease = await w.load("m")
    stream = lease.submit(Submit("r1", max_tokens=0, prompt="hi"))
    w.process("m").exit(-9)
    await settle()
    w.clock.advance(1.0)
    await settle()
    w.process("m").exit(-9)  # the next worker dies while it loads
    await settle()
    assert stream.queue.empty() and w.router.suspended
    w.clock.advance(2.0)  # the back-off after a second crash
    await settle()
    third = w.ready("m")
    await settle()
    assert [m.rid for m in w.transport.to(third, Submit)] == ["r1"]
    lease.release()


@scenario
async def test_a_resume_whose_next_worker_is_refused_fails_once_that_worker_is_reaped(tmp_path: Path) -> None:
    """Catches: a resume retrying on a refused worker still loading, whose failed load fails the retry at once,
    so it loops without ever yielding (the watchdog fails the test); a refused model restarted again."""
    w = resumable(tmp_path)
    lease = await w.load("m")
    stream = lease.submit(Submit("r1", max_tokens=10, prompt="hi", temperature=0.0))
    w.process("m").exit(-9)
    await settle()
    w.clock.advance(1.0)  # past the back-off: the resume starts the model's next worker
    await settle()
    second = w.worker("m")
    fake(second).reap_later = True  # a real process is reaped a moment after its SIGKILL
    w.transport.refuse(second.identity, REFUSAL)
    await settle()
    assert stream.queue.empty() and w.router.suspension("r1") is not None, "it waits for the refused worker's end"
    fake(second).exit(-9)
    await settle()
    error = next_event(stream)
    assert isinstance(error, errors.WorkerDied) and "marked failed" in error.message, error
    assert len(w.processes) == 2 and w.router.suspended == {}
    lease.release()


@scenario
async def test_without_resumes_no_submit_or_token_ids_are_kept(tmp_path: Path) -> None:
    """Catches: a request keeping every generated token id (and its Submit) though it can never be resumed."""
    w = resumable(tmp_path, max_resumes=0)
    lease = await w.load("m")
    stream = lease.submit(Submit("r1", max_tokens=0, prompt="hi"))
    tokens(w, w.worker("m"), "r1", ("He", [5, 6]), ("llo", [7]))
    assert drain(stream) == [("He", 2, None), ("llo", 1, None)]
    assert stream.submit is None and stream.token_ids == []
    lease.release()
