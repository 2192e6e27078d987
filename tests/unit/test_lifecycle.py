"""The Lifecycle (supervisor/lifecycle.py) alone, against the fakes of test_router.py and a listener that
records the events it is told (core_api.LifecycleEvents): no Router, no Resumption, no Admission.
Each test names, in its docstring, the handling it would catch missing."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

from protocol.messages import Evict, Ready, Standby
from supervisor import errors
from supervisor.config import Settings
from supervisor.gateway.metrics import Metrics
from supervisor.lifecycle import Lifecycle
from supervisor.registry import ModelSpec, Registry
from supervisor.workers import State, Stream, Worker
from tests.unit.test_router import (  # noqa: F401 - strict_states: its autouse fixture
    MIB,
    FakeClock,
    FakeMemory,
    FakeProcess,
    FakeTransport,
    fake,
    next_event,
    scenario,
    settle,
    strict_states,
)


class HangableProcess(FakeProcess):
    async def kill_after_stack_dump(self, timeout_s: float, why: str) -> None:
        self.signal(signal.SIGKILL, why)  # the stacks are the real process's business


class Listener:
    """Records each event with what the worker looked like when it was told; keeps the streams it is asked to."""

    def __init__(self) -> None:
        self.heard: list[tuple[Any, ...]] = []
        self.keep: set[str] = set()  # rids it takes out of a lost worker's streams (as a resume would)
        self.kept: list[Stream] = []

    def streams_lost(self, worker: Worker, error: errors.MlxsupError, cause: str | None) -> None:
        self.heard.append(("streams_lost", worker.spec.id, type(error).__name__, cause, sorted(worker.streams)))
        for rid in self.keep & set(worker.streams):
            self.kept.append(worker.streams.pop(rid))

    def evicting(self, worker: Worker, reason: str) -> None:
        self.heard.append(("evicting", worker.spec.id, reason, worker.state))

    def shutting_down(self, why: str) -> None:
        self.heard.append(("shutting_down", why))


class Alone:
    """A Lifecycle wired to fakes and a Listener."""

    def __init__(self, tmp_path: Path, **settings: Any) -> None:
        defaults = dict(state_dir=tmp_path, spare_workers=0, memory_ceiling_bytes=1000 * MIB, worker_overhead_bytes=0,
                        hang_timeout_s=1e6)
        self.settings = Settings(**{**defaults, **settings})
        self.clock, self.transport, self.processes = FakeClock(), FakeTransport(), list[FakeProcess]()
        specs = [ModelSpec("m", tmp_path, weights_bytes=100 * MIB)]
        self.lifecycle = Lifecycle(Registry({s.id: s for s in specs}), self.settings, transport=self.transport,
                                   spawn=self._spawn, memory=FakeMemory(), clock=self.clock, metrics=Metrics())
        self.listener = Listener()
        self.lifecycle.events = self.listener

    def _spawn(self, model_id: str, argv: list[str], log_path: Path) -> FakeProcess:
        process = HangableProcess(model_id, argv, log_path, pid=100 + len(self.processes))
        self.processes.append(process)
        return process

    async def ready_worker(self, *rids: str) -> tuple[Worker, list[Stream]]:
        """The model's worker, started, Ready, and running a stream for each rid."""
        worker = self.lifecycle.start_worker(self.lifecycle.registry.specs["m"])
        await settle()
        self.lifecycle.loaded(worker, Ready("m", worker.pid or 0, 8192, 1000, 1, 1, 0.1))
        streams = [Stream(rid) for rid in rids]
        worker.streams.update((s.rid, s) for s in streams)
        return worker, streams


@scenario
async def test_a_crash_tells_the_listener_first_and_fails_only_the_streams_it_left(tmp_path: Path) -> None:
    """Catches: streams failed before the listener could take the resumable ones; a stream it took failed too;
    a crash not named as one; a dead worker left in the tables."""
    w = Alone(tmp_path)
    worker, (kept, left) = await w.ready_worker("r1", "r2")
    w.listener.keep = {"r1"}
    fake(worker).exit(-9)
    await settle()
    assert w.listener.heard == [("streams_lost", "m", "WorkerDied", "crash", ["r1", "r2"])]
    assert w.listener.kept == [kept] and kept.queue.empty()
    assert isinstance(next_event(left), errors.WorkerDied) and worker.streams == {}
    assert worker.state is State.FAILED and worker.gone.is_set()
    assert "m" not in w.lifecycle.workers and worker.identity not in w.lifecycle.by_identity
    assert w.lifecycle.slots["m"].crashes == 1


