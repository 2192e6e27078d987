"""One worker OS process: spawn by exec, lifeline, stderr capture, kill ladder (ladder.py), reap.

Spawned with `python -m worker` (never fork: the supervisor's event loop, sockets and threads
must not be duplicated). stdin is a pipe the supervisor never writes: when the supervisor dies,
even by SIGKILL, the OS closes it and the worker sees EOF and exits (the lifeline, portable to
macOS where there is no parent-death signal). The worker runs in its own session so a terminal's
Ctrl-C reaches only the supervisor, which then orders the exit.

Before a hang kill, `dump_stacks` asks the worker for its Python stacks (DUMP_STACKS_SIGNAL, then
SIGCONT so a stopped worker can write them) and waits, bounded, until they are in its log.

Its stderr is read in chunks as they come (asyncio's SubprocessProtocol, no line limit) and split here,
a logged line cut at LINE_MAX_BYTES with the count of what was cut. Its exit is seen when asyncio's child
watcher reaps it, apart from its pipes: its output is read to its end, or for PIPE_LINGER_S at most after
the exit (a process it started may hold the pipe open for good), then `exited` is set.

Invariant: `exited` is set only after the process has been reaped, and always within PIPE_LINGER_S of
that. WorkerProcess is the real effects.WorkerHandle; the router makes one through the Spawn that
daemon.build_router gives it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import signal
import sys
import time
from logging.handlers import RotatingFileHandler
from pathlib import Path
from typing import cast

import psutil

from protocol.messages import DUMP_STACKS_SIGNAL, EXIT_CRASHED, EXIT_LOAD_FAILED, EXIT_PARENT_GONE
from supervisor.ladder import kill_ladder

log = logging.getLogger(__name__)

STDERR_TAIL_LINES = 40
LINE_MAX_BYTES = 8192  # a longer line of a worker's stderr is cut there, in the logs, with the count cut
PIPE_LINGER_S = 2.0  # how long after its exit a worker's stderr is still read (a child of it may hold it open)
STACK_DUMP_MARK = "(most recent call first)"  # faulthandler's header of each thread's stack
STACK_DUMP_QUIET_S = 0.1  # a dump is one burst: this long without a new line after it began ends it
LOG_MAX_BYTES = 10 * 2**20
LOG_BACKUPS = 3
WORKER_LOG_FORMAT = logging.Formatter("%(asctime)s %(message)s")


def one_gpu(base: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
    """A worker's environment: `base` (the supervisor's) with `extra` over it, and one CUDA device visible.

    MLX computes on the first visible device only, so a worker that sees one changes nothing there; on a
    host with several NVIDIA GPUs, a worker that saw them all crashed in MLX CUDA's allocator
    (`cudaMemcpy ... invalid argument` when a host-side array reused a cached device buffer; H200 x2, never
    on one GPU, never in a group, whose ranks see one GPU each). So: the first device the supervisor may use
    (its own CUDA_VISIBLE_DEVICES' first entry, else 0) unless `extra` names the device itself (a group's rank).
    No effect without CUDA (macOS, CPU hosts).
    """
    env = {**base, **extra}
    if "CUDA_VISIBLE_DEVICES" not in extra:
        visible = base.get("CUDA_VISIBLE_DEVICES")
        env["CUDA_VISIBLE_DEVICES"] = "0" if visible is None else visible.split(",")[0].strip()
    return env


async def set_within(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait for `event`; True if it was set within `timeout` (None: no limit)."""
    try:
        await asyncio.wait_for(event.wait(), timeout)
        return True
    except TimeoutError:
        return False


