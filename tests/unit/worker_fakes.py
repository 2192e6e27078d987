"""Fakes for driving worker/loop.py without MLX or a process: a clock, the channel, the engine.

Time is a fake clock that the fake engine's steps and the channel's idle waits advance, so
deadlines, heartbeats and phase timings are exact. Frames go through the real codec both ways.
A test scripts what happens when with FakeEngine.after_step (after the engine's n-th step) and
FakeChannel.when_idle (when the loop waits on an empty inbox); a loop that would never end
stops with LoopDidNotEnd instead of hanging.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from protocol.codec import VersionMismatch, decode, encode
from protocol.messages import Bye, CacheStats, Failed, Finished, Message, Submit
from worker.faults import Faults
from worker.loop import WorkerLoop
from worker.shutdown import Shutdown
from worker.step_cost import StepPlan

M = TypeVar("M", bound=Message)
STEP_S = 0.25  # fake seconds per engine step: a power of two, so deadlines are met exactly


class LoopDidNotEnd(BaseException):  # not an Exception: the loop's own handlers must not catch it
    pass


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeChannel:
    """The supervisor's end in memory: frames queued for the loop, and every message it sent."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.inbox: deque[bytes] = deque()
        self.frames: list[bytes] = []
        self.sent: list[Message] = []
        self.when_idle: list[Callable[[], None]] = []  # run one per idle wait
        self.idle_waits = 0
        self.watch: Callable[[Message], None] = lambda msg: None  # sees each message as it leaves

    def put(self, *items: Message | bytes) -> None:
        self.inbox.extend(i if isinstance(i, bytes) else encode(i) for i in items)

    def send(self, frame: bytes) -> bool:
        self.frames.append(frame)
        try:
            msg = decode(frame)
        except VersionMismatch:  # only the foreign-protocol fault sends these
            return True
        self.watch(msg)
        self.sent.append(msg)
        return True

    def recv(self) -> bytes | None:
        return self.inbox.popleft() if self.inbox else None

    def wait(self, timeout_ms: int) -> bool:
        if not self.inbox and timeout_ms:
            self.clock.now += timeout_ms / 1000
            self.idle_waits += 1
            if self.when_idle:
                self.when_idle.pop(0)()
            elif self.idle_waits > 100:
                raise LoopDidNotEnd("the loop waits for ever on an empty inbox")
        return bool(self.inbox)


class FakeCaches:
    def __init__(self, cleared: tuple[int, int] = (3, 4096), error: Exception | None = None) -> None:
        self.cleared, self.error = cleared, error
        self.asked: list[str] = []

    def stats(self) -> CacheStats:
        return CacheStats(64, 3, 4096, 1 << 20, 1, 2, 64, False, 0, 0, 0, 0, 0, 0)

    def clear(self, which: str) -> tuple[int, int]:
        self.asked.append(which)
        if self.error:
            raise self.error
        return self.cleared