@scenario
async def test_an_eviction_is_announced_once_before_the_move_and_its_end_names_no_cause(tmp_path: Path) -> None:
    """Catches: the listener told after the worker moved (a pressure suspension would see it evicting), or told
    twice when a second evict joins; an evicted worker's end taken for a crash (its requests would resume)."""
    w = Alone(tmp_path)
    worker, (stream,) = await w.ready_worker("r1")
    first = w.lifecycle.begin_evict(worker, "drain", 5.0, "pressure-hard")
    await settle()
    assert w.lifecycle.begin_evict(worker, "now", None, "api") is first  # joins, and tightens the drain
    assert w.listener.heard == [("evicting", "m", "pressure-hard", State.READY)]
    assert [m.mode for m in w.transport.to(worker, Evict)] == ["drain", "now"]
    fake(worker).exit(0)
    report = await asyncio.wait_for(first, 1)
    assert report.evicted and report.reason == "pressure-hard"
    assert w.listener.heard[-1] == ("streams_lost", "m", "ModelEvicted", None, ["r1"])
    assert isinstance(next_event(stream), errors.ModelEvicted) and worker.state is State.STOPPED


@scenario
async def test_a_hang_kill_ends_the_worker_with_the_cause_hang(tmp_path: Path) -> None:
    """Catches: a silent worker left running; its end reported as a crash (or as nothing) to the listener."""
    w = Alone(tmp_path, hang_timeout_s=10.0, housekeeping_s=1.0)
    w.lifecycle.boot()
    worker, _ = await w.ready_worker("r1")
    w.clock.advance(11.0)  # silent past the hang timeout: the next housekeeping kills it
    await settle()
    await asyncio.wait_for(worker.gone.wait(), 1)
    assert w.listener.heard == [("streams_lost", "m", "WorkerDied", "hang", ["r1"])]
    assert (worker.kill_reason or "").startswith("hung")
    await w.lifecycle.shutdown()


@scenario
async def test_shutdown_tells_the_listener_before_it_evicts(tmp_path: Path) -> None:
    """Catches: suspended requests left waiting through a shutdown (the listener never told, or told after
    the workers it would wait for are gone); a worker left running."""
    w = Alone(tmp_path)
    worker, _ = await w.ready_worker()
    shutting = asyncio.ensure_future(w.lifecycle.shutdown())
    await settle()
    assert w.listener.heard[:2] == [("shutting_down", "the server is shutting down"),
                                    ("evicting", "m", "shutdown", State.READY)]
    assert w.lifecycle.shutting_down
    fake(worker).exit(0)
    reports = await asyncio.wait_for(shutting, 1)
    assert [r.reason for r in reports] == ["shutdown"] and w.lifecycle.workers == {} and w.transport.closed


@scenario
async def test_a_refused_worker_fails_in_the_turn_it_is_refused_and_marks_the_model_failed(tmp_path: Path) -> None:
    """Catches: a refused worker that stays LOADING (every wait on its load would hang); one not killed; its
    exit taken for one crash among others (its next worker, of the same version, would be refused too)."""
    w = Alone(tmp_path)
    worker = w.lifecycle.start_worker(w.lifecycle.registry.specs["m"])
    await settle()
    fake(worker).reap_later = True
    w.lifecycle.refused(worker.identity, "protocol version 2")
    assert worker.state is State.FAILED and worker.ready.done() and fake(worker).signals == ["SIGKILL"]
    fake(worker).exit(-9)
    await settle()
    assert w.lifecycle.slots["m"].failed_until > w.clock.now and "m" not in w.lifecycle.workers