class Lines:
    """Bytes in, whole lines out, none longer than `cap` bytes: the rest of a longer line is counted, not kept.

    There is no line limit to overrun (a worker may log a megabyte on one line) and no unbounded buffer.
    """

    def __init__(self, cap: int = LINE_MAX_BYTES) -> None:
        self.cap = cap
        self._head = bytearray()
        self._cut = 0  # bytes of the current line beyond `cap`

    def feed(self, data: bytes) -> list[str]:
        lines: list[str] = []
        start = 0
        while True:
            end = data.find(b"\n", start)
            piece = data[start:] if end < 0 else data[start:end]
            room = max(0, self.cap - len(self._head))
            self._head += piece[:room]
            self._cut += max(0, len(piece) - room)
            if end < 0:
                return lines
            lines.append(self._line())
            start = end + 1

    def flush(self) -> list[str]:
        """The last line, if the output ended without a newline."""
        return [self._line()] if self._head or self._cut else []

    def _line(self) -> str:
        line = self._head.decode("utf-8", "replace").rstrip()
        if self._cut:
            line += f" ... [cut {self._cut} bytes]"
        self._head.clear()
        self._cut = 0
        return line


class _Pipes(asyncio.SubprocessProtocol):
    """The OS side of one WorkerProcess: its stderr in chunks as they come, its exit as soon as it is reaped."""

    def __init__(self, owner: WorkerProcess) -> None:
        self.owner = owner

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.owner._spawned(cast(asyncio.SubprocessTransport, transport))

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        self.owner._received(cast(bytes, data))

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if fd == 2:
            self.owner._stderr_closed()

    def process_exited(self) -> None:
        self.owner._process_exited()


