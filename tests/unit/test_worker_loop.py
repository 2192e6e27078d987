"""The worker loop against a fake engine and an in-memory channel: no MLX, no process, no sleep.

The fakes (tests/unit/worker_fakes.py) run on a fake clock, so deadlines, heartbeats and phase
timings are exact; frames go through the real codec. Each test scripts its events after a given
engine step or idle wait. tests/integration/ proves the same against real processes.
"""

from __future__ import annotations

import logging
import os

import msgpack
import pytest

from protocol.codec import VersionMismatch, decode
from protocol.messages import (
    CONTEXT_LENGTH_EXCEEDED,
    EXIT_OK,
    EXIT_PARENT_GONE,
    INTERNAL_ERROR,
    MODEL_EVICTED,
    PROTOCOL_VERSION,
    WORKER_CRASHED,
    Abort,
    Bye,
    CacheCleared,
    CacheStats,
    ClearCache,
    Evict,
    Failed,
    Finished,
    Heartbeat,
    Load,
    Message,
    Ready,
    StepStarted,
    Submit,
    Tokenize,
    Tokenized,
    Tokens,
)
from tests.unit.worker_fakes import STEP_S, FakeCaches, rig, sub
from worker.engine_api import RequestRejected
from worker.faults import FAULTS, Faults
from worker.loop import IDLE_WORK_QUIET_S

# --- the seam -----------------------------------------------------------------------------


# --- the eviction sequence, phase by phase --------------------------------------------------


def test_a_submit_during_an_exit_is_refused_with_model_evicted() -> None:
    r = rig(sub("a", 3), Evict("drain", 10), sub("b"))
    assert r.loop.run() == EXIT_OK
    assert r.failed()["b"].code == MODEL_EVICTED and "submit b" not in r.engine.calls
    assert [f.rid for f in r.sent(Finished)] == ["a"]
    assert (r.bye().reason, r.bye().drained, r.bye().aborted) == ("evict", 1, 0)
    assert r.bye().phases["total"] == 3 * STEP_S + 0.625  # steps, close, settle: no idle wait once drained


def test_evict_now_aborts_every_request_at_once() -> None:
    r = rig(sub("a"), sub("b"))
    r.engine.after_step[1] = lambda: r.channel.put(Evict("now", 10))
    assert r.loop.run() == EXIT_OK
    assert r.engine.steps == 1  # aborted before another step
    failed = r.failed()
    assert set(failed) == {"a", "b"} and {f.code for f in failed.values()} == {MODEL_EVICTED}
    assert "evicted (evict)" in failed["a"].message
    bye = r.bye()
    assert (bye.aborted, bye.drained) == (2, 0) and "abort" in bye.phases


def test_drain_lets_requests_finish_until_the_deadline_then_aborts_the_rest() -> None:
    r = rig(sub("short", 3), sub("long"), Evict("drain", 4 * STEP_S))
    assert r.loop.run() == EXIT_OK
    assert r.engine.steps == 4  # the long one ran until the deadline, not a step more or less
    assert [f.rid for f in r.sent(Finished)] == ["short"]
    assert r.failed()["long"].code == MODEL_EVICTED
    bye = r.bye()
    assert (bye.drained, bye.aborted) == (1, 1) and bye.phases["drain"] == pytest.approx(STEP_S)


def test_closing_phases_run_in_order_and_bye_carries_their_times() -> None:
    r = rig(Evict("now", 0))
    assert r.loop.run() == EXIT_OK
    assert r.engine.calls == ["close_caches", "settle"]
    bye = r.bye()
    assert bye.phases["close_caches"] == 0.5 and bye.phases["settle"] == 0.125
    assert bye.phases["total"] >= 0.625 and bye.memory_bytes == 777


