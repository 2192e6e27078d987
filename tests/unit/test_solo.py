"""A request alone runs the generate_step way, and joins the batch when a second one comes (issue 15).

Real MLX on the CPU, the tiny model, the product's Engine driven by submit/step (no sockets).
Greedy ids must be mlx_lm.stream_generate's in one process on the solo path, across the switch
into the batch at every point (mid-prefill, at the first token, mid-decode, on the last token),
and for the request that caused the switch; a solo's finished cache feeds the prompt caches.
"""

from __future__ import annotations

import threading
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load, stream_generate

from protocol.messages import Submit
from tests.unit import mlx_streams
from worker.mlx_engine.decode_graph import solo_modes
from worker.mlx_engine.engine import DECODE_PLAN_STEPS, Engine
from worker.mlx_engine.prompt_cache import CacheOptions
from worker.mlx_engine.solo import Ahead, Solo
from worker.pace import Pace

LONG = [(i * 7919) % 1000 + 3 for i in range(150)]
OTHER = [5, 9, 17, 33, 2, 41, 8]
# A step target no step misses: every prefill chunk is the prefill_step_size cap, whatever this machine's speed (the
# engine sizes a chunk to the step target from the measured speed, and a loaded machine's would be smaller). For the
# tests whose point is where in a request a step falls, not the sizing.
ANY_STEP_S = 1e9


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> object:
    model, tok = load(str(model_dir / "tiny"))

    def tokens(ids: list[int], max_tokens: int) -> list[int]:
        responses = list(stream_generate(model, tok, ids, max_tokens=max_tokens))
        out = [r.token for r in responses]
        return out[:-1] if responses[-1].finish_reason == "stop" else out  # the EOS is not output

    return tokens


def collect(engine: Engine, got: dict[str, list[int]], steps: int | None = None) -> None:
    """Step (`steps` times, or until idle), adding each request's generated ids to `got`."""
    n = 0
    while len(engine) and (steps is None or n < steps):
        chunks, finished = engine.step()
        for chunk in chunks:
            got.setdefault(chunk[0], []).extend(chunk[3])
        for f in finished:
            got.setdefault(f.rid, []).extend(f.token_ids)
            got.setdefault("finished", []).append(f.rid)  # type: ignore[arg-type]
        n += 1


def submit(engine: Engine, rid: str, ids: list[int], max_tokens: int) -> None:
    engine.submit(Submit(rid=rid, max_tokens=max_tokens, prompt_ids=ids, temperature=0.0))


@pytest.mark.parametrize("solo", ["auto", "ahead"])
def test_a_request_alone_never_enters_the_batch_and_matches_mlx_lm(model_dir: Path, reference, solo: str) -> None:
    engine = Engine(model_dir / "tiny", cache=CacheOptions(hot_bytes=1 << 28), solo=solo)
    got: dict[str, list[int]] = {}
    submit(engine, "a", LONG, 20)
    for _ in range(100):  # its prefill's chunks are sized to the measured speed: a loaded machine takes more steps
        collect(engine, got, steps=1)
        if len(got.get("a", [])) >= 2:
            break
    assert engine.batch_size() == 1 and len(engine.gen._generation_batch) == 0  # decoding, outside the generator
    collect(engine, got)
    assert got["a"] == reference(LONG, 20)

    submit(engine, "again", LONG, 20)  # its finished cache went to the hot cache (its partial last block too): a solo from all but the last token
    finished = []
    while len(engine):
        chunks, done = engine.step()
        got.setdefault("again", []).extend(i for c in chunks for i in c[3])
        finished += done
    got["again"] += finished[0].token_ids
    assert finished[0].cached_tokens == 149 and got["again"] == got["a"]