class WorkerProcess:
    def __init__(self, model_id: str, argv: list[str], log_path: Path | None = None,
                 pid_dir: Path | None = None, env: dict[str, str] | None = None) -> None:
        self.model_id = model_id
        self.argv = argv
        self.env = env or {}  # over the supervisor's environment (a group's rank: its GPU)
        self.log_path = log_path
        self.pid_dir = pid_dir
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self.returncode: int | None = None
        self.started = asyncio.Event()  # set once the spawn succeeded or failed
        self.exited = asyncio.Event()
        self.signals_sent: list[str] = []
        self.kill_reason: str | None = None  # why this supervisor sent SIGKILL, for the reap log
        self._pid: int | None = None
        self._transport: asyncio.SubprocessTransport | None = None
        self._lines = Lines()
        self._stderr_open = True
        self._linger: asyncio.TimerHandle | None = None  # ends the reading of stderr a while after the exit
        self._sink: RotatingFileHandler | None = None
        self._sink_path: Path | None = None
        self._last_line_at = 0.0
        self._stack_dump: asyncio.Event | None = None  # set by the stderr pump when a requested dump begins

    @property
    def pid(self) -> int | None:
        return self._pid

    async def start(self) -> None:
        env = one_gpu(dict(os.environ, PYTHONUNBUFFERED="1"), self.env)
        try:
            await asyncio.get_running_loop().subprocess_exec(
                lambda: _Pipes(self), *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True)
        except OSError:
            self.exited.set()
            raise
        finally:
            self.started.set()

    def assign(self, model_id: str, log_path: Path | None) -> None:
        """A spare became this model's worker: its lines go to that model's log from now on."""
        self.model_id = model_id
        self.log_path = log_path

    # --- what the OS tells (_Pipes), each in its own loop turn, the spawn first ----------------

    def _spawned(self, transport: asyncio.SubprocessTransport) -> None:
        self._transport = transport
        self._pid = transport.get_pid()
        log.info("[spawn] model=%s pid=%d", self.model_id, self._pid)
        if self.pid_dir is not None:  # so the next start can reap it if this supervisor dies hard
            self._pidfile().write_text(json.dumps({"pid": self._pid, "model": self.model_id}))

    def _received(self, data: bytes) -> None:
        for line in self._lines.feed(data):
            self._line(line)

    def _line(self, line: str) -> None:
        """One line of the worker's stderr -> its tail, the model's own rotated log, the supervisor's log."""
        self.stderr_tail.append(line)
        self._last_line_at = time.monotonic()
        if self._stack_dump is not None and STACK_DUMP_MARK in line:
            self._stack_dump.set()
        if self.log_path != self._sink_path:
            if self._sink:
                self._sink.close()
            self._sink_path = self.log_path
            self._sink = RotatingFileHandler(self._sink_path, maxBytes=LOG_MAX_BYTES, backupCount=LOG_BACKUPS) \
                if self._sink_path else None
            if self._sink:  # the worker writes no time stamp: each line gets one here, as it arrives
                self._sink.setFormatter(WORKER_LOG_FORMAT)
        if self._sink:
            self._sink.emit(logging.makeLogRecord({"msg": line}))
        log.info("[%s pid=%d] %s", self.model_id, self._pid, line)

    def _stderr_closed(self) -> None:
        for line in self._lines.flush():
            self._line(line)
        self._stderr_open = False
        if self._sink:
            self._sink.close()
            self._sink = None
        if self.returncode is not None:
            self._reaped()

    def _process_exited(self) -> None:
        """Reaped (by asyncio's child watcher), whether or not its stderr is still open."""
        assert self._transport is not None
        self.returncode = self._transport.get_returncode()
        if not self._stderr_open:
            self._reaped()
        else:  # the rest of its output, if it comes soon; a child of it may hold the pipe open for good
            self._linger = asyncio.get_running_loop().call_later(PIPE_LINGER_S, self._stop_reading)

    def _stop_reading(self) -> None:
        log.warning("[reap] model=%s pid=%s exited %.1fs ago and its stderr is still open (held by a process it "
                    "started?): no longer read", self.model_id, self._pid, PIPE_LINGER_S)
        assert self._transport is not None
        self._transport.close()  # closes our ends of its pipes: _stderr_closed follows

    def _reaped(self) -> None:
        """Its exit and the end of its output: logged, and `exited` set."""
        if self._linger is not None:
            self._linger.cancel()
        assert self._transport is not None
        self._transport.close()  # our end of its stdin (the lifeline) too
        if self.pid_dir is not None:
            self._pidfile().unlink(missing_ok=True)
        if self.returncode == -signal.SIGKILL and self.kill_reason is not None:
            log.warning("[reap] model=%s pid=%d SIGKILLed by the supervisor: %s", self.model_id, self._pid,
                        self.kill_reason)
        elif self.returncode == -signal.SIGKILL:
            log.error("[reap] model=%s pid=%d was SIGKILLed by another process (the OS out of memory? a user?)",
                      self.model_id, self._pid)
        else:
            log.info("[reap] model=%s pid=%d exit=%s", self.model_id, self._pid, self.returncode)
        self.exited.set()

    def _pidfile(self) -> Path:
        assert self.pid_dir is not None and self._pid is not None
        return self.pid_dir / f"worker-{self._pid}.json"

    def signal(self, sig: signal.Signals, why: str | None = None) -> None:
        """Send `sig`; `why` (required in spirit for SIGKILL) is what the reap log will say."""
        if self._transport is not None and self.returncode is None:
            if sig == signal.SIGKILL:
                self.kill_reason = why or "no reason given"
            try:
                self._transport.send_signal(sig)
                self.signals_sent.append(sig.name)
            except ProcessLookupError:
                pass

    async def dump_stacks(self, timeout_s: float) -> bool:
        """Ask the worker for every thread's Python stack, in its log; True once the dump arrived.

        faulthandler writes from the signal handler itself, so a loop stuck in C (an MLX eval) or
        holding the GIL still answers; one that cannot (in uninterruptible sleep, or gone) costs
        `timeout_s` at most.
        """
        if self._pid is None or self.returncode is not None:
            return False
        deadline = time.monotonic() + timeout_s
        self._stack_dump = asyncio.Event()
        self.signal(DUMP_STACKS_SIGNAL)
        self.signal(signal.SIGCONT)  # a stopped process handles its pending signal once it runs
        try:
            await asyncio.wait_for(self._stack_dump.wait(), timeout_s)
        except TimeoutError:
            return False
        # the rest of the burst, until stderr goes quiet (no event marks "done writing")
        while time.monotonic() < deadline and time.monotonic() - self._last_line_at < STACK_DUMP_QUIET_S:  # noqa: ASYNC110
            await asyncio.sleep(STACK_DUMP_QUIET_S / 2)
        return True

    async def kill_after_stack_dump(self, timeout_s: float, why: str) -> None:
        """SIGKILL, once the worker's stacks are in its log or `timeout_s` has passed."""
        dumped = await self.dump_stacks(timeout_s)
        log.error("[kill] model=%s pid=%s by=supervisor: SIGKILL; python stacks %s", self.model_id, self.pid,
                  f"in {self.log_path}" if dumped else f"not written within {timeout_s:.1f}s")
        self.signal(signal.SIGKILL, why)

    async def wait(self, timeout: float | None) -> bool:
        """Wait for the process to be reaped; True if it was within `timeout`."""
        return await set_within(self.exited, timeout)

    async def stop(self, grace_s: float, kill_timeout_s: float) -> dict:
        """The kill ladder (ladder.py): its own exit, SIGTERM, SIGKILL; always reaped."""
        t0 = time.monotonic()
        await self.started.wait()
        await kill_ladder(self, grace_s, kill_timeout_s, f"model={self.model_id} pid={self.pid}")
        return {"exit": self.returncode, "signals": list(self.signals_sent), "wait_s": time.monotonic() - t0}


