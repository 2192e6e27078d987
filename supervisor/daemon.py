"""`mlxsup serve`: assemble router, transport and gateway on one event loop, and run until told to stop.

Signals only flip the shutdown state and wake the loop (handled in the loop, not in the
handler). First SIGINT/SIGTERM: stop accepting connections, evict every worker in parallel
(drain up to the deadline, then abort), exit 0. A second one: force (SIGKILL the workers).
The daemon file (`state_dir/daemon.json`: pid and URL) lets `mlxsup status` find it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys

import psutil
import uvicorn

from supervisor.app import build_app
from supervisor.config import DEMO_MODEL_ID, Settings, runtime_dir
from supervisor.process import reap_stale
from supervisor.registry import ModelSpec, Registry, is_model_dir, weights_bytes
from supervisor.router import Router

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the daemon owns signals."""

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass

    def capture_signals(self):  # type: ignore[override]  # uvicorn >= 0.29
        import contextlib

        return contextlib.nullcontext()


def ensure_demo_model(settings: Settings) -> ModelSpec:
    path = settings.state_dir / "models" / DEMO_MODEL_ID
    if not is_model_dir(path):
        log.info("[demo] making the demo model in %s (once)", path)
        subprocess.run([sys.executable, "-m", "worker.make_model", str(path), "--preset", "tiny"], check=True)
    return ModelSpec(DEMO_MODEL_ID, path, weights_bytes=weights_bytes(path))


class AlreadyRunning(RuntimeError):
    pass


def claim_state_dir(settings: Settings) -> None:
    """Refuse to share a state directory with a live daemon; clear what a dead one left."""
    try:
        info = json.loads(settings.daemon_file.read_text())
        proc = psutil.Process(int(info["pid"]))
        if proc.pid != os.getpid() and "serve" in proc.cmdline():
            raise AlreadyRunning(f"a daemon already runs on {settings.state_dir} (pid {proc.pid}, {info['url']})")
    except (OSError, ValueError, KeyError, psutil.Error):
        pass
    settings.daemon_file.unlink(missing_ok=True)


async def serve(settings: Settings) -> int:
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    settings.log_dir.mkdir(parents=True, exist_ok=True)
    claim_state_dir(settings)
    configured = list(settings.models)
    if settings.demo:
        configured.append(ensure_demo_model(settings))
    registry = Registry.build(settings.model_dirs, configured, settings.hf_cache)
    if not registry.specs:
        log.warning("[start] no models found: pass --model-dir, --config or --demo")
    run_dir = runtime_dir(settings.state_dir)
    reap_stale(run_dir)
    router = Router(registry, settings, run_dir)
    router.start()
    app = build_app(router, settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            access_log=False, lifespan="off", timeout_graceful_shutdown=None)
    server = _Server(config)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals_seen: list[str] = []

    def handle(sig: signal.Signals) -> None:
        signals_seen.append(sig.name)
        stop.set()
        if len(signals_seen) > 1:
            router.kill_all()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, handle, sig)

    serving = asyncio.create_task(server.serve(), name="http")
    while not server.started and not serving.done():
        await asyncio.sleep(0.01)
    if serving.done():  # could not bind, most likely
        await router.shutdown()
        return 1
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://{settings.host}:{port}"
    settings.daemon_file.write_text(json.dumps({"pid": os.getpid(), "url": url}))
    log.info("[start] mlxsup serving %d model(s) on %s (router %s)", len(registry.specs), url,
             router.transport.endpoint)
    await asyncio.wait([serving, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)

    log.info("[shutdown] signal=%s: evicting %d worker(s)", ",".join(signals_seen) or "none", len(router.workers))
    server.should_exit = True
    reports = await router.shutdown()
    await serving
    settings.daemon_file.unlink(missing_ok=True)
    log.info("[shutdown] done: %d worker(s) stopped", len(reports))
    return 0
