"""Model lifecycle with real workers: eviction under load, the kill ladder, admission, TTL, leases,
pinning, memory pressure, and the `mlxsup status|evict|load` commands."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import subprocess
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.conftest import MLXSUP, Daemon, assert_gone, text_line, wait_for

LONG = {"max_tokens": 8000, "extra_body": {"ignore_eos": True}}


def load(d: Daemon, model: str) -> int:
    r = httpx.post(f"{d.url}/api/models/{model}/load", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["pid"]


def evict(d: Daemon, model: str, **body) -> dict:
    r = httpx.post(f"{d.url}/api/models/{model}/evict", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_evict_now_during_eight_streams(daemon: Daemon) -> None:
    pid = load(daemon, "tiny")
    client = openai.AsyncOpenAI(base_url=daemon.v1, api_key="unused", max_retries=0, timeout=60)

    async def stream_until_error(started: asyncio.Queue) -> tuple[int, str | None]:
        chunks = 0
        try:
            stream = await client.completions.create(model="tiny", prompt="Tell me", stream=True, **LONG)
            async for _ in stream:
                chunks += 1
                if chunks == 1:
                    started.put_nowait(None)
        except openai.APIError as exc:
            return chunks, (exc.body or {}).get("code")
        return chunks, None

    async def main() -> tuple[list, dict]:
        started: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(stream_until_error(started)) for _ in range(8)]
        for _ in range(8):
            await asyncio.wait_for(started.get(), 60)
        async with httpx.AsyncClient(timeout=60) as http:
            report = (await http.post(f"{daemon.url}/api/models/tiny/evict", json={"mode": "now"})).json()
        return await asyncio.wait_for(asyncio.gather(*tasks), 30), report

    results, report = asyncio.run(main())
    assert [code for _, code in results] == ["model_evicted"] * 8, results
    assert all(chunks >= 1 for chunks, _ in results)
    assert report["aborted"] == 8 and report["exit"] == 0 and report["signals"] == []
    assert report["memory_before_bytes"] > 0 and set(report["phases_s"]) >= {"abort", "close_caches", "settle"}
    assert_gone([pid])
    again = httpx.post(daemon.v1 + "/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3, "ignore_eos": True},
                       timeout=60)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] >= 1
    assert daemon.model("tiny")["pid"] not in (None, pid)


def test_evict_idle_is_idempotent_and_the_process_is_gone(daemon: Daemon) -> None:
    pid = load(daemon, "tiny2")

    async def twice() -> list[dict]:
        async with httpx.AsyncClient(timeout=60) as http:
            rs = await asyncio.gather(*(http.post(f"{daemon.url}/api/models/tiny2/evict") for _ in range(2)))
        return [r.json() for r in rs]

    first, second = asyncio.run(twice())
    assert first == second and first["pid"] == pid and first["exit"] == 0  # the second joined the first
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert daemon.model("tiny2")["state"] == "stopped"
    assert evict(daemon, "tiny2") == {"model": "tiny2", "evicted": False, "reason": "not loaded"}


def test_cli_status_evict_load(daemon: Daemon) -> None:
    def mlxsup(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*MLXSUP, *args], capture_output=True, text=True, timeout=120)

    out = mlxsup("load", "tiny", "--url", daemon.url)
    assert out.returncode == 0 and "tiny: ready" in out.stdout
    table = mlxsup("status", "--url", daemon.url)
    assert table.returncode == 0 and "MODEL" in table.stdout and "ready" in table.stdout
    as_json = json.loads(mlxsup("status", "--json", "--state-dir", str(daemon.state_dir)).stdout)
    assert {"ceiling_bytes", "used_bytes", "system_available_bytes", "models"} <= set(as_json)
    pid = daemon.model("tiny")["pid"]
    out = mlxsup("evict", "tiny", "--url", daemon.url)
    assert out.returncode == 0 and f"evicted pid {pid}" in out.stdout
    assert_gone([pid])
    unknown = mlxsup("evict", "no-such-model", "--url", daemon.url)
    assert unknown.returncode == 2 and "does not exist" in unknown.stderr
    absent = mlxsup("status", "--url", "http://127.0.0.1:9")
    assert absent.returncode == 3 and "not running" in absent.stderr


def test_stuck_worker_is_killed_after_the_kill_timeout(daemon_factory, model_dir: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path / "stuck.toml", f"""
[server]
settle_grace_s = 0.5
kill_timeout_s = 1.0

[models.stuck]
path = "{model_dir / 'tiny'}"
worker_args = ["--fault", "ignore-sigterm", "--fault", "hang-on-evict"]
""")
    d = daemon_factory("--config", str(config))
    pid = load(d, "stuck")
    report = evict(d, "stuck", timeout=0)
    assert report["signals"] == ["SIGTERM", "SIGKILL"] and report["exit"] == -9
    assert_gone([pid])
    assert d.model("stuck")["state"] == "stopped"


def test_ceiling_that_fits_one_model_swaps_them_and_waits_when_busy(daemon: Daemon, daemon_factory,
                                                                      model_dir: Path, tmp_path: Path) -> None:
    load(daemon, "tiny")
    one = daemon.model("tiny")["memory_bytes"]
    config = write_config(tmp_path / "ceiling.toml", f"""
