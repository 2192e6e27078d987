"""Shared fixtures: models made by `mlxsup make-model`, real daemons, and proof that processes end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

MLXSUP = [sys.executable, "-m", "supervisor"]
# no test daemon listens on Ollama's 127.0.0.1:11434 (issue 51): the tests that want it set a free port instead
os.environ.setdefault("MLXSUP_OLLAMA_LISTEN", "off")


def wait_for(predicate: Callable[[], object], timeout: float = 30.0, interval: float = 0.05, what: str = "") -> object:
    """Poll `predicate` until it returns something truthy, or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


def text_line(line: str) -> bool:
    """An SSE line of a completions stream that carries text (not a keep-alive chunk's empty text, not a comment)."""
    if not line.startswith("data:") or line.strip() == "data: [DONE]":
        return False
    data = json.loads(line[5:])
    return "error" in data or any(c.get("text") for c in data.get("choices") or [])


def assert_gone(pids: list[int], timeout: float = 15.0) -> None:
    def all_gone() -> bool:
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    return False
            except psutil.NoSuchProcess:
                pass
        return True

    wait_for(all_gone, timeout, what=f"processes {pids} to exit")


RUN_MARK = "MLXSUP_TEST_RUN"


class Started:
    """A command a test runs, and every process it starts, known by a mark in their environment (RUN_MARK) or, for a
    daemon's workers, by `titled` in their command line (their daemon's state dir: a worker retitles itself, which
    overwrites its environment as /proc shows it). A worker runs in a session of its own and is reparented when its
    daemon exits, so by then it is no child to be found. `gone()` ends the command and proves each of them gone."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, titled: str | None = None,
                 **popen: Any) -> None:
        self.mark, self.titled = uuid.uuid4().hex, titled
        self.proc = subprocess.Popen(argv, env={**(os.environ if env is None else env), RUN_MARK: self.mark},
                                     **popen)

    def pids(self) -> list[int]:
        """The live processes of this run (a zombie's environment and command line read empty)."""
        found = []
        for p in psutil.process_iter():
            try:
                if (p.pid != os.getpid() and (p.environ().get(RUN_MARK) == self.mark
                                              or (self.titled is not None and self.titled in " ".join(p.cmdline())))):
                    found.append(p.pid)
            except (psutil.Error, OSError):
                continue
        return found

    def gone(self, timeout: float = 15.0) -> None:
        """The command ended (SIGTERM, then SIGKILL, if it still runs) and every process it started gone within
        `timeout`; any left after that is killed, and the test fails naming it."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        try:
            assert_gone(self.pids(), timeout)  # the command itself is reaped: gone
        finally:
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


def run_to_the_end(argv: list[str], timeout: float, env: dict[str, str] | None = None,
                   titled: str | None = None) -> subprocess.CompletedProcess:
    """subprocess.run(argv, capture_output=True, text=True), and every process it started proven gone after it."""
    started = Started(argv, env, titled, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = started.proc.communicate(timeout=timeout)
    finally:
        started.gone()
    return subprocess.CompletedProcess(argv, started.proc.returncode, out, err)


def make_model(path: Path, preset: str = "tiny", seed: int = 0) -> Path:
    subprocess.run([*MLXSUP, "make-model", str(path), "--preset", preset, "--seed", str(seed)], check=True,
                   capture_output=True)
    return path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with two tiny models, `tiny` and `tiny2` (different seeds)."""
    root = tmp_path_factory.mktemp("models")
    make_model(root / "tiny", seed=0)
    make_model(root / "tiny2", seed=1)
    return root


@dataclass
class Daemon:
    proc: subprocess.Popen
    url: str
    state_dir: Path
    seen_pids: set[int] = field(default_factory=set)

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def status(self) -> dict:
        st = httpx.get(self.url + "/api/status", timeout=10).json()
        self.seen_pids.update(m["pid"] for m in st["models"] if m["pid"])
        return st

    def model(self, model_id: str) -> dict:
        return next(m for m in self.status()["models"] if m["id"] == model_id)

    def children(self) -> list[int]:
        try:
            pids = [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        self.seen_pids.update(pids)
        return pids

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout)
        assert_gone(sorted(self.seen_pids))
        return rc


def start_daemon(state_dir: Path, *args: str, env: dict | None = None) -> Daemon:
    state_dir.mkdir(parents=True, exist_ok=True)
    log = open(state_dir / "daemon.log", "ab")
    isolated = {"HF_HUB_CACHE": str(state_dir / "no-hf-cache"), "XDG_CONFIG_HOME": str(state_dir / "no-config"),
                "MLXSUP_STRICT_STATES": "1",  # a worker state move workers.TRANSITIONS forbids raises, not just logs
                "MLXSUP_OLLAMA_LISTEN": "off"}  # never 127.0.0.1:11434 (issue 51): a test that wants it names a port
    proc = subprocess.Popen([*MLXSUP, "serve", "--port", "0", "--state-dir", str(state_dir), *args],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **isolated, **(env or {})})
    daemon_file = state_dir / "daemon.json"

    def started() -> dict | None:
        if proc.poll() is not None:
            raise AssertionError(f"daemon exited with {proc.returncode}: {(state_dir / 'daemon.log').read_text()}")
        try:
            info = json.loads(daemon_file.read_text())
        except (OSError, ValueError):
            return None
        return info if info.get("pid") == proc.pid else None  # not a dead predecessor's file

    info = wait_for(started, 60, what="the daemon to start")
    return Daemon(proc, info["url"], state_dir)


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Start daemons on demand; each is stopped and proven gone (with its workers) afterwards."""
    started: list[Daemon] = []

    def factory(*args: str, name: str = "d", env: dict | None = None) -> Daemon:
        d = start_daemon(tmp_path / name, *args, env=env)
        started.append(d)
        return d

    yield factory
    for d in started:
        d.stop()


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon shared by a test module, serving `model_dir`."""
    d = start_daemon(tmp_path_factory.mktemp("state"), "--model-dir", str(model_dir))
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="session", autouse=True)
def no_worker_left_behind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    yield
    root = str(tmp_path_factory.getbasetemp())
    left = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if root in cmd and ("-m worker" in cmd or "supervisor serve" in cmd):
            left.append((p.info["pid"], cmd))
    assert not left, f"processes left behind: {left}"