@pytest.mark.parametrize("solo", ["auto", "ahead"])
@pytest.mark.parametrize("steps_alone", [1, 3, 4, 6, 8], ids=lambda n: f"after{n}")
def test_switching_into_the_batch_loses_and_repeats_nothing(model_dir: Path, reference, steps_alone: int,
                                                           solo: str) -> None:
    """With prefill chunks of 64 (the cap, pinned: ANY_STEP_S), LONG is prefilled in 3 steps and its 6 tokens come out
    at steps 4..9: the switch comes mid-prefill (1), with the prefill done (3), after the first token (4), mid-decode
    (6: ahead, with the next graph built), and with its last token in flight (8)."""
    engine = Engine(model_dir / "tiny", prefill_step_size=64, step_target_s=ANY_STEP_S, solo=solo)
    got: dict[str, list[int]] = {}
    submit(engine, "a", LONG, 6)
    collect(engine, got, steps=steps_alone)
    assert engine._solo is not None  # still alone: the switch is what is tested
    assert len(got.get("a", [])) == max(0, steps_alone - 3)
    submit(engine, "b", OTHER, 10)
    collect(engine, got)
    assert got["a"] == reference(LONG, 6)
    assert got["b"] == reference(OTHER, 10)
    assert sorted(got["finished"]) == ["a", "b"]  # type: ignore[type-var]


@pytest.mark.parametrize("solo", ["auto", "ahead"])
def test_a_stop_string_ends_a_solo_and_an_abort_drops_it(model_dir: Path, reference, solo: str) -> None:
    engine = Engine(model_dir / "tiny", solo=solo)
    expected = reference(OTHER, 12)
    text = engine.tokenizer.decode(expected[:4])
    engine.submit(Submit(rid="s", max_tokens=12, prompt_ids=OTHER, temperature=0.0, stop=[text[-2:]]))
    got: dict[str, list[int]] = {}
    collect(engine, got)
    assert got["finished"] == ["s"] and len(engine) == 0 and engine._solo is None
    assert got["s"] == expected[:len(got["s"])] and len(got["s"]) < 12

    submit(engine, "x", LONG, 8)
    collect(engine, got, steps=1)
    assert engine.abort("x") and len(engine) == 0 and engine._solo is None
    submit(engine, "y", OTHER, 5)  # the engine goes on
    collect(engine, got)
    assert got["y"] == reference(OTHER, 5)


def test_solo_decode_steps_are_timed_and_leave_the_cost_model_alone(model_dir: Path, reference) -> None:
    engine = Engine(model_dir / "tiny")
    submit(engine, "a", LONG, 12)
    got: dict[str, list[int]] = {}
    observed: list = []
    observe = engine.cost.observe
    engine.cost.observe = lambda plan, s: (observed.append(plan), observe(plan, s))  # type: ignore[method-assign]
    solo = engine._solo
    assert solo is not None
    while len(engine):
        engine.plan_step()  # as the worker loop does
        chunks, finished = engine.step()
        for chunk in chunks:
            got.setdefault(chunk[0], []).extend(chunk[3])
        for f in finished:
            got.setdefault(f.rid, []).extend(f.token_ids)
    assert got["a"] == reference(LONG, 12)
    t = solo.times
    assert t.tokens == 12 and t.feed > 0 and t.read >= 0 and t.outside > 0  # every decode step, split
    assert set(t.per_token_ms()) == {"feed", "read", "outside", "gc"}
    # the fits learnt from the prefill and from the step that read the first token (planned before it was decoding),
    # not from the eleven decode steps after it
    assert sum(p.prefill_tokens == 0 for p in observed) == 1 and any(p.prefill_tokens > 0 for p in observed)