def reap_stale(pid_dir: Path, timeout_s: float = 5.0) -> list[int]:
    """Kill workers a previous supervisor of this state directory left running; return their pids."""
    stale = []
    for pidfile in pid_dir.glob("worker-*.json"):
        try:
            pid = int(json.loads(pidfile.read_text())["pid"])
            proc = psutil.Process(pid)
            # its process title ("mlxsup-worker MODEL: python -m worker ...") may be cut to the length of the
            # spare's command line it replaced, so the title's head is checked, not an argument near its end
            title = " ".join(proc.cmdline())
            if title.startswith("mlxsup-worker") or ("-m worker" in title and "--lifeline" in title):
                proc.kill()
                stale.append(proc)
        except (OSError, ValueError, KeyError, psutil.Error):
            pass
        pidfile.unlink(missing_ok=True)
    psutil.wait_procs(stale, timeout=timeout_s)
    for proc in stale:
        log.warning("[start] reaped a worker left by a previous run: pid=%d", proc.pid)
    return [p.pid for p in stale]


def worker_argv(endpoint: str, identity: str, heartbeat_s: float, model_args: list[str],
                log_level: str = "info") -> list[str]:
    """A worker's command line: how it reaches the supervisor, its log level (the daemon's), then `model_args`
    (or ["--spare"])."""
    return [sys.executable, "-m", "worker", "--endpoint", endpoint, "--identity", identity,
            "--heartbeat-s", str(heartbeat_s), "--log-level", log_level.upper(), "--lifeline", *model_args]


def model_args(model_path: Path, model_id: str, max_batch_size: int, prefill_step_size: int,
               extra: tuple[str, ...] = (), cache_args: tuple[str, ...] = (),
               step_target_s: float | None = None, warm_batch_shapes: str | None = None,
               strict_context: bool = False, max_context: int | None = None, speculative: str = "auto") -> list[str]:
    """What makes a worker one model's worker: on its command line, or in a spare's Load message.

    `cache_args` come from CacheConfig.worker_args, `extra` (the model's worker_args) last; `max_context` caps the
    context the worker publishes (policy.context_cap); `speculative`: the server's drafting mode, which a model's own
    (in `extra`) overrides.
    """
    pacing = ["--step-target-s", str(step_target_s)] if step_target_s is not None else []
    if warm_batch_shapes is not None:
        pacing += ["--warm-batch-shapes", warm_batch_shapes]
    if strict_context:
        pacing.append("--strict-context")
    if max_context is not None:
        pacing += ["--max-context", str(max_context)]
    if speculative != "auto":
        pacing += ["--speculative", speculative]
    return ["--model-path", str(model_path), "--model-id", model_id, "--max-batch-size", str(max_batch_size),
            "--prefill-step-size", str(prefill_step_size), *pacing, *cache_args, *extra]


def exit_meaning(returncode: int | None) -> str:
    """What a worker's exit status says, in words, for logs and status ("" when it says nothing more)."""
    if returncode is None:
        return ""
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return {EXIT_CRASHED: "an unexpected error; its traceback is in the worker's log",
            EXIT_LOAD_FAILED: "the model failed to load",
            EXIT_PARENT_GONE: "it lost its supervisor"}.get(returncode, "")
