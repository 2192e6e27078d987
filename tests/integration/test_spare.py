"""The spare worker: a process with its imports paid, handed the next model to load."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx

from tests.conftest import Daemon, assert_gone, wait_for


def spare(d: Daemon) -> dict | None:
    s = d.status()["spare"]
    if s:
        d.seen_pids.add(s["pid"])
    return s


def complete(d: Daemon, model: str) -> None:
    r = httpx.post(d.v1 + "/completions", json={"model": model, "prompt": "x", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


def test_the_next_load_runs_on_the_spare_and_a_new_spare_follows(daemon: Daemon) -> None:
    first = wait_for(lambda: (s := spare(daemon)) and s["standing_by"] and s, 60, what="a spare on standby")
    complete(daemon, "tiny")
    assert daemon.model("tiny")["pid"] == first["pid"]  # no new process for the load
    second = wait_for(lambda: (s := spare(daemon)) and s["standing_by"] and s, 60, what="the next spare")
    assert second["pid"] != first["pid"]
    assert "[spare] on standby" in (daemon.state_dir / "logs" / "worker-spare.log").read_text()
    assert "[load] model=tiny" in (daemon.state_dir / "logs" / "worker-tiny.log").read_text()


def test_a_spare_that_dies_on_standby_is_not_needed(daemon: Daemon) -> None:
    httpx.post(daemon.url + "/api/models/tiny2/evict", timeout=60)
    victim = wait_for(lambda: (s := spare(daemon)) and s["standing_by"] and s, 60, what="a spare on standby")
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for(lambda: spare(daemon) is None, 10, what="the dead spare to be forgotten")
    complete(daemon, "tiny2")  # a fresh worker instead
    assert daemon.model("tiny2")["pid"] != victim["pid"] and daemon.model("tiny2")["crashes"] == 0
    wait_for(lambda: spare(daemon) is not None, 10, what="a new spare after that load")


def test_no_spare_when_configured_off_and_the_spare_is_stopped_at_shutdown(daemon_factory, model_dir: Path,
                                                                         tmp_path: Path) -> None:
    cfg = tmp_path / "nospare.toml"
    cfg.write_text(f'[server]\nmodel_dirs = ["{model_dir}"]\nspare_workers = 0\n')
    off = daemon_factory("--config", str(cfg), name="off")
    complete(off, "tiny")
    assert spare(off) is None
    on = daemon_factory("--model-dir", str(model_dir), name="on")
    pid = wait_for(lambda: (s := spare(on)) and s["standing_by"] and s["pid"], 60, what="a spare")
    assert on.stop() == 0
    assert_gone([pid])
