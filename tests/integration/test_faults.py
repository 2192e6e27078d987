"""Fault injection with real processes: crashes, crash loops, hangs, orphans, hostile frames,
foreign protocol versions, shutdown under load. Each test fails when the handling it checks is removed."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import zmq

from protocol.messages import PROTOCOL_VERSION
from tests.conftest import Daemon, assert_gone, make_model, start_daemon, wait_for

LONG = {"max_tokens": 8000, "extra_body": {"ignore_eos": True}}


def config(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return str(path)


def load(d: Daemon, model: str) -> int:
    r = httpx.post(f"{d.url}/api/models/{model}/load", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["pid"]


def stream_error(d: Daemon, model: str, after_first_chunk) -> tuple[int, dict | None, float]:
    """Stream until it ends; call `after_first_chunk()` once. Returns (chunks, error body, seconds after the call)."""
    client = openai.OpenAI(base_url=d.v1, api_key="unused", max_retries=0, timeout=60)
    chunks, t_fault = 0, None
    try:
        for _ in client.completions.create(model=model, prompt="Tell me", stream=True, **LONG):
            chunks += 1
            if chunks == 1:
                after_first_chunk()
                t_fault = time.monotonic()
    except openai.APIError as exc:
        return chunks, exc.body, time.monotonic() - t_fault
    return chunks, None, time.monotonic() - t_fault


def test_worker_crash_mid_stream_fails_its_requests_and_others_keep_serving(daemon_factory, model_dir: Path,
                                                                           tmp_path: Path) -> None:
    """With resumes off (test_resume.py has them on), a crash fails its streams at once."""
    daemon = daemon_factory("--config", config(tmp_path, "off", f"""
[server]
model_dirs = ["{model_dir}"]
max_resumes = 0
"""))
    other = load(daemon, "tiny2")
    victim = load(daemon, "tiny")
    chunks, error, seconds = stream_error(daemon, "tiny", lambda: os.kill(victim, signal.SIGKILL))
    assert chunks >= 1 and error["code"] == "worker_crashed"
    print(f"stream ended {seconds:.3f}s after the SIGKILL")
    status = daemon.model("tiny")
    assert status["crashes"] == 1 and "-9" in status["last_error"]
    assert daemon.model("tiny2")["pid"] == other and daemon.model("tiny2")["state"] == "ready"
    ok = httpx.post(daemon.v1 + "/completions", json={"model": "tiny", "prompt": "again", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and daemon.model("tiny")["pid"] not in (None, victim)


def test_crash_before_the_first_token_is_an_http_502(daemon_factory, model_dir: Path, tmp_path: Path) -> None:
    d = daemon_factory("--config", config(tmp_path, "slow", f"""
[server]
max_resumes = 0  # with resumes on, it waits for the next worker instead (test_resume.py)

[models.slow]
path = "{model_dir / 'tiny'}"
worker_args = ["--fault", "slow-steps"]
"""))
    pid = load(d, "slow")

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as http:
            req = asyncio.create_task(http.post(d.v1 + "/completions",
                                                json={"model": "slow", "prompt": "x", "max_tokens": 50}))
            async def in_flight() -> None:
                while not (await http.get(d.url + "/api/status")).json()["models"][0]["in_flight"]:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)  # polling the daemon's API: no event to wait on

            await asyncio.wait_for(in_flight(), 30)  # polled with a deadline
            os.kill(pid, signal.SIGKILL)
            return await req

    resp = asyncio.run(main())
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "worker_crashed"


def test_crash_loop_marks_the_model_failed_until_an_explicit_load(daemon_factory, model_dir: Path,
                                                                   tmp_path: Path) -> None:
    _broken_model(tmp_path / "broken")
    d = daemon_factory("--config", config(tmp_path, "loop", f"""
[server]
model_dirs = ["{model_dir}"]
crash_limit = 2
restart_backoff_s = 0.05

