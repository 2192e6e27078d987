"""The command line as a new user meets it, against real daemons: status and evict say what they
see and wait for; config show, logs and ui ask the running daemon; the API key comes from the
config file; workers are named by their model in `ps`; each generation request gets a log line,
each worker line one time stamp."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import threading
import tomllib
from pathlib import Path

import httpx
import psutil

from tests.conftest import MLXSUP, Daemon, assert_gone, wait_for

KEY = "s3cret-key-42"
STAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


def mlxsup(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MLXSUP_")}
    return subprocess.run([*MLXSUP, *args], capture_output=True, text=True, timeout=120, env={**clean, **(env or {})})


def load(daemon: Daemon, model: str) -> int:
    r = httpx.post(f"{daemon.url}/api/models/{model}/load", timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["pid"]


def test_status_shows_size_context_until_and_memory_and_evict_all_says_when_nothing_is_loaded(daemon: Daemon) -> None:
    load(daemon, "tiny")
    out = mlxsup("status", "--url", daemon.url)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].startswith("memory: models ") and " ceiling (" in lines[1] and "spare worker pid" in lines[1]
    assert {"SIZE", "CONTEXT", "UNTIL"} <= set(lines[2].split())
    tiny = next(line for line in lines if line.startswith("tiny "))
    assert "KiB" in tiny and "no TTL" in tiny  # the tiny model is < 1 MiB on disk: not "0 MiB"
    pids = [m["pid"] for m in daemon.status()["models"] if m["pid"]]
    first = mlxsup("evict", "--all", "--url", daemon.url)
    assert first.returncode == 0 and all(f"evicted pid {pid}" in first.stdout for pid in pids), first.stdout
    assert_gone(pids)
    again = mlxsup("evict", "--all", "--url", daemon.url)
    assert again.returncode == 0 and again.stdout.strip() == "nothing to evict: no model is loaded"


def test_a_drain_evict_says_what_it_waits_for(daemon: Daemon) -> None:
    pid = load(daemon, "tiny")
    events: list[str] = []

    def stream() -> None:
        body = {"model": "tiny", "prompt": "go", "max_tokens": 4000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", daemon.v1 + "/completions", json=body, timeout=120) as r:
            events.extend(r.iter_lines())

    client = threading.Thread(target=stream, name="long-stream")
    client.start()
    try:
        wait_for(lambda: daemon.model("tiny")["in_flight"] == 1, 30, what="the stream to be in flight")
        out = mlxsup("evict", "tiny", "--timeout", "1.5", "--url", daemon.url)
    finally:
        client.join(60)
    assert out.returncode == 0, out.stderr
    assert f"tiny: evicting pid {pid}: waiting for 1 request(s) in flight to finish (drain deadline 1.5s" in out.stdout
    assert f"evicted pid {pid}" in out.stdout.splitlines()[-1] and "aborted 1" in out.stdout
    assert any("model_evicted" in e for e in events)  # the client got its error event, not a cut stream
    assert_gone([pid])


def test_workers_are_named_by_their_model_in_ps(daemon: Daemon) -> None:
    pids = {model: load(daemon, model) for model in ("tiny", "tiny2")}  # the first one on the spare
    for model, pid in pids.items():
        title = " ".join(psutil.Process(pid).cmdline())
        assert title.startswith(f"mlxsup-worker {model}: python -m worker ") and "--spare" not in title, title
    spare = daemon.status()["spare"]["pid"]
    wait_for(lambda: " ".join(psutil.Process(spare).cmdline()).startswith("mlxsup-worker (spare): "), 30,
             what="the new spare to name itself")


def test_each_request_is_logged_once_and_worker_lines_carry_one_time_stamp(daemon: Daemon) -> None:
    load(daemon, "tiny")
    r = httpx.post(daemon.v1 + "/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "log me"}], "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200
    log = daemon.state_dir / "logs" / "mlxsup.log"
    pattern = re.compile(r"\[request\] model=tiny endpoint=/v1/chat/completions status=200 outcome=completed "
                         r"prompt_tokens=\d+ completion_tokens=5 ttft_ms=\d+ ms=\d+")
    wait_for(lambda: pattern.search(log.read_text()), 10, what="the request's log line")
    relayed = [line for line in log.read_text().splitlines() if "[tiny pid=" in line]
    assert relayed and all(len(STAMP.findall(line)) == 1 for line in relayed), relayed[:3]
    own = (daemon.state_dir / "logs" / "worker-tiny.log").read_text().splitlines()
    assert own and all(STAMP.match(line) and len(STAMP.findall(line)) == 1 for line in own), own[:3]
    # startup's objects (the daemon's, and the worker's model, tokenizer and imports) are out of full collections
    started = re.search(r"\[start\] mlxsup serving .* frozen_objects=(\d+)", log.read_text())
    loaded = re.search(r"\[load\] model=tiny ready in \S+ frozen_objects=(\d+)", "\n".join(own))
    assert started and int(started.group(1)) > 1000 and loaded and int(loaded.group(1)) > 10000


def test_config_show_logs_and_ui_ask_the_running_daemon_with_the_key_from_the_config(
        daemon_factory, model_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[server]\napi_key = "{KEY}"\n[memory]\npressure_soft = 0.8\n')
    d = daemon_factory("--model-dir", str(model_dir), "--config", str(config), "--ttl", "123", "--demo",
                       "--max-loaded-models", "2", name="keyed")
    # a client elsewhere: no daemon file, no config and no key unless given; another default state dir
    elsewhere = {"XDG_STATE_HOME": str(tmp_path / "other-state"), "XDG_CONFIG_HOME": str(tmp_path / "no-config")}
    target = ["--url", d.url, "--config", str(config)]

    assert mlxsup("status", "--url", d.url, env=elsewhere).returncode == 1  # refused without the key
    status = mlxsup("status", *target, env=elsewhere)
    assert status.returncode == 0 and "tiny" in status.stdout, status.stderr

    shown = mlxsup("config", "show", *target, env=elsewhere)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"# the running daemon's configuration ({d.url})") and "demo model: yes" in shown.stdout
    effective = tomllib.loads(shown.stdout)  # flags only the daemon knows, and the file it read
    assert effective["server"]["default_ttl_s"] == 123 and effective["memory"]["max_loaded_models"] == 2
    assert effective["memory"]["pressure_soft"] == 0.8 and KEY not in shown.stdout and "demo" in effective["models"]
    assert effective["server"]["state_dir"] == str(d.state_dir)

    logs = mlxsup("logs", *target, env=elsewhere)
    assert logs.returncode == 0 and "[start] mlxsup serving" in logs.stdout, logs.stderr

    opened, browser = tmp_path / "opened.txt", tmp_path / "fake-browser"
    browser.write_text(f'#!/bin/sh\necho "$$ $1" > {opened}\n')
    browser.chmod(browser.stat().st_mode | stat.S_IEXEC)
    ui = mlxsup("ui", *target, env={**elsewhere, "BROWSER": str(browser)})
    assert ui.returncode == 0, ui.stderr
    pid, url = opened.read_text().split()
    assert url == d.url + "/ui"
    assert_gone([int(pid)])
    down = mlxsup("ui", "--url", "http://127.0.0.1:9", env={**elsewhere, "BROWSER": str(browser)})
    assert down.returncode == 3 and "not running" in down.stderr


def test_serve_beyond_loopback_without_a_key_refuses_unless_told_and_then_warns(
        daemon: Daemon, daemon_factory, model_dir: Path, tmp_path: Path) -> None:
    """The Host check is not authentication: `serve --host 0.0.0.0` with no key said nothing."""
    state = tmp_path / "refused"
    refused = mlxsup("serve", "--host", "0.0.0.0", "--port", "0", "--state-dir", str(state),
                     env={"XDG_CONFIG_HOME": str(tmp_path / "no-config")})
    assert refused.returncode == 2, refused.stderr
    assert "without an API key" in refused.stderr and "--insecure-no-key" in refused.stderr
    assert not (state / "daemon.json").exists()
    assert daemon.status()["security_warning"] is None  # loopback: nothing to warn of
    exposed = daemon_factory("--host", "0.0.0.0", "--insecure-no-key", "--model-dir", str(model_dir), name="exposed")
    assert "listening on 0.0.0.0 without an API key" in exposed.status()["security_warning"]
    assert "[start] insecure: listening on 0.0.0.0" in (exposed.state_dir / "daemon.log").read_text()
