"""The processes the benchmark starts: the mlxsup daemon, mlx_lm.server, the in-process runner.

Every one listens on 127.0.0.1 only, is started by `start()` with bounded waits, and is stopped by
`stop()`, which escalates to SIGKILL and then proves every process it knew of (its workers too)
is gone. The harness calls stop() in a finally, so this holds on errors as well.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from bench.common import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def descendants(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


async def wait_gone(pids, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def kill_all(pids) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


SERVER_CPUS: set[int] | None = None  # where every side's server runs (bench.params server_cpus); None: anywhere


def parse_cpus(spec: str) -> set[int] | None:
    """'auto' (the first quarter of the cores, at least 4), '' (None: unpinned) or a list like '0-3,8'."""
    if not spec or not hasattr(os, "sched_setaffinity"):
        return None
    if spec == "auto":
        n = os.cpu_count() or 1
        return set(range(min(n, max(4, n // 4))))
    cpus: set[int] = set()
    for part in spec.split(","):
        a, _, b = part.partition("-")
        cpus.update(range(int(a), int(b or a) + 1))
    return cpus


def _pin() -> None:  # in the child, before exec
    if SERVER_CPUS:
        os.sched_setaffinity(0, SERVER_CPUS)


class Managed:
    name = "process"

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.seen: set[int] = set()

    def _spawn(self, argv: list[str], env: dict | None = None, **kw) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=kw.pop("stdout", log), stderr=log, cwd=kw.pop("cwd", REPO),
                                     env={**os.environ, **(env or {})}, preexec_fn=_pin if SERVER_CPUS else None, **kw)
        self.seen.add(self.proc.pid)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def track(self) -> None:
        if self.proc:
            self.seen.update(descendants(self.proc.pid))

    async def stop(self, graceful: signal.Signals = signal.SIGTERM, timeout: float = 60.0) -> dict:
        """Stop gracefully, then SIGKILL; return proof: {pid: 'gone'|'ALIVE'} and the exit code."""
        if self.proc is None:
            return {"pids": {}, "exit": None}
        self.track()
        if self.proc.poll() is None:
            self.proc.send_signal(graceful)
        forced = False
        if not await wait_gone([self.proc.pid], timeout):
            forced = True
            self.track()
            kill_all(self.seen)
        try:
            code = self.proc.wait(10)
        except subprocess.TimeoutExpired:
            code = None
        if not await wait_gone(self.seen, 15):
            kill_all(self.seen)
            await wait_gone(self.seen, 5)
        return {"pids": {str(p): ("ALIVE" if alive(p) else "gone") for p in sorted(self.seen)}, "exit": code,
                "forced": forced}


class Mlxsup(Managed):
    """`mlxsup serve --model-dir ROOT --port 0 --state-dir S`; the URL comes from S/daemon.json."""

    name = "mlxsup"

    def __init__(self, model_root: Path, state_dir: Path, env: dict | None = None, args: list[str] | None = None,
                 tree: Path | None = None) -> None:
        super().__init__(state_dir / "daemon.log")
        self.model_root = model_root
        self.state_dir = state_dir
        self.env = env
        self.tree = tree  # another checkout to run (its daemon and workers import from it), else this one
        if tree is not None:  # first on the path and the working folder (`-m` puts the cwd first)
            path = os.environ.get("PYTHONPATH", "")
            self.env = {**(env or {}), "PYTHONPATH": f"{tree}{os.pathsep}{path}" if path else str(tree)}
        self.args = args or []  # more `mlxsup serve` arguments, e.g. ["--config", PATH]
        self.url = ""

    async def start(self, timeout: float = 120.0) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "daemon.json").unlink(missing_ok=True)
        self._spawn([sys.executable, "-m", "supervisor", "serve", "--model-dir", str(self.model_root), "--port", "0",
                     "--host", "127.0.0.1", "--state-dir", str(self.state_dir), *self.args], env=self.env,
                    cwd=self.tree or REPO)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlxsup exited with {self.proc.returncode}; see {self.log_path}")
            try:
                self.url = json.loads((self.state_dir / "daemon.json").read_text())["url"]
                return
            except (OSError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlxsup did not start in {timeout}s; see {self.log_path}")
            await asyncio.sleep(0.05)

    @property
    def chat_url(self) -> str:
        return self.url + "/v1/chat/completions"

    async def status(self, client: httpx.AsyncClient) -> dict:
        st = (await client.get(self.url + "/api/status", timeout=30)).json()
        self.seen.update(m["pid"] for m in st["models"] if m.get("pid"))
        return st

    async def model(self, client: httpx.AsyncClient, model_id: str) -> dict:
        return next(m for m in (await self.status(client))["models"] if m["id"] == model_id)

    async def load(self, client: httpx.AsyncClient, model_id: str, timeout: float = 600) -> dict:
        r = await client.post(f"{self.url}/api/models/{model_id}/load", json={}, timeout=timeout)
        r.raise_for_status()
        body = r.json()
        if body.get("pid"):
            self.seen.add(body["pid"])
        return body

    async def warmed_up(self, model_id: str, timeout: float) -> float | None:
        """Wait for the model's worker to log the end of its idle batch-shape warm-up (worker/mlx_engine/warmup.py:
        it runs after Ready, so rounds measured meanwhile would share the GPU with it); its seconds, or None."""
        log = self.state_dir / "logs" / f"worker-{model_id.replace('/', '--')}.log"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                m = re.search(r"\[warm\] model=\S+ batch_shapes .* s=([0-9.]+)", log.read_text())
            except OSError:
                m = None
            if m:
                return float(m.group(1))
            await asyncio.sleep(0.2)
        return None

    async def evict(self, client: httpx.AsyncClient, model_id: str, mode: str = "drain",
                    timeout_s: float | None = None, http_timeout: float = 120) -> dict:
        body: dict = {"mode": mode}
        if timeout_s is not None:
            body["timeout"] = timeout_s
        r = await client.post(f"{self.url}/api/models/{model_id}/evict", json=body, timeout=http_timeout)
        r.raise_for_status()
        return r.json()


class MlxLmServer(Managed):
    """`python -m mlx_lm.server --model DIR --host 127.0.0.1 --port P`, batching by default (32 / 8)."""

    name = "mlx_lm.server"

    def __init__(self, model_dir: Path, log_path: Path) -> None:
        super().__init__(log_path)
        self.model_dir = model_dir
        self.url = ""

    async def start(self, timeout: float = 120.0) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._spawn([sys.executable, "-m", "mlx_lm.server", "--model", str(self.model_dir), "--host", "127.0.0.1",
                     "--port", str(port), "--log-level", "WARNING"])
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(trust_env=False) as c:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"mlx_lm.server exited with {self.proc.returncode}; see {self.log_path}")
                try:
                    if (await c.get(self.url + "/health", timeout=2)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"mlx_lm.server did not answer in {timeout}s; see {self.log_path}")
                await asyncio.sleep(0.1)

    @property
    def chat_url(self) -> str:
        return self.url + "/v1/chat/completions"

    async def stop(self, graceful: signal.Signals = signal.SIGINT, timeout: float = 30.0) -> dict:
        return await super().stop(graceful, timeout)


class InProc(Managed):
    """The in-process runner (bench/inproc.py), driven over a pipe."""

    name = "inproc"

    def __init__(self, model_dir: Path, log_path: Path) -> None:
        super().__init__(log_path)
        self.model_dir = model_dir
        self.info: dict = {}
        self._lock = asyncio.Lock()

    async def start(self, timeout: float = 600.0) -> None:
        self._spawn([sys.executable, "-m", "bench.inproc", "--model", str(self.model_dir)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.info = await self._read(timeout)

    async def _read(self, timeout: float) -> dict:
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout)
        if not line:
            raise RuntimeError(f"the in-process runner exited ({self.proc.poll()}); see {self.log_path}")
        return json.loads(line)

    async def run(self, mode: str, messages: list, max_tokens: int, timeout: float) -> dict:
        async with self._lock:
            cmd = {"op": "run", "mode": mode, "messages": messages, "max_tokens": max_tokens}
            self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            self.proc.stdin.flush()
            out = await self._read(timeout)
        if not out.get("ok"):
            raise RuntimeError(f"in-process run failed: {out.get('error')}")
        return out

    async def stop(self, graceful: signal.Signals = signal.SIGTERM, timeout: float = 30.0) -> dict:
        if self.proc and self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"op": "quit"}\n')
                self.proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            await wait_gone([self.proc.pid], 10)
        return await super().stop(graceful, timeout)


async def cold_inproc(model_dir: Path, messages: list, log_path: Path, timeout: float = 600) -> dict:
    """A fresh process: mlx_lm.load + first token (and the interpreter start, for reference)."""
    t0 = time.perf_counter()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.inproc", "--model", str(model_dir), "--cold", json.dumps(messages),
            stdout=asyncio.subprocess.PIPE, stderr=log, cwd=REPO)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    res = json.loads(out.decode().strip().splitlines()[-1])
    res["spawn_to_exit_s"] = time.perf_counter() - t0
    res["pid_gone"] = not alive(proc.pid)
    return res