[models.broken]
path = "{tmp_path / 'broken'}"
"""))
    for _ in range(2):
        ok = httpx.post(d.v1 + "/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200  # an ordinary request restarts it (after a short backoff)
        pid = d.model("tiny")["pid"]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: d.model("tiny")["pid"] is None, 10, what="the crash to be seen")
    status = d.model("tiny")
    assert status["state"] == "failed" and "2 crashes" in status["last_error"]
    refused = httpx.post(d.v1 + "/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=30)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_load_failed"
    assert d.model("tiny")["restarts"] == 1  # refused without spawning again
    load(d, "tiny")  # an explicit load clears the failed state
    assert d.model("tiny")["state"] == "ready"

    # a model that cannot load is marked failed at once: no respawn loop
    first = httpx.post(d.v1 + "/completions", json={"model": "broken", "prompt": "x"}, timeout=60)
    assert first.status_code == 503 and "failed to load" in first.json()["error"]["message"]
    again = httpx.post(d.v1 + "/completions", json={"model": "broken", "prompt": "x"}, timeout=60)
    assert again.status_code == 503 and "marked failed" in again.json()["error"]["message"]
    assert d.model("broken")["restarts"] == 0 and d.model("broken")["stderr_tail"]


def test_an_unexpected_exception_in_the_worker_is_a_crash(daemon_factory, model_dir: Path, tmp_path: Path) -> None:
    d = daemon_factory("--config", config(tmp_path, "raise", f"""
[server]
crash_limit = 5

[models.raiser]
path = "{model_dir / 'tiny'}"
worker_args = ["--fault", "crash-in-loop"]
"""))
    pid = load(d, "raiser")
    client = openai.OpenAI(base_url=d.v1, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.APIError) as err:
        list(client.completions.create(model="raiser", prompt="Tell me", stream=True, max_tokens=5))
    assert err.value.body["code"] == "worker_crashed"
    assert "RuntimeError: fault: crash-in-loop" in err.value.body["message"]  # the worker said why, while it could
    assert_gone([pid])
    status = wait_for(lambda: (m := d.model("raiser"))["crashes"] == 1 and m, 10, what="the crash to be recorded")
    assert "code 7" in status["last_error"] and "unexpected error" in status["last_error"]
    log = (d.state_dir / "logs" / "worker-raiser.log").read_text()
    assert "Traceback (most recent call last)" in log and "RuntimeError: fault: crash-in-loop" in log
    assert "[crash]" in (d.state_dir / "daemon.log").read_text()


def test_a_failed_engine_step_fails_the_batch_and_ends_the_worker(daemon_factory, model_dir: Path,
                                                                  tmp_path: Path) -> None:
    """A generator that raised mid-step is unusable: the worker must not stay up failing every request."""
    d = daemon_factory("--config", config(tmp_path, "step", f"""
[server]
crash_limit = 5

[models.flaky]
path = "{model_dir / 'tiny'}"
worker_args = ["--fault", "step-raises"]
"""))
    pid = load(d, "flaky")
    r = httpx.post(d.v1 + "/completions", json={"model": "flaky", "prompt": "x", "max_tokens": 5}, timeout=60)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert "fault: step-raises" in r.json()["error"]["message"]
    assert_gone([pid])
    status = wait_for(lambda: (m := d.model("flaky"))["crashes"] == 1 and m, 10, what="the crash to be recorded")
    assert "code 7" in status["last_error"]


def _broken_model(path: Path) -> None:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (path / "model.safetensors").write_bytes(b"not a safetensors file")


def test_hung_worker_is_detected_killed_and_its_requests_failed(daemon_factory, model_dir: Path,
                                                                tmp_path: Path) -> None:
    d = daemon_factory("--config", config(tmp_path, "hang", f"""
[server]
model_dirs = ["{model_dir}"]
heartbeat_s = 0.2
hang_timeout_s = 2.0
housekeeping_s = 0.1
max_resumes = 0  # with resumes on, the stream continues on the next worker (test_resume.py)
"""))
    pid = load(d, "tiny")
    chunks, error, seconds = stream_error(d, "tiny", lambda: os.kill(pid, signal.SIGSTOP))
    assert error["code"] == "worker_crashed"
    print(f"hang detected and the stream failed {seconds:.2f}s after SIGSTOP (timeout 2.0s)")
    assert_gone([pid])
    assert "hung" in d.model("tiny")["last_error"]
    # evidence before the kill: every thread's Python stack, written by the worker itself into its log
    worker_log = d.state_dir / "logs" / "worker-tiny.log"
    stacks = wait_for(lambda: "(most recent call first)" in worker_log.read_text() and worker_log.read_text(), 10,
                      what="the hung worker's stacks in its log")
    assert "Thread 0x" in stacks and 'File "' in stacks and "in run" in stacks  # the loop's frames among them
    assert "python stacks in" in (d.state_dir / "daemon.log").read_text()


def test_a_prefill_longer_than_the_hang_timeout_is_not_a_hang(daemon_factory, tmp_path: Path) -> None:
    """On this CPU a `small` model prefills ~0.1 s a token: the old fixed step (512 tokens, here the whole
    ~80-token prompt in one step, ~8 s) ran past a 2 s hang timeout and the worker was killed as hung.
    Steps bounded by time keep the loop turning, so the request completes on the same worker."""
    make_model(tmp_path / "small", preset="small")
    d = daemon_factory("--config", config(tmp_path, "longprefill", f"""