@pytest.mark.parametrize("phase", ["close_caches", "settle"])
def test_a_failing_phase_is_logged_and_the_next_still_runs(phase: str, caplog: pytest.LogCaptureFixture) -> None:
    r = rig(sub("a", 2), Evict("drain", 10))
    r.engine.phase_error = phase
    with caplog.at_level(logging.ERROR):
        assert r.loop.run() == EXIT_OK
    assert r.engine.calls[-2:] == ["close_caches", "settle"]
    bye = r.bye()
    assert bye.drained == 1 and set(bye.phases) >= {"close_caches", "settle", "total"}
    assert bye.memory_bytes == (0 if phase == "settle" else 777)
    assert f"phase={phase} failed" in caplog.text


def test_sigterm_aborts_at_once_and_says_bye() -> None:
    r = rig(sub("a"))
    r.engine.after_step[2] = r.shutdown.on_sigterm
    assert r.loop.run() == EXIT_OK
    assert r.engine.steps == 2
    assert r.failed()["a"].code == MODEL_EVICTED and "(sigterm)" in r.failed()["a"].message
    assert (r.bye().reason, r.bye().aborted) == ("sigterm", 1)


def test_sigterm_on_an_idle_worker_exits() -> None:
    r = rig()
    r.channel.when_idle.append(r.shutdown.on_sigterm)
    assert r.loop.run() == EXIT_OK and r.bye().reason == "sigterm"


def test_sigterm_does_not_cut_a_drain_short() -> None:
    r = rig(sub("a", 5), Evict("drain", 60))
    r.engine.after_step[1] = r.shutdown.on_sigterm
    assert r.loop.run() == EXIT_OK
    assert [f.rid for f in r.sent(Finished)] == ["a"] and not r.failed()
    assert (r.bye().reason, r.bye().drained) == ("evict", 1)


def test_a_lost_parent_aborts_and_exits_without_bye() -> None:
    r = rig(sub("a"))
    r.engine.after_step[1] = r.shutdown.on_parent_gone
    assert r.loop.run() == EXIT_PARENT_GONE
    assert r.failed()["a"].code == MODEL_EVICTED and "(parent_gone)" in r.failed()["a"].message
    assert not r.sent(Bye)  # nobody is left to hear it
    assert r.engine.calls[-2:] == ["close_caches", "settle"]


def test_a_lost_parent_overrides_a_drain() -> None:
    r = rig(sub("a"), Evict("drain", 60))
    r.engine.after_step[2] = r.shutdown.on_parent_gone
    assert r.loop.run() == EXIT_PARENT_GONE
    assert r.engine.steps == 2 and r.failed()["a"].code == MODEL_EVICTED and not r.sent(Bye)


def test_a_second_now_evict_tightens_a_drain() -> None:
    r = rig(sub("a"), Evict("drain", 60))
    r.engine.after_step[2] = lambda: r.channel.put(Evict("now", 0))
    assert r.loop.run() == EXIT_OK
    assert r.engine.steps == 2  # not the 240 steps of the drain's deadline
    assert r.failed()["a"].code == MODEL_EVICTED and r.bye().aborted == 1


# --- failures -----------------------------------------------------------------------------


def test_an_unexpected_exception_fails_every_request_with_worker_crashed() -> None:
    r = rig(sub("a"), sub("b"), faults=("crash-in-loop",))
    with pytest.raises(RuntimeError, match="fault: crash-in-loop"):
        r.loop.run()
    failed = r.failed()
    assert set(failed) == {"a", "b"} and {f.code for f in failed.values()} == {WORKER_CRASHED}
    assert "RuntimeError: fault: crash-in-loop" in failed["a"].message
    assert not r.sent(Bye)