def test_solo_modes_and_auto_leaves_the_graph_off_on_cuda(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert solo_modes("compiled") == (True, True, False) and solo_modes("plain") == (True, False, False)
    assert solo_modes("ahead") == (True, False, True) and solo_modes("off") == (False, False, False)
    assert solo_modes("auto") == (True, True, False)  # MLX on the CPU here: compiled
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    # the graph measured slower than plain decoding on an H200, and building ahead faster (bench/README.md)
    assert solo_modes("auto") == (True, False, True)
    with pytest.raises(ValueError):
        solo_modes("fast")
    plain = Engine(model_dir / "tiny", solo="plain")
    assert plain.solo_on and plain.graph is None


@pytest.mark.parametrize("solo", ["plain", "compiled"])
def test_a_solo_evaluates_on_the_generation_stream(model_dir: Path, reference, solo: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Every eval a solo's step schedules runs on mlx-lm's generation stream, as generate_step's loop does: an eval
    from another stream synchronises across the two every token (on MLX CUDA 1.18x generate_step's ITL)."""
    seen = mlx_streams.record(monkeypatch, "async_eval")
    engine = Engine(model_dir / "tiny", solo=solo)
    submit(engine, "a", LONG, 6)
    got: dict[str, list[int]] = {}
    collect(engine, got)
    assert got["a"] == reference(LONG, 6)
    assert len(seen) >= 6 and set(seen) == {mlx_streams.generation()}


def test_a_batch_decode_step_reuses_its_plan_for_the_same_work_and_every_step_still_teaches_the_fits(
        model_dir: Path) -> None:
    engine = Engine(model_dir / "tiny", solo="off")
    for rid in ("a", "b"):
        submit(engine, rid, OTHER, 40)
    made, observed = [], []
    plan, observe = engine.cost.plan, engine.cost.observe
    engine.cost.plan = lambda work: (made.append(work), plan(work))[1]  # type: ignore[method-assign]
    engine.cost.observe = lambda p, s: (observed.append(p), observe(p, s))  # type: ignore[method-assign]
    steps = 0
    while len(engine):
        engine.plan_step()
        engine.step()
        steps += 1
    decode = [w for w in made if not w.prefill]
    # 2 decoding (1 in flight after the first decode step, then 2): a plan made once per DECODE_PLAN_STEPS steps
    assert 1 <= sum(w.decoding == 2 and w.in_flight == 2 for w in decode) <= -(-steps // DECODE_PLAN_STEPS) + 1
    assert len(made) < steps and len(observed) == steps  # fewer plans made than steps; each step observed


def test_with_deferred_stores_a_finished_cache_is_stored_by_after_send(model_dir: Path) -> None:
    """Engine(defer_stores=True), as the worker builds it: the step that finishes a request returns without storing
    its cache (its client's last message goes first), after_send stores it, and the next request reuses it."""
    engine = Engine(model_dir / "tiny", cache=CacheOptions(hot_bytes=1 << 28), defer_stores=True)
    assert engine.caches is not None
    submit(engine, "a", LONG, 4)
    got: dict[str, list[int]] = {}
    collect(engine, got)
    prefilled = len(LONG) // 64  # its prompt's whole blocks, kept as its prefill computed them (checkpoints.py)
    assert got["finished"] == ["a"] and engine.caches.stats().hot_entries == prefilled
    engine.after_send()
    assert engine.caches.stats().hot_entries > prefilled  # the rest of its blocks
    submit(engine, "b", LONG + got["a"][:2], 2)
    assert engine._by_rid["b"].cached_tokens >= len(LONG) - 64


def test_while_others_decode_a_finished_cache_waits_for_the_next_lookup_or_idle_and_a_clear_drops_it(
        model_dir: Path) -> None:
    """A store stalls every stream still decoding: with deferred stores, after_send leaves a finished sequence's cache
    while other requests decode; the next submit's lookup stores it first (the conversation's next turn still hits),
    an idle engine stores it, and a clear of the caches in between drops it."""
    engine = Engine(model_dir / "tiny", cache=CacheOptions(hot_bytes=1 << 28), defer_stores=True, solo="off")
    assert engine.caches is not None
    submit(engine, "a", LONG, 2)
    submit(engine, "long", OTHER, 400)
    got: dict[str, list[int]] = {}
    while "finished" not in got:
        collect(engine, got, steps=1)
        engine.after_send()
    prefilled = len(LONG) // 64  # its prompt's whole blocks, kept as its prefill computed them (checkpoints.py)
    assert got["finished"] == ["a"] and len(engine) == 1 and engine.caches.stats().hot_entries == prefilled  # deferred
    submit(engine, "a2", LONG + got["a"], 2)  # the next turn: its lookup stores "a" first
    assert engine._by_rid["a2"].cached_tokens >= len(LONG) - 64 and not engine._stores

    while "a2" in engine._by_rid:
        collect(engine, got, steps=1)
        engine.after_send()
    assert "a2" in got["finished"] and "long" in engine._by_rid and len(engine._stores) == 1  # ended while "long" decodes
    engine.caches.clear("hot")  # what finished before the clear is not stored after it; "long", ending after, is
    collect(engine, got)
    engine.after_send()
    assert len(engine) == 0 and not engine._stores
    assert engine.caches.lookup(LONG + got["a"] + got["a2"])[0] == 0 and engine.caches.lookup(OTHER + got["long"])[0] > 0

    submit(engine, "b", OTHER, 2)
    collect(engine, got)
    engine.after_send()  # idle: stored at once
    assert engine.caches.stats().hot_entries > 0


class Builds(list):
    got: list[int]


def decode_alone_recording_builds(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Builds:
    """12 tokens of LONG alone; the name of the thread each decode graph was built on (and the ids, as `.got`)."""
    built = Builds()
    build = Solo._build
    monkeypatch.setattr(Solo, "_build", lambda self, ids: (built.append(threading.current_thread().name),
                                                          build(self, ids))[1])
    submit(engine, "a", LONG, 12)
    got: dict[str, list[int]] = {}
    collect(engine, got)
    built.got = got["a"]
    return built


def test_ahead_each_decode_graph_is_built_on_its_thread_while_the_last_one_launches(
        model_dir: Path, reference, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--solo ahead` (auto on CUDA): the graph that feeds a token is built on the Ahead thread while the main thread
    launches the graph that makes that token; the ids are mlx-lm's, and the graphs evaluate on the main thread (an
    eval of a graph on another thread's stream raises)."""
    engine = Engine(model_dir / "tiny", solo="ahead")
    built = decode_alone_recording_builds(engine, monkeypatch)
    assert built.got == reference(LONG, 12)
    # the graphs that feed the prompt's last token and the first token out on the main thread, then each a token ahead
    # until the one that makes the last token wanted: 12 graphs, 10 of them ahead
    assert built.count("mlxsup-ahead") == 10 and len(built) == 12 and built[:2] == ["MainThread"] * 2, built
    assert engine.lane.ahead is not None
    thread = engine.lane.ahead._thread
    engine.settle()
    assert thread is not None and not thread.is_alive()


class ScriptedPace(Pace):
    """A Pace whose way is scripted per decode step, recording what it is told."""

    def __init__(self, ways: list[bool]) -> None:
        super().__init__()
        self.ways, self.told, self.asked, self.begun = ways, [], 0, 0

    def begin(self) -> None:
        self.begun += 1

    def use(self) -> bool:
        self.asked += 1
        return self.ways[self.asked - 1]

    def record(self, seconds: float, way: bool) -> None:
        self.told.append((seconds, way))


def test_ahead_builds_only_in_the_steps_its_pace_says_and_tells_it_each_step_time(
        model_dir: Path, reference, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether a step builds the next graph ahead is the worker's Pace's choice, step by step (worker/pace.py: on the
    GPU host it pays in one of the host's speeds and costs in the other); the ids are mlx-lm's across every change
    of way, and the Pace is told each decode step's time in the way it ran."""
    engine = Engine(model_dir / "tiny", solo="ahead")
    assert engine.lane.ahead is not None and isinstance(engine.lane.ahead.pace, Pace)
    ways = [True, True, False, False, True, False, True, True, False, True]
    engine.lane.ahead.pace = pace = ScriptedPace(ways)
    built = decode_alone_recording_builds(engine, monkeypatch)
    assert built.got == reference(LONG, 12)
    # the decode steps of tokens 1..10 choose a way (the graph built in the 10th makes the 12th, the last wanted); a step
    # is told at the next one, if it ran wholly its way: built ahead after a step that built ahead (the 2nd, the 8th),
    # or not after one that did not (the 4th); the first built on the main thread as well
    assert pace.asked == 10 and [way for _, way in pace.told] == [True, False, True] and pace.begun == 1
    assert all(seconds > 0 for seconds, _ in pace.told)
    assert built.count("mlxsup-ahead") == ways.count(True), built
    engine.settle()


def test_ahead_a_solo_ended_by_an_eos_or_aborted_leaves_its_cache_as_plain_decoding_does(model_dir: Path) -> None:
    """A graph built ahead has fed one more token than plain decoding had when an EOS ends the request, a second
    request takes it into the batch or an abort drops it: it is undone (the offsets put back, as a trim would), so the
    finished cache, the batch's starting cache and the next solo are what they are without it."""
    model, _ = load(str(model_dir / "tiny"))
    plain_out = Solo(model, 0, LONG, 0, None, 30, None, None)
    ref = []
    while not (rs := plain_out.step(512)) or rs[-1].finish_reason is None:
        ref += [r.token for r in rs]
    ahead = Ahead()
    ahead.pace = None  # built ahead at every step, whatever the steps' times
    try:
        for at in (0, 1, 2, 7):  # an EOS as the first, second, third or a later token out
            ends = []
            for maker in (None, ahead):
                solo = Solo(model, 0, LONG, 0, None, 30, None, {ref[at]}, ahead=maker)
                out: list[int] = []
                while not (rs := solo.step(512)) or rs[-1].finish_reason is None:
                    out += [r.token for r in rs]
                r = rs[-1]
                assert r.prompt_cache is not None and r.all_tokens is not None
                c = r.prompt_cache[0]  # positions past the offset are unused, as a trim leaves them
                ends.append((out + [r.token], r.finish_reason, len(r.all_tokens), c.offset, c.keys[..., :c.offset, :]))
            (o1, f1, n1, off1, k1), (o2, f2, n2, off2, k2) = ends
            assert (o1, f1, n1, off1) == (o2, f2, n2, off2) and n1 == off1 and f1 == "stop"
            assert mx.array_equal(k1, k2).item()
        handed = []
        for maker in (None, ahead):  # taken into the batch with the next graph built ahead: the same hand-over
            solo = Solo(model, 0, LONG, 0, None, 30, None, None, ahead=maker)
            while solo.generated < 5:
                solo.step(512)
            assert (solo._saved is not None) == (maker is not None)
            pending, cache, fed, rest = solo.hand_over()
            assert pending is not None and cache is not None
            handed.append((pending.token, cache[0].offset, len(fed), rest))
        assert handed[0] == handed[1] and handed[0][1] == handed[0][2]
        released = []
        for maker in (None, ahead):  # ended by a stop string (the engine's release) with the next graph built ahead
            solo = Solo(model, 0, LONG, 0, None, 30, None, None, ahead=maker)
            while solo.generated < 5:
                solo.step(512)
            assert (solo._saved is not None) == (maker is not None)
            cache, fed = solo.release()
            released.append((cache[0].offset, len(fed), fed))
        assert released[0] == released[1] and released[0][0] == released[0][1]
    finally:
        ahead.close()

    engine = Engine(model_dir / "tiny", solo="ahead")
    submit(engine, "x", LONG, 20)
    got: dict[str, list[int]] = {}
    while engine._solo is None or engine._solo._saved is None:  # decoding, the next graph built ahead
        collect(engine, got, steps=1)
    assert engine.abort("x") and engine._solo is None and not engine.lane.ahead.pending
    submit(engine, "y", OTHER, 5)
    collect(engine, got)
    assert got["y"] == ref_ids(model_dir, OTHER, 5)


def ref_ids(model_dir: Path, ids: list[int], n: int) -> list[int]:
    model, tok = load(str(model_dir / "tiny"))
    return [r.token for r in stream_generate(model, tok, ids, max_tokens=n)]


def test_ahead_a_seeded_request_draws_what_it_draws_without_it_across_the_switch_into_the_batch(
        model_dir: Path) -> None:
    """A seeded request's sampler is a stream of draws that the batch goes on with after a switch; a graph built
    ahead and undone would have taken a draw from it, so a seeded solo never builds ahead."""
    outs = []
    for solo in ("plain", "ahead"):
        engine = Engine(model_dir / "tiny", prefill_step_size=64, step_target_s=ANY_STEP_S, solo=solo)
        engine.submit(Submit(rid="a", max_tokens=12, prompt_ids=LONG, temperature=1.0, seed=7))
        got: dict[str, list[int]] = {}
        collect(engine, got, steps=6)  # prefilled in 3 steps, 3 tokens out: mid-decode
        assert engine._solo is not None and len(got["a"]) == 3
        submit(engine, "b", OTHER, 4)
        collect(engine, got)
        outs.append(got["a"])
        engine.settle()
    assert outs[0] == outs[1] and len(outs[0]) == 12