[server]
hang_timeout_s = 2.0
housekeeping_s = 0.1

[models.small]
path = "{tmp_path / 'small'}"
"""))
    pid = load(d, "small")
    system = "You are a careful assistant. " + "Answer briefly and cite the rule you used. " * 2
    r = httpx.post(d.v1 + "/chat/completions", timeout=120, json={
        "model": "small", "max_tokens": 2, "messages": [{"role": "system", "content": system},
                                                        {"role": "user", "content": "Hello"}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] >= 60
    status = d.model("small")
    assert status["pid"] == pid and status["crashes"] == 0 and status["last_error"] is None


def test_slow_prefill_and_slow_steps_are_not_a_hang(daemon_factory, model_dir: Path, tmp_path: Path) -> None:
    d = daemon_factory("--config", config(tmp_path, "slowlive", f"""
[server]
heartbeat_s = 0.2
hang_timeout_s = 1.0
housekeeping_s = 0.1
prefill_step_size = 16

[models.slow]
path = "{model_dir / 'tiny'}"
worker_args = ["--fault", "slow-steps"]
"""))
    pid = load(d, "slow")
    prompt = "a long prompt that takes many prefill steps " * 12  # ~10 steps of 0.4 s: 4x the hang timeout
    r = httpx.post(d.v1 + "/completions", json={"model": "slow", "prompt": prompt, "max_tokens": 3}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 100
    assert d.model("slow")["pid"] == pid and d.model("slow")["crashes"] == 0


def test_workers_exit_when_the_supervisor_is_killed_and_leftovers_are_reaped(model_dir: Path, tmp_path: Path) -> None:
    state = tmp_path / "orphans"
    d = start_daemon(state, "--model-dir", str(model_dir))
    try:
        lifeline_pid = load(d, "tiny")
        stuck_pid = load(d, "tiny2")
        os.kill(stuck_pid, signal.SIGSTOP)  # a stopped worker cannot notice its lifeline: it stays behind
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(10)
        assert_gone([lifeline_pid], timeout=10)  # the lifeline: gone by itself
        assert psutil.pid_exists(stuck_pid)
        d2 = start_daemon(state, "--model-dir", str(model_dir))  # stale socket and daemon file in place
        try:
            assert_gone([stuck_pid], timeout=10)  # reaped at start-up from its pidfile
            ok = httpx.post(d2.v1 + "/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                            timeout=60)
            assert ok.status_code == 200
        finally:
            assert d2.stop() == 0
    finally:
        for pid in (stuck_pid,):
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)


def test_second_daemon_on_the_same_state_dir_is_refused(daemon: Daemon) -> None:
    import subprocess

    from tests.conftest import MLXSUP

    out = subprocess.run([*MLXSUP, "serve", "--port", "0", "--state-dir", str(daemon.state_dir)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "already runs" in out.stderr


def test_malformed_frames_are_dropped_and_serving_goes_on(daemon: Daemon) -> None:
    pid = load(daemon, "tiny")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 10_000)  # close() waits until the frames are delivered
    sock.connect(json.loads((daemon.state_dir / "daemon.json").read_text())["router"])  # the daemon's own word
    import msgpack

    frames = [b"\xc1\xc1garbage", msgpack.packb([1, 2]), msgpack.packb({"v": 1, "k": "tokens", "chunks": [[1]]}),
              msgpack.packb({"v": 1, "k": "nope"}), msgpack.packb({"v": 99, "k": "bye"}), os.urandom(1 << 20)]
    for frame in frames:
        sock.send(frame)
    sock.send_multipart([b"a", b"b", b"c"])
    sock.close()
    ctx.term()
    wait_for(lambda: "dropped" in (daemon.state_dir / "daemon.log").read_text(), 10, what="the drops to be logged")
    ok = httpx.post(daemon.v1 + "/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and daemon.model("tiny")["pid"] == pid


def test_worker_of_another_protocol_version_is_refused(daemon_factory, model_dir: Path, tmp_path: Path) -> None:
    d = daemon_factory("--config", config(tmp_path, "foreign", f"""
[models.future]
path = "{model_dir / 'tiny'}"
worker_args = ["--fault", "foreign-protocol"]
"""))
    r = httpx.post(d.v1 + "/completions", json={"model": "future", "prompt": "x"}, timeout=60)
    assert r.status_code == 503 and f"protocol version {PROTOCOL_VERSION + 1}" in r.json()["error"]["message"]
    wait_for(lambda: d.model("future")["pid"] is None, 10, what="the refused worker to be gone")


def test_sigterm_drains_then_aborts_streams_and_exits_zero(daemon_factory, model_dir: Path, tmp_path: Path) -> None:
    d = daemon_factory("--config", config(tmp_path, "term", f"""