@pytest.mark.parametrize("how", ["engine", "fault"])
def test_a_step_that_raises_fails_the_batch_and_ends_the_loop(how: str) -> None:
    r = rig(sub("a"), sub("b"), faults=("step-raises",) if how == "fault" else ())
    if how == "engine":
        r.engine.step_error = RuntimeError("the generator broke")
    with pytest.raises(RuntimeError):
        r.loop.run()
    assert [f.rid for f in r.sent(Failed)] == ["a", "b"]  # one each: not again as worker_crashed
    assert {f.code for f in r.sent(Failed)} == {INTERNAL_ERROR}
    assert all(f.message.startswith("generation failed: ") for f in r.sent(Failed))
    assert r.engine.steps == 1 and not len(r.engine) and not r.sent(Tokens)


def test_a_rejected_submit_gets_its_code_and_the_worker_goes_on() -> None:
    r = rig(sub("long"), sub("odd"), sub("a", 2), Evict("drain", 10))
    r.engine.reject = {"long": RequestRejected(CONTEXT_LENGTH_EXCEEDED, "too long"), "odd": ValueError("odd")}
    assert r.loop.run() == EXIT_OK
    failed = r.failed()
    assert (failed["long"].code, failed["long"].message) == (CONTEXT_LENGTH_EXCEEDED, "too long")
    assert failed["odd"].code == INTERNAL_ERROR and "odd" in failed["odd"].message
    assert [f.rid for f in r.sent(Finished)] == ["a"]


def test_bad_frames_are_dropped_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    foreign = bytes(msgpack.packb({"v": PROTOCOL_VERSION + 1, "k": "abort", "rid": "x"}))
    r = rig(b"\xc1garbage", foreign, Load(["--model-id", "x"]), sub("a", 2), Evict("drain", 10))
    with caplog.at_level(logging.WARNING):
        assert r.loop.run() == EXIT_OK
    assert [f.rid for f in r.sent(Finished)] == ["a"]
    assert "dropped a malformed message" in caplog.text and "refused a message" in caplog.text
    assert "unexpected message kind=load" in caplog.text


def test_abort_withdraws_a_request_without_a_word() -> None:
    r = rig(sub("a"))
    r.engine.after_step[1] = lambda: r.channel.put(Abort("a"), Evict("drain", 10))
    assert r.loop.run() == EXIT_OK
    assert "abort a" in r.engine.calls and not r.failed() and not r.sent(Finished)
    assert (r.bye().aborted, r.bye().drained) == (0, 0)


def test_idle_work_runs_a_step_per_turn_only_after_a_quiet_second_with_nothing_in_flight_or_waiting() -> None:
    r = rig()
    start = r.clock.now
    r.engine.warm_steps = 5
    warm = r.engine.warm_step
    warmed_at: list[float] = []

    def warm_then_arrive() -> bool:
        warmed_at.append(r.clock.now)
        more = warm()
        if len(warmed_at) == 2:
            r.channel.put(sub("a", 3))  # arrives during the second step of idle work
        if not more:
            r.channel.put(Evict("drain", 10))
        return more

    r.engine.warm_step = warm_then_arrive  # type: ignore[method-assign]
    done_at: list[float] = []
    r.engine.after_step[3] = lambda: (r.engine.calls.append("a done"), done_at.append(r.clock.now))
    assert r.loop.run() == EXIT_OK
    # the request is taken before the next step of idle work, which waits until it is done and a quiet second
    # has passed; idle work starts a quiet second after start-up too
    assert r.engine.calls[:7] == ["warm", "warm", "submit a", "a done", "warm", "warm", "warm"]
    assert warmed_at[0] >= start + IDLE_WORK_QUIET_S and warmed_at[2] >= done_at[0] + IDLE_WORK_QUIET_S
    assert warmed_at[2] < done_at[0] + IDLE_WORK_QUIET_S + 0.1  # and not much later: no full idle sleeps
    assert [f.rid for f in r.sent(Finished)] == ["a"]


# --- what the loop reports ----------------------------------------------------------------


