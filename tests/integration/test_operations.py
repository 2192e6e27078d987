"""Operating the daemon: effective configuration, logs, /metrics, load progress, cold-load
keep-alives, and models found in a Hugging Face cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import openai

from tests.conftest import MLXSUP, Daemon, Started, run_to_the_end, wait_for


def mlxsup(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The CLI run to its end, it and whatever it started proven gone after it (run_to_the_end)."""
    return run_to_the_end([*MLXSUP, *args], 120, {**os.environ, **(env or {})})


def test_config_show_applies_file_then_environment_then_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('[server]\nport = 9001\nhost = "127.0.0.2"\nlog_level = "debug"\napi_key = "hidden"\n'
                   '[memory]\nceiling = "2GiB"\n')
    out = mlxsup("config", "show", "--local", "--json", "--config", str(cfg), "--state-dir", str(tmp_path / "s"),
                 env={"MLXSUP_PORT": "9002", "MLXSUP_CONFIG": "/nonexistent"})
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    s = shown["config"]["server"]
    assert shown["config_file"] == str(cfg)
    assert (s["host"], s["port"], s["log_level"]) == ("127.0.0.2", 9002, "debug")  # env beats file
    assert s["state_dir"] == str(tmp_path / "s")  # the flag beats both
    assert shown["config"]["memory"]["ceiling"] == 2 * 2**30 and s["api_key"] == "<set>" and "hidden" not in out.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text("[memory]\nceiling = 'lots'\n")
    refused = mlxsup("config", "show", "--local", "--config", str(bad))
    assert refused.returncode == 2 and "memory.ceiling" in refused.stderr
    missing = mlxsup("config", "show", "--local", "--config", str(tmp_path / "absent.toml"))
    assert missing.returncode == 2 and "no such config file" in missing.stderr


def test_logs_of_the_daemon_and_of_a_worker(daemon: Daemon) -> None:
    httpx.post(daemon.url + "/api/models/tiny/load", timeout=60)
    state = ["--state-dir", str(daemon.state_dir)]
    main = mlxsup("logs", *state)
    assert main.returncode == 0 and "[start] mlxsup serving" in main.stdout
    worker = mlxsup("logs", "tiny", "-n", "200", *state)
    assert worker.returncode == 0 and "[load] model=tiny" in worker.stdout
    assert mlxsup("logs", "never-ran", *state).returncode == 2

    started = Started([*MLXSUP, "logs", "-f", "-n", "0", *state], stdout=subprocess.PIPE)
    follower = started.proc
    try:
        assert follower.stdout is not None
        fd = follower.stdout.fileno()
        os.set_blocking(fd, False)
        seen = bytearray()

        def evict_line() -> bool:
            try:
                seen.extend(os.read(fd, 65536))
            except BlockingIOError:  # nothing new yet
                pass
            return b"[evict] model=tiny" in seen

        httpx.post(daemon.url + "/api/models/tiny/evict", timeout=60)
        wait_for(evict_line, 15, what="`mlxsup logs -f` to print the eviction")
    finally:
        started.gone()  # SIGTERM ends it


def test_metrics_count_requests_tokens_latency_and_memory(daemon: Daemon) -> None:
    client = openai.OpenAI(base_url=daemon.v1, api_key="unused", max_retries=0)
    client.completions.create(model="tiny", prompt="count me", max_tokens=5, extra_body={"ignore_eos": True})
    text = httpx.get(daemon.url + "/metrics").text
    lines = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line and not line.startswith("#")}
    assert lines['mlxsup_requests_total{endpoint="/v1/completions",model="tiny",outcome="completed"}'] >= 1
    assert lines['mlxsup_completion_tokens_total{model="tiny"}'] >= 5
    assert lines['mlxsup_time_to_first_token_seconds_count{model="tiny"}'] >= 1
    assert lines['mlxsup_inter_token_latency_seconds_count{model="tiny"}'] >= 1
    assert lines['mlxsup_loads_total{model="tiny",outcome="ok"}'] >= 1
    assert lines['mlxsup_model_memory_bytes{model="tiny"}'] > 0
    assert lines['mlxsup_model_state{model="tiny",state="ready"}'] == 1


def test_load_shows_progress_and_the_time_it_took(daemon: Daemon) -> None:
    httpx.post(daemon.url + "/api/models/tiny2/evict", timeout=60)
    out = mlxsup("load", "tiny2", "--url", daemon.url)
    assert out.returncode == 0, out.stderr
    assert "loading tiny2:" in out.stdout and "tiny2: ready (pid" in out.stdout and out.stdout.rstrip().endswith("s")
    assert mlxsup("load", "nope", "--url", daemon.url).returncode == 2


def test_a_stream_waiting_for_a_cold_load_gets_keepalive_chunks_and_comments(daemon_factory, model_dir: Path,
                                                                             tmp_path: Path) -> None:
    """Each keep-alive of the load: a comment saying so, and a chunk with empty text (an event clients count)."""
    cfg = tmp_path / "keepalive.toml"
    cfg.write_text(f'[server]\nmodel_dirs = ["{model_dir}"]\nsse_keepalive_s = 0.05\n')
    d = daemon_factory("--config", str(cfg))
    body = {"model": "tiny", "prompt": "cold", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", d.v1 + "/completions", json=body, timeout=60) as resp:
        lines = [line for line in resp.iter_lines() if line]
    first_text = next(i for i, line in enumerate(lines) if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"])
    waited = lines[:first_text]
    comments, chunks = [line for line in waited if line.startswith(":")], [line for line in waited if line.startswith("data:")]
    assert len(comments) + len(chunks) == len(waited) and len(comments) == len(chunks) >= 2
    assert waited[0].startswith(": loading tiny: ")
    assert all(c.startswith((": loading tiny: ", ": waiting for the first token of tiny")) for c in comments)
    assert all(json.loads(c[6:])["choices"][0]["text"] == "" for c in chunks)
    assert lines[-1] == "data: [DONE]"
    chunks = openai.OpenAI(base_url=d.v1, api_key="x", max_retries=0).completions.create(
        model="tiny2", prompt="cold too", max_tokens=3, stream=True)  # the official client skips comments
    assert sum(1 for _ in chunks) >= 1


def test_models_in_a_hugging_face_cache_are_served_as_org_name(daemon_factory, model_dir: Path,
                                                               tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--acme--tiny-chat"
    shutil.copytree(model_dir / "tiny", repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    d = daemon_factory(env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    client = openai.OpenAI(base_url=d.v1, api_key="x", max_retries=0)
    assert [m.id for m in client.models.list()] == ["acme/tiny-chat"]
    out = client.chat.completions.create(model="acme/tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=3)
    assert out.model == "acme/tiny-chat" and out.usage.completion_tokens >= 1
    assert httpx.post(d.url + "/api/models/acme/tiny-chat/evict", timeout=60).json()["evicted"] is True