[server]
model_dirs = ["{model_dir}"]

[memory]
ceiling = {int(one * 1.6)}
worker_overhead = {one}
""")
    d = daemon_factory("--config", str(config))
    client = openai.OpenAI(base_url=d.v1, api_key="unused", max_retries=0, timeout=60)
    pids = []
    for model in ("tiny", "tiny2", "tiny", "tiny2"):
        assert client.completions.create(model=model, prompt="swap", max_tokens=2).usage.completion_tokens
        states = {m["id"]: m["state"] for m in d.status()["models"]}
        assert states[model] == "ready" and list(states.values()).count("ready") == 1, states
        pids.append(d.model(model)["pid"])
    assert len(set(pids)) == 4  # every swap was a fresh process
    assert d.model("tiny2")["last_eviction"]["reason"] == d.model("tiny")["last_eviction"]["reason"] == "admission"

    # tiny busy: a request for tiny2 waits for it (no 507), and is served once tiny's request is done
    with httpx.stream("POST", d.v1 + "/completions", timeout=60, json={
            "model": "tiny", "prompt": "busy", "max_tokens": 8000, "ignore_eos": True, "stream": True}) as busy:
        lines = busy.iter_lines()  # kept referenced: a collected iterator closes the connection
        assert "error" not in next(line for line in lines if text_line(line))
        assert d.model("tiny")["leases"] == 1
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.completions.create, model="tiny2", prompt="room later", max_tokens=2)
            wait_for(lambda: d.model("tiny2")["waiting"] == 1, 60, what="the request to wait for tiny")
            assert d.model("tiny")["state"] == "ready" and not waiting.done()
            busy.close()  # the client leaves: tiny idles, and goes for tiny2
            assert waiting.result(timeout=120).usage.completion_tokens
    assert d.model("tiny2")["state"] == "ready" and d.model("tiny")["last_eviction"]["reason"] == "admission"


def test_ttl_waits_for_the_lease_then_evicts(daemon_factory, model_dir: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path / "ttl.toml", f"""
[server]
model_dirs = ["{model_dir}"]
default_ttl_s = 0.5
housekeeping_s = 0.1
""")
    d = daemon_factory("--config", str(config))
    with httpx.stream("POST", d.v1 + "/completions", timeout=60, json={
            "model": "tiny", "prompt": "long", "max_tokens": 8000, "ignore_eos": True, "stream": True}) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if text_line(line))  # its first token: the worker is ready
        t0 = time.monotonic()
        while time.monotonic() - t0 < 4 * 0.5:  # the request outlives the TTL several times over
            m = d.model("tiny")
            assert m["state"] == "ready" and m["leases"] == 1, "TTL evicted a worker with a request in flight"
            next(lines)
    wait_for(lambda: d.model("tiny")["state"] == "stopped", 15, what="the TTL eviction")
    assert d.model("tiny")["last_eviction"]["reason"] == "ttl"


def test_pinned_model_loads_at_start_and_outlives_its_ttl(daemon_factory, model_dir: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path / "pinned.toml", f"""
[server]
default_ttl_s = 0.2
housekeeping_s = 0.05

[models.pin]
path = "{model_dir / 'tiny'}"
pinned = true
""")
    d = daemon_factory("--config", str(config))
    wait_for(lambda: d.model("pin")["state"] == "ready", 60, what="the pinned model to load at start")
    pid = d.model("pin")["pid"]
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:
        assert d.model("pin")["state"] == "ready" and d.model("pin")["pid"] == pid
    assert d.model("pin")["pinned"] is True and d.model("pin")["ttl_remaining_s"] is None
    assert evict(d, "pin")["pid"] == pid  # an explicit evict still removes it
    assert_gone([pid])


def test_hard_memory_pressure_aborts_the_busy_worker(daemon_factory, model_dir: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path / "pressure.toml", f"""
[server]
model_dirs = ["{model_dir}"]
housekeeping_s = 0.05
max_resumes = 0  # with resumes on, the stream waits for the pressure to end (test_resume.py)

[memory]
pressure_soft = 0.001
pressure_hard = 0.002
""")
    d = daemon_factory("--config", str(config))
    client = openai.OpenAI(base_url=d.v1, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.APIError) as err:
        for _ in client.completions.create(model="tiny", prompt="pressure", stream=True, **LONG):
            pass
    assert err.value.body["code"] == "model_evicted"
    wait_for(lambda: d.model("tiny")["state"] == "stopped", 15, what="the pressure eviction")
    assert d.model("tiny")["last_eviction"]["reason"] == "pressure-hard"