def test_heartbeats_carry_the_engine_figures_once_an_interval() -> None:
    r = rig(sub("a", 9), sub("b", 9), sub("c", 12), heartbeat_s=1.0, caches=FakeCaches())
    r.engine.after_step[12] = lambda: r.channel.put(Evict("now", 0))
    figures: list[tuple] = []  # the engine's figures as each message left, and the time

    def watch(msg: Message) -> None:
        e = r.engine
        figures.append((len(e), e.waiting(), e.batch_size(), e.peak_batch_size, e.generated_tokens, r.clock()))

    r.channel.watch = watch
    assert r.loop.run() == EXIT_OK
    beats = [(m, f) for m, f in zip(r.channel.sent, figures) if isinstance(m, Heartbeat)]
    assert len(beats) == 4  # at 0, 1, 2 and 3 s of 12 steps of 0.25 s
    for beat, (active, waiting, batch, peak, generated, _) in beats:
        assert (beat.active, beat.waiting, beat.batch_size, beat.max_batch_size, beat.generated_tokens,
                beat.memory_bytes) == (active, waiting, batch, peak, generated, 4242)
    assert any(b.active == 3 and b.waiting == 1 and b.generated_tokens > 0 for b, _ in beats)
    times = [f[-1] for _, f in beats]
    assert all(b - a >= 1.0 for a, b in zip(times, times[1:]))
    follows = [r.channel.sent[i + 1] for i, m in enumerate(r.channel.sent) if isinstance(m, Heartbeat)]
    assert all(isinstance(m, CacheStats) for m in follows)


def test_step_started_is_announced_only_for_steps_predicted_long() -> None:
    r = rig(sub("a", 5), Evict("drain", 60), heartbeat_s=1.0)
    r.engine.predictions.extend([0.9, 0.1, 0.6, 0.5, 0.2])
    assert r.loop.run() == EXIT_OK
    assert [s.predicted_s for s in r.sent(StepStarted)] == [0.9, 0.6]
    kinds = [type(m) for m in r.channel.sent if isinstance(m, (StepStarted, Tokens))]
    assert kinds == [StepStarted, Tokens, Tokens, StepStarted, Tokens, Tokens, Tokens]  # each before its step


@pytest.mark.parametrize("caches, which, answer", [
    (FakeCaches(cleared=(3, 4096)), "hot", (3, 4096)),
    (FakeCaches(error=OSError("disk")), "ssd", (0, 0)),
    (FakeCaches(), "cold", (0, 0)),  # not a tier: refused, the caches not asked
    (None, "hot", (0, 0)),
])
def test_clear_cache_is_answered_with_cache_cleared(caches: FakeCaches | None, which: str,
                                                    answer: tuple[int, int]) -> None:
    r = rig(ClearCache("c1", which), Evict("now", 0), caches=caches)
    assert r.loop.run() == EXIT_OK
    (cleared,) = r.sent(CacheCleared)
    assert (cleared.rid, cleared.which, cleared.entries, cleared.reclaimed_bytes) == ("c1", which, *answer)
    if caches is not None:
        assert caches.asked == ([] if which == "cold" else [which])
        after = r.channel.sent[r.channel.sent.index(cleared) + 1]
        assert isinstance(after, CacheStats)  # fresh figures follow


def test_tokenize_is_answered_between_steps_without_generating_or_touching_the_batch() -> None:
    r = rig(sub("a", 3), Tokenize("t1", messages=[{"role": "user", "content": "hello"}]),
            Tokenize("t2", prompt="abc", ids=True), Evict("drain", 10))
    assert r.loop.run() == EXIT_OK
    assert [(t.rid, t.count, t.ids, t.code) for t in r.sent(Tokenized)] == [
        ("t1", 5, [], None), ("t2", 3, [97, 98, 99], None)]
    assert r.engine.generated_tokens == 3 and r.engine.steps == 3  # request a's own tokens and steps only
    assert [f.rid for f in r.sent(Finished)] == ["a"]
    assert [c for c in r.engine.calls if c.startswith(("submit", "tokenize"))] == [
        "submit a", "tokenize t1", "tokenize t2"]