@dataclass
class FakeEngine:
    """One token "x" per request per step; a request ends (length) after its max_tokens."""

    clock: Clock
    caches: FakeCaches | None = None
    context_length: int = 4096
    vocab_size: int = 100
    weights_bytes: int = 1 << 20
    load_s: float = 0.5
    drafting: str = "off"
    priced: bool = False
    generated_tokens: int = 0
    peak_batch_size: int = 0
    left: dict[str, int] = field(default_factory=dict)  # rid -> tokens still to produce
    predictions: deque[float] = field(default_factory=deque)  # predicted_s of the next plans (default 0.01)
    after_step: dict[int, Callable[[], None]] = field(default_factory=dict)
    reject: dict[str, Exception] = field(default_factory=dict)  # rid -> what submit raises
    step_error: Exception | None = None
    phase_error: str | None = None  # "close_caches" or "settle" raises
    calls: list[str] = field(default_factory=list)
    steps: int = 0
    warm_steps: int = 0  # idle work left (warm_step)
    after_sends: int = 0
    on_after_send: Callable[[], None] = lambda: None

    @property
    def rids(self) -> list[str]:
        return list(self.left)

    def __len__(self) -> int:
        return len(self.left)

    def batch_size(self) -> int:
        return min(len(self.left), 2)

    def waiting(self) -> int:
        return len(self.left) - self.batch_size()

    def submit(self, msg: Submit) -> None:
        if msg.rid in self.reject:
            raise self.reject[msg.rid]
        self.calls.append(f"submit {msg.rid}")
        self.left[msg.rid] = msg.max_tokens

    def tokenize(self, msg: Submit) -> list[int]:
        """One token per character of the prompt (or of the messages' contents); `reject` applies as to submit."""
        if msg.rid in self.reject:
            raise self.reject[msg.rid]
        self.calls.append(f"tokenize {msg.rid}")
        text = msg.prompt if msg.prompt is not None else "".join(str(m.get("content", "")) for m in msg.messages or [])
        return [ord(c) % self.vocab_size for c in text]

    def abort(self, rid: str) -> bool:
        self.calls.append(f"abort {rid}")
        return self.left.pop(rid, None) is not None

    def plan_step(self) -> StepPlan:
        predicted = self.predictions.popleft() if self.predictions else 0.01
        return StepPlan(chunk=0, decoding=len(self.left), in_flight=len(self.left), prefill_tokens=0, attention=0.0,
                        predicted_s=predicted)

    def step(self) -> tuple[list[list], list[Finished]]:
        self.steps += 1
        if self.steps > 10_000:
            raise LoopDidNotEnd("the engine is still stepping")
        self.clock.now += STEP_S
        if self.step_error:
            raise self.step_error
        chunks, finished = [], []
        for rid in list(self.left):
            self.left[rid] -= 1
            self.generated_tokens += 1
            chunks.append([rid, "x", 1])
            if not self.left[rid]:
                del self.left[rid]
                finished.append(Finished(rid, "", "length", 1, 0))
        self.peak_batch_size = max(self.peak_batch_size, len(chunks))
        if self.steps in self.after_step:
            self.after_step[self.steps]()
        return chunks, finished

    def after_send(self) -> None:
        self.after_sends += 1
        self.on_after_send()

    def warm_step(self) -> bool:
        if self.warm_steps and not self.left:
            self.warm_steps -= 1
            self.calls.append("warm")
            self.clock.now += STEP_S
        return self.warm_steps > 0

    def fail_all(self, code: str, message: str) -> list[Failed]:
        failed = [Failed(rid, code, message) for rid in self.left]
        self.left.clear()
        return failed

    def close_caches(self) -> None:
        self._phase("close_caches", 0.5)

    def settle(self) -> int:
        self._phase("settle", 0.125)
        return 777

    def _phase(self, name: str, seconds: float) -> None:
        self.calls.append(name)
        self.clock.now += seconds
        if self.phase_error == name:
            raise OSError(f"{name} broke")


@dataclass
class Rig:
    clock: Clock
    channel: FakeChannel
    engine: FakeEngine
    shutdown: Shutdown
    loop: WorkerLoop

    def sent(self, kind: type[M]) -> list[M]:
        return [m for m in self.channel.sent if isinstance(m, kind)]

    def failed(self) -> dict[str, Failed]:
        return {f.rid: f for f in self.sent(Failed)}

    def bye(self) -> Bye:
        assert isinstance(self.channel.sent[-1], Bye), "Bye is the last message"
        return self.channel.sent[-1]


def rig(*inbox: Message | bytes, heartbeat_s: float = 1.0, faults: tuple[str, ...] = (),
        caches: FakeCaches | None = None) -> Rig:
    clock = Clock()
    channel, engine, shutdown = FakeChannel(clock), FakeEngine(clock, caches), Shutdown(clock)
    channel.put(*inbox)
    loop = WorkerLoop(channel, engine, "m", shutdown, heartbeat_s=heartbeat_s, faults=Faults(faults),
                      clock=clock, memory=lambda: 4242)
    return Rig(clock, channel, engine, shutdown, loop)


def sub(rid: str, tokens: int = 1000) -> Submit:
    return Submit(rid, tokens, prompt="p")
