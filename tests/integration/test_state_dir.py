"""One daemon per state directory, with real processes (issue 48, item 7): a daemon still shutting down when a new
one started on its state directory removed the new one's `run/router.sock` and `daemon.json`, so the new one's next
worker stayed `loading` for minutes and `mlxsup evict --state-dir` reached another daemon on the default port.

The state directory is held by a lock (`daemon.lock`) from before a daemon touches anything in it until the very
end of its shutdown; a daemon removes only the files that are still its own; and a command told a state directory
reaches only the daemon that directory's daemon file names, alive, never one elsewhere."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from tests.conftest import MLXSUP, Daemon, assert_gone, start_daemon, wait_for

NO_CONFIG = {"XDG_CONFIG_HOME": "/nonexistent/mlxsup-no-config", "HF_HUB_CACHE": "/nonexistent/mlxsup-no-hf-cache"}


def serve(state_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*MLXSUP, "serve", "--port", "0", "--state-dir", str(state_dir), *args],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **NO_CONFIG})


def mlxsup(*args: str, port: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **NO_CONFIG, **({"MLXSUP_PORT": str(port)} if port is not None else {})}
    return subprocess.run([*MLXSUP, *args], capture_output=True, text=True, timeout=60, env=env)


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_daemon_shutting_down_holds_its_state_dir_to_the_end(model_dir: Path, tmp_path: Path) -> None:
    """A successor started while the daemon shuts down (a worker slow to exit) is refused, exit 2, and removes
    nothing; once the daemon is gone, one starts."""
    state = tmp_path / "state"
    config = tmp_path / "slow-exit.toml"
    config.write_text(f"""
[server]
shutdown_drain_s = 0
settle_grace_s = 4
kill_timeout_s = 2

[models.stuck]
path = "{model_dir / 'tiny'}"
worker_args = ["--fault", "hang-on-evict"]
""")
    d = start_daemon(state, "--config", str(config))
    r = httpx.post(f"{d.url}/api/models/stuck/load", timeout=60)
    assert r.status_code == 200, r.text
    worker = r.json()["pid"]
    d.children()
    d.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "[shutdown]" in (state / "daemon.log").read_text(), 10, what="the shutdown to start")
    refused = serve(state, "--model-dir", str(model_dir))
    assert d.proc.poll() is None, "the first daemon was not shutting down any more: the test proves nothing"
    assert refused.returncode == 2, refused.stderr
    assert "already runs" in refused.stderr and f"pid {d.proc.pid}" in refused.stderr, refused.stderr
    assert d.proc.wait(30) == 0
    assert_gone([worker])
    assert not (state / "daemon.json").exists()
    after = start_daemon(state, "--model-dir", str(model_dir))  # the state directory is free again
    assert after.stop() == 0


def test_a_daemon_whose_daemon_file_is_gone_still_holds_its_state_dir(daemon: Daemon, model_dir: Path,
                                                                       tmp_path: Path) -> None:
    """Catches: a state directory claimed through its daemon file alone. With the file gone (a predecessor's exit
    removed it, as in the issue), a second daemon started, reaped the first one's workers and took its socket;
    and `mlxsup status --state-dir` fell back to whatever daemon answered on the default port."""
    state = tmp_path / "held"
    d = start_daemon(state, "--model-dir", str(model_dir))
    try:
        r = httpx.post(f"{d.url}/api/models/tiny/load", timeout=60)
        assert r.status_code == 200, r.text
        worker = r.json()["pid"]
        info = json.loads((state / "daemon.json").read_text())
        (state / "daemon.json").unlink()

        refused = serve(state, "--model-dir", str(model_dir))
        assert refused.returncode == 2, refused.stderr
        assert "already runs" in refused.stderr and f"pid {d.proc.pid}" in refused.stderr, refused.stderr
        assert Path(info["router"][len("ipc://"):]).exists() or not info["router"].startswith("ipc://")
        ok = httpx.post(d.v1 + "/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200 and d.model("tiny")["pid"] == worker  # its worker and socket are its own still

        other_port = urlsplit(daemon.url).port  # another daemon answers on "the default port"
        for command in (["status"], ["evict", "tiny"]):
            out = mlxsup(*command, "--state-dir", str(state), port=other_port)
            assert out.returncode == 3, (command, out.stdout, out.stderr)
            assert "no daemon file" in out.stderr and str(state) in out.stderr, out.stderr
    finally:
        assert d.stop() == 0


def test_a_stale_daemon_file_names_no_daemon(daemon: Daemon, tmp_path: Path) -> None:
    """Catches: a command that trusted a daemon file naming a process long gone, reaching whatever listens at its
    URL now."""
    state = tmp_path / "stale"
    state.mkdir()
    pid = dead_pid()
    (state / "daemon.json").write_text(json.dumps({"pid": pid, "url": daemon.url, "router": "tcp://127.0.0.1:9"}))
    loaded = httpx.post(f"{daemon.url}/api/models/tiny2/load", timeout=60).json()["pid"]
    out = mlxsup("evict", "tiny2", "--state-dir", str(state))
    assert out.returncode == 3, (out.stdout, out.stderr)
    assert f"pid {pid}" in out.stderr and "not running" in out.stderr, out.stderr
    assert daemon.model("tiny2")["pid"] == loaded  # the daemon elsewhere was not told to evict
    config = mlxsup("config", "show", "--state-dir", str(state))  # what needs no daemon still answers
    assert config.returncode == 0 and "not running" in config.stdout, (config.stdout, config.stderr)


def test_a_daemon_leaves_a_daemon_file_that_is_not_its_own(model_dir: Path, tmp_path: Path) -> None:
    """Catches: an exit that removed `daemon.json` whatever it named by then (a successor's)."""
    state = tmp_path / "successor"
    d = start_daemon(state, "--model-dir", str(model_dir))
    theirs = {"pid": 1, "url": "http://127.0.0.1:9", "router": "tcp://127.0.0.1:9"}
    (state / "daemon.json").write_text(json.dumps(theirs))
    assert d.stop() == 0
    assert json.loads((state / "daemon.json").read_text()) == theirs


def test_two_daemons_started_together_on_one_state_dir_one_serves(model_dir: Path, tmp_path: Path) -> None:
    """Catches: the window between a daemon's check of the state directory and its daemon file (written once it
    serves): two started together both served, each over the other's socket and daemon file."""
    state = tmp_path / "race"
    state.mkdir()
    log = open(state / "daemon.log", "ab")
    argv = [*MLXSUP, "serve", "--port", "0", "--state-dir", str(state), "--model-dir", str(model_dir)]
    procs = [subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **NO_CONFIG})
             for _ in range(2)]
    try:
        first = wait_for(lambda: next((p for p in procs if p.poll() is not None), None), 30,
                         what="one of the two daemons to be refused")
        assert first.returncode == 2
        winner = next(p for p in procs if p is not first)
        info = wait_for(lambda: (state / "daemon.json").exists() and json.loads((state / "daemon.json").read_text()),
                        60, what="the other to serve")
        assert info["pid"] == winner.pid and winner.poll() is None
        time.sleep(0.5)
        assert "already runs" in (state / "daemon.log").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                assert p.wait(30) == 0