def test_a_tokenize_the_engine_refuses_is_answered_with_its_code_and_the_worker_goes_on() -> None:
    r = rig(Tokenize("bad", prompt="x"), Tokenize("odd", prompt="x"), Tokenize("ok", prompt="xy"), Evict("now", 0))
    r.engine.reject = {"bad": RequestRejected(CONTEXT_LENGTH_EXCEEDED, "template says no"), "odd": ValueError("odd")}
    assert r.loop.run() == EXIT_OK
    answers = {t.rid: t for t in r.sent(Tokenized)}
    assert (answers["bad"].count, answers["bad"].code, answers["bad"].message) == (0, CONTEXT_LENGTH_EXCEEDED,
                                                                                    "template says no")
    assert answers["odd"].code == INTERNAL_ERROR and "odd" in answers["odd"].message
    assert (answers["ok"].count, answers["ok"].code) == (2, None)
    assert not r.sent(Failed)


def test_announce_sends_ready_then_the_cache_figures() -> None:
    r = rig(caches=FakeCaches())
    r.loop.announce()
    ready, stats = r.channel.sent
    assert isinstance(ready, Ready) and isinstance(stats, CacheStats)
    assert (ready.model_id, ready.context_length, ready.vocab_size, ready.memory_bytes) == ("m", 4096, 100, 4242)


def test_the_foreign_protocol_fault_announces_another_version_only() -> None:
    r = rig(caches=FakeCaches(), faults=("foreign-protocol",))
    r.loop.announce()
    (frame,) = r.channel.frames  # Ready in the next version, and nothing after it
    with pytest.raises(VersionMismatch) as exc:
        decode(frame)
    assert exc.value.version == PROTOCOL_VERSION + 1


def test_every_fault_has_a_name_the_parser_takes_and_typos_are_refused() -> None:
    from worker.__main__ import parse_args

    for name in FAULTS:
        assert parse_args(["--endpoint", "e", "--identity", "i", "--spare", "--fault", name]).fault == [name]
    with pytest.raises(ValueError, match="unknown faults"):
        Faults(["crash-in-lop"])