@scenario
async def test_the_spare_says_standby_and_a_stranger_is_not_the_spare(tmp_path: Path) -> None:
    """Catches: a spare's Standby lost (loads on it would wait for nothing), or another worker's frames taken
    for the spare's."""
    w = Alone(tmp_path, spare_workers=1)
    w.lifecycle.boot()
    await settle()
    spare = w.lifecycle.spare
    assert spare is not None and not spare.standing_by
    assert not w.lifecycle.on_spare_message(b"m#9", Standby(1))
    assert w.lifecycle.on_spare_message(spare.identity, Standby(1)) and spare.standing_by
    shutting = asyncio.ensure_future(w.lifecycle.shutdown())
    await settle()
    fake_spare = spare.process
    assert isinstance(fake_spare, FakeProcess)
    fake_spare.exit(0)
    await asyncio.wait_for(shutting, 1)


def test_the_context_cap_counts_the_kv_at_the_model_s_kv_bits(tmp_path: Path) -> None:
    """issue 53: a ceiling that leaves room for N tokens of 16-bit K/V leaves ~1.9N at 8 bits and ~3.6N at 4
    (each element at its bits, each group of 64 a 16-bit scale and bias), each within a block of the count."""
    from protocol.modelconfig import kv_bytes_at
    from supervisor.cache_config import CacheConfig

    n, per_token = 8192, 2 * 2 * 4 * 64 * 2  # 2 layers, K and V, 4 kv heads of 64, float16
    caps = {}
    for bits in (0, 8, 4):
        spec = ModelSpec("m", tmp_path, weights_bytes=100 * MIB, kv_bytes_per_token=per_token, kv_dtype_bytes=2,
                         cache=CacheConfig(kv_bits=bits))
        settings = Settings(state_dir=tmp_path, spare_workers=0, memory_ceiling_bytes=100 * MIB + n * per_token,
                            worker_overhead_bytes=0)
        lifecycle = Lifecycle(Registry({"m": spec}), settings, transport=FakeTransport(), spawn=lambda *a: None,
                              memory=FakeMemory(), clock=FakeClock(), metrics=Metrics())
        caps[bits] = lifecycle.context_cap(spec)
    assert caps[0] == n
    assert kv_bytes_at(per_token, 2, 8) == 1024 + 64 and kv_bytes_at(per_token, 2, 4) == 512 + 64
    assert abs(caps[8] - n * per_token / 1088) < 64 and caps[8] > 1.8 * n
    assert abs(caps[4] - n * per_token / 576) < 64 and caps[4] > 3.5 * n


def test_admission_counts_a_first_request_s_kv_at_the_model_s_kv_bits(tmp_path: Path) -> None:
    """issue 53. Catches: the estimate admission decides on counting the first request's K/V (kv_tokens of it) at
    full precision for a model whose running cache is quantized: a model that fits at 8 bits refused for the bytes
    16 would take (and the context cap, past that estimate, short by as much)."""
    from protocol.modelconfig import kv_bytes_at
    from supervisor import policy
    from supervisor.cache_config import CacheConfig

    per_token, tokens, logits = 2 * 2 * 4 * 64 * 2, 2048, 3 * MIB  # 2 layers, K and V, 4 kv heads of 64, float16
    estimates = {}
    for bits in (0, 8, 4):
        spec = ModelSpec("m", tmp_path, weights_bytes=100 * MIB, runtime_bytes=tokens * per_token + logits,
                         kv_bytes_per_token=per_token, kv_dtype_bytes=2, kv_tokens=tokens,
                         cache=CacheConfig(kv_bits=bits))
        ceiling = 100 * MIB + logits + tokens * kv_bytes_at(per_token, 2, 8)  # the 8-bit first request's, no more
        settings = Settings(state_dir=tmp_path, spare_workers=0, memory_ceiling_bytes=ceiling, worker_overhead_bytes=0)
        lifecycle = Lifecycle(Registry({"m": spec}), settings, transport=FakeTransport(), spawn=lambda *a: None,
                              memory=FakeMemory(), clock=FakeClock(), metrics=Metrics())
        estimates[bits] = lifecycle.estimate(spec)
        admitted = not policy.admit(estimates[bits], lifecycle.views(), lifecycle.ceiling, None).refused
        assert admitted == (bits != 0), bits
    assert estimates[0] == 100 * MIB + tokens * per_token + logits
    assert estimates[8] == 100 * MIB + tokens * (1024 + 64) + logits
    assert estimates[4] == 100 * MIB + tokens * (512 + 64) + logits