[server]
model_dirs = ["{model_dir}"]
shutdown_drain_s = 0.5
"""))
    pid = load(d, "tiny")
    chunks, error, _ = stream_error(d, "tiny", lambda: d.proc.send_signal(signal.SIGTERM))
    assert error["code"] == "model_evicted"  # a clean error event, not a cut stream
    assert d.proc.wait(30) == 0
    assert_gone([pid])
    assert not (d.state_dir / "daemon.json").exists()


def test_second_sigint_forces_a_stuck_shutdown(daemon_factory, model_dir: Path, tmp_path: Path) -> None:
    d = daemon_factory("--config", config(tmp_path, "force", f"""
[server]
shutdown_drain_s = 0
settle_grace_s = 60
kill_timeout_s = 60

[models.stuck]
path = "{model_dir / 'tiny'}"
worker_args = ["--fault", "ignore-sigterm", "--fault", "hang-on-evict"]
"""))
    pid = load(d, "stuck")
    d.proc.send_signal(signal.SIGINT)
    wait_for(lambda: "[shutdown]" in (d.state_dir / "daemon.log").read_text(), 10, what="the shutdown to start")
    with pytest.raises(subprocess.TimeoutExpired):
        d.proc.wait(1.0)  # stuck on the worker, as designed
    d.proc.send_signal(signal.SIGINT)
    assert d.proc.wait(15) == 0
    assert_gone([pid])


SLOWED = """
[server]
heartbeat_s = 0.2
hang_timeout_s = 2.0
housekeeping_s = 0.1

[models.slowed]
path = "{path}"
worker_args = ["--fault", "{fault}"]
"""


def test_a_slowed_worker_whose_steps_outlast_the_hang_timeout_is_not_killed(daemon_factory, model_dir: Path,
                                                                            tmp_path: Path) -> None:
    """From its 4th step on the worker runs 1/20 of the time (a helper process stops and continues it), so a step
    sized at full speed takes several hang timeouts: the watchdog's Pulses (the main thread held in an MLX
    evaluation, using CPU) keep it alive, and the long prompt completes on the same worker."""
    d = daemon_factory("--config", config(tmp_path, "slowed", SLOWED.format(path=model_dir / "tiny", fault="slowed")))
    pid = load(d, "slowed")
    prompt = " ".join(f"w{i}" for i in range(1200))
    r = httpx.post(d.v1 + "/completions", json={"model": "slowed", "prompt": prompt, "max_tokens": 4}, timeout=600)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 2000
    status = d.model("slowed")
    assert status["pid"] == pid and status["crashes"] == 0 and status["last_error"] is None
    log = (d.state_dir / "daemon.log").read_text()
    assert "computing" in log and "not a hang" in log  # a turn outlasted the timeout, and the Pulses said why
    cycler = int(wait_for(lambda: re.search(r"stopped and continued by pid=(\d+)",
                                            (d.state_dir / "logs" / "worker-slowed.log").read_text()), 10,
                          what="the slowdown's helper in the worker's log").group(1))
    assert cycler in d.children()
    r = httpx.post(f"{d.url}/api/models/slowed/evict", timeout=60)
    assert r.status_code == 200, r.text
    assert_gone([pid, cycler])


@pytest.mark.parametrize("fault", ["spin-in-step", "block-in-step"])
def test_a_loop_spinning_in_python_or_deadlocked_is_still_killed(daemon_factory, model_dir: Path, tmp_path: Path,
                                                                 fault: str) -> None:
    """The watchdog sends nothing for a main thread that runs Python for ever or waits on a lock: the hang timeout
    kills it, as it does a stopped worker, and the request (resumes off: the fault would strike again) fails."""
    d = daemon_factory("--config", config(tmp_path, fault, SLOWED.format(path=model_dir / "tiny", fault=fault)
                                          .replace("[models", "max_resumes = 0\n\n[models")))
    pid = load(d, "slowed")
    chunks, error, _ = stream_error(d, "slowed", lambda: None)
    assert error is not None and error["code"] == "worker_crashed", error
    assert_gone([pid])
    assert "hung: no message from its generation loop" in d.model("slowed")["last_error"]
    worker_log = (d.state_dir / "logs" / "worker-slowed.log").read_text()
    assert "not computing" in worker_log  # the watchdog looked, and saw no computing