def test_a_worker_runs_with_mlx_cudas_cache_thrashing_abort_off_unless_told_otherwise(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """MLX CUDA raises out of any op once a per-shape cache has missed 2x its size in the process's life (a crash
    for a long-running worker meeting new prompt lengths; bench/cuda_thrash.py on the GPU): the worker's
    environment turns that off before MLX is imported, and a value set by the user is kept."""
    from worker.__main__ import main, mlx_environment

    monkeypatch.setenv("MLX_ENABLE_CACHE_THRASHING_CHECK", "x")  # so the teardown restores what was there before
    monkeypatch.delenv("MLX_ENABLE_CACHE_THRASHING_CHECK")
    with pytest.raises(SystemExit):
        main(["--help"])  # the entry point sets it before its arguments are even parsed
    assert os.environ["MLX_ENABLE_CACHE_THRASHING_CHECK"] == "0"
    env: dict[str, str] = {"PATH": "/bin"}
    mlx_environment(env)
    assert env == {"PATH": "/bin", "MLX_ENABLE_CACHE_THRASHING_CHECK": "0"}
    mine = {"MLX_ENABLE_CACHE_THRASHING_CHECK": "1"}
    mlx_environment(mine)
    assert mine == {"MLX_ENABLE_CACHE_THRASHING_CHECK": "1"}


def test_a_burst_of_submits_is_admitted_together_before_the_next_step() -> None:
    """Issue 15: arrivals a few ms apart are prefilled in one step, not a few per step (a new batch shape each)."""
    r = rig(sub("a", 2))
    r.loop.admit_window_ms = 2
    r.channel.when_idle = [lambda: r.channel.put(sub("b", 2), sub("c", 2)),  # within a's window
                           lambda: r.channel.put(Evict("drain", 10))]
    assert r.loop.run() == EXIT_OK
    first = r.sent(Tokens)[0]
    assert sorted(chunk[0] for chunk in first.chunks) == ["a", "b", "c"]
    assert sorted(f.rid for f in r.sent(Finished)) == ["a", "b", "c"]


@pytest.mark.parametrize("more", [0, 5])
def test_a_submit_that_says_more_are_coming_waits_longer_for_them(more: int) -> None:
    """Issue 30: the gateway hands a burst over a request at a time, a few ms apart (its work on each), more than the
    admit window; a submit that says more are coming (Submit.more) waits burst_wait_ms for the next one instead."""
    r = rig(Submit("a", 2, prompt="p", more=more))
    r.loop.admit_window_ms, r.loop.burst_wait_ms = 2, 10
    start = r.clock.now

    def b_at_5_ms() -> None:  # arrives 5 ms after a: past the admit window, within the burst wait
        if r.clock.now - start >= 0.005:
            r.channel.put(sub("b", 2))
        else:
            r.channel.when_idle.insert(0, b_at_5_ms)

    r.channel.when_idle = [b_at_5_ms, lambda: r.channel.put(Evict("drain", 10))]
    assert r.loop.run() == EXIT_OK
    first = [chunk[0] for chunk in r.sent(Tokens)[0].chunks]
    assert first == (["a", "b"] if more else ["a"])
    assert sorted(f.rid for f in r.sent(Finished)) == ["a", "b"]


def test_with_streams_decoding_a_submit_that_says_more_are_coming_does_not_hold_them() -> None:
    """The burst wait is for an idle engine: with a stream decoding, the next arrival joins a step later, as
    the stream's next token would wait for it otherwise."""
    r = rig(sub("a", 3))
    r.loop.admit_window_ms, r.loop.burst_wait_ms = 2, 10
    r.engine.after_step = {1: lambda: r.channel.put(Submit("b", 2, prompt="p", more=5))}
    waits: list[int] = []
    wait = r.channel.wait
    r.channel.wait = lambda ms: waits.append(ms) or wait(ms)  # type: ignore[method-assign]
    r.channel.when_idle = [lambda: None, lambda: r.channel.put(Evict("drain", 10))]
    assert r.loop.run() == EXIT_OK
    assert 10 not in waits and 2 in waits  # b's admit window, not the burst wait
    assert sorted(f.rid for f in r.sent(Finished)) == ["a", "b"]


def test_without_an_admit_window_the_loop_steps_after_the_first_submit() -> None:
    r = rig(sub("a", 2))
    r.channel.when_idle = [lambda: r.channel.put(sub("b", 2)), lambda: r.channel.put(Evict("drain", 10))]
    r.engine.after_step = {1: lambda: r.channel.put(sub("c", 1))}
    assert r.loop.run() == EXIT_OK
    assert [chunk[0] for chunk in r.sent(Tokens)[0].chunks] == ["a"]


def test_a_steps_deferred_work_runs_after_its_messages_and_before_the_next_submit_is_read() -> None:
    """engine.after_send (the finished sequences' cache stores) runs once the step's Tokens and Finished are sent, and
    before the loop reads another message: a next turn's lookup finds what the last turn stored."""
    r = rig(sub("a", 2))
    seen: list[tuple[int, list[str]]] = []
    r.engine.on_after_send = lambda: seen.append((len(r.sent(Finished)), list(r.engine.calls)))
    r.engine.after_step[1] = lambda: r.channel.put(sub("b", 1))  # arrives during step 1
    r.engine.after_step[2] = lambda: r.channel.put(Evict("drain", 10))
    assert r.loop.run() == EXIT_OK
    assert r.engine.after_sends == r.engine.steps == 2
    assert seen[0] == (0, ["submit a"])  # after step 1: "b" not read yet
    assert seen[1] == (2, ["submit a", "submit b"])  # after step 2: both Finished already sent
