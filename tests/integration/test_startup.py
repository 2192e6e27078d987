"""Starting and stopping the daemon as a user or a service manager does: a taken port, model folders
that are wrong, and signals that arrive together. Each test fails when the handling it checks is removed."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.conftest import MLXSUP, assert_gone, run_to_the_end, wait_for


def isolated(state_dir: Path, **extra: str) -> dict[str, str]:
    """No Hugging Face cache and no user config: the daemon sees only what the test gives it."""
    return {**os.environ, "HF_HUB_CACHE": str(state_dir / "no-hf-cache"),
            "XDG_CONFIG_HOME": str(state_dir / "no-config"), **extra}


def serve_once(state_dir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`mlxsup serve` that is expected to give up at start; the timeout only bounds a daemon that would not. The
    daemon and whatever it started (a spare, a worker) are proven gone after it (run_to_the_end)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    return run_to_the_end([*MLXSUP, "serve", "--state-dir", str(state_dir), *args], 60, env or isolated(state_dir),
                          titled=str(state_dir))


def processes_of(state_dir: Path) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"]) if str(state_dir) in " ".join(p.info["cmdline"] or [])]


@pytest.fixture
def taken_port() -> int:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    yield holder.getsockname()[1]
    holder.close()


def test_a_taken_port_is_one_line_and_a_fast_exit_with_nothing_left(model_dir: Path, tmp_path: Path,
                                                                     taken_port: int) -> None:
    out = serve_once(tmp_path / "s", "--port", str(taken_port), "--model-dir", str(model_dir))
    assert out.returncode == 2  # systemd's RestartPreventExitStatus: a restart will not free the port
    assert f"mlxsup: cannot listen on 127.0.0.1:{taken_port}" in out.stderr
    assert "ddress already in use" in out.stderr
    assert "Traceback" not in out.stderr
    assert not processes_of(tmp_path / "s")  # no spare, no worker: nothing was started before the bind
    assert not (tmp_path / "s" / "daemon.json").exists()


def test_under_launchd_a_start_that_cannot_succeed_exits_zero(model_dir: Path, tmp_path: Path,
                                                               taken_port: int) -> None:
    """launchd's KeepAlive {SuccessfulExit: false} restarts on any non-zero status: 0 is its only 'stay down'."""
    state = tmp_path / "s"
    out = serve_once(state, "--port", str(taken_port), "--model-dir", str(model_dir),
                     env=isolated(state, MLXSUP_SERVICE="launchd"))
    assert out.returncode == 0 and "cannot listen" in out.stderr
    assert "cannot listen" in (state / "logs" / "mlxsup.log").read_text()  # the reason stays in the log


def test_a_missing_model_folder_is_an_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-folder"
    out = serve_once(tmp_path / "s", "--port", "0", "--model-dir", str(missing))
    assert out.returncode == 2 and f"no such model folder: {missing}" in out.stderr
    assert not processes_of(tmp_path / "s")


def test_nothing_to_serve_and_nowhere_to_find_it_exits(tmp_path: Path) -> None:
    out = serve_once(tmp_path / "s", "--port", "0")
    assert out.returncode == 2 and "nothing to serve" in out.stderr
    assert not processes_of(tmp_path / "s")


def test_a_model_folder_given_as_model_dir_is_served_as_that_model(daemon_factory, model_dir: Path) -> None:
    d = daemon_factory("--model-dir", str(model_dir / "tiny"))
    client = openai.OpenAI(base_url=d.v1, api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == ["tiny"]
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3


def test_a_model_put_into_a_watched_folder_later_is_served(daemon_factory, model_dir: Path, tmp_path: Path) -> None:
    later = tmp_path / "later"
    later.mkdir()
    d = daemon_factory("--model-dir", str(later))
    assert httpx.get(d.v1 + "/models", timeout=10).json()["data"] == []
    shutil.copytree(model_dir / "tiny", later / "newcomer")

    def served() -> httpx.Response | None:  # the registry looks again at most every few seconds
        r = httpx.post(d.v1 + "/completions", json={"model": "newcomer", "prompt": "x", "max_tokens": 2}, timeout=60)
        return r if r.status_code == 200 else None

    wait_for(served, 30, interval=0.5, what="the new model to be served")
    assert [m["id"] for m in httpx.get(d.v1 + "/models", timeout=10).json()["data"]] == ["newcomer"]


def test_signals_that_arrive_together_drain_instead_of_killing(daemon_factory, model_dir: Path,
                                                              tmp_path: Path) -> None:
    """GNU `timeout -s INT` signals the daemon and then its whole group: two SIGINTs in the same instant.
    (The kernel may merge two that land before the first is handled, so the test sends the second
    as soon as the first is seen, well within a second.)"""
    (tmp_path / "c.toml").write_text(f'[server]\nmodel_dirs = ["{model_dir}"]\nshutdown_drain_s = 0.5\n')
    d = daemon_factory("--config", str(tmp_path / "c.toml"))
    pid = httpx.post(f"{d.url}/api/models/tiny/load", timeout=60).json()["pid"]
    log = d.state_dir / "daemon.log"
    client = openai.OpenAI(base_url=d.v1, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.APIError) as err:
        for i, _ in enumerate(client.completions.create(model="tiny", prompt="Tell me", stream=True,
                                                        max_tokens=8000, extra_body={"ignore_eos": True})):
            if i == 0:
                d.proc.send_signal(signal.SIGINT)
                wait_for(lambda: "[shutdown] SIGINT: draining" in log.read_text(), 10, what="the first signal")
                d.proc.send_signal(signal.SIGINT)
    assert err.value.body["code"] == "model_evicted"  # a clean error event after the drain deadline
    assert d.proc.wait(60) == 0
    assert_gone([pid])
    text = log.read_text()
    assert "exit=0 signals=[]" in text  # the worker ran its orderly exit: no SIGKILL
    assert "SIGKILLed by the supervisor" not in text
    assert "SIGINT again within" in text  # and it did get both signals
