"""Worker groups with real processes: two ranks of MLX's ring backend on loopback (CPU) serve one
model as one worker. Greedy parity with mlx_lm.generate in one process (tensor and pipeline
sharding, batched), and the lifecycle of every rank: evict, a rank killed mid-stream, the
supervisor killed, a rank that hangs, and a remote rank started through ssh."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.conftest import MLXSUP, Daemon, assert_gone, start_daemon, wait_for

LONG = {"max_tokens": 8000, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3_5 model (hybrid; its text model has pipeline())."""
    path = tmp_path_factory.mktemp("models35") / "tiny35"
    subprocess.run([*MLXSUP, "make-model", str(path), "--preset", "tiny", "--arch", "qwen3_5"], check=True,
                   capture_output=True)
    return path


def config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "groups.toml"
    path.write_text("[server]\nspare_workers = 0\n" + text)
    return str(path)


def group_model(name: str, path: Path, group: str = "ranks = 2") -> str:
    return f'[models.{name}]\npath = "{path}"\ngroup = {{ {group} }}\n'


def load(d: Daemon, model: str) -> list[int]:
    """Load a group; the pids of its ranks, rank 0 first."""
    r = httpx.post(f"{d.url}/api/models/{model}/load", timeout=120)
    assert r.status_code == 200, r.text
    ranks = d.model(model)["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["pid"] for r in ranks), ranks
    pids = [r["pid"] for r in ranks]
    d.seen_pids.update(pids)
    return pids


REFERENCE = """
import json, sys
from mlx_lm import load, generate
model, tok = load(sys.argv[1])
print(json.dumps([generate(model, tok, p, max_tokens=int(sys.argv[2])) for p in json.loads(sys.argv[3])]))
"""


@pytest.mark.parametrize("shard", ["tensor", "pipeline"])
def test_a_group_serves_with_greedy_parity_batched(daemon_factory, model_dir: Path, qwen35_dir: Path,
                                                   tmp_path: Path, shard: str) -> None:
    """Llama shards by tensor, qwen3_5 by pipeline; three concurrent requests share the group's batch."""
    path = model_dir / "tiny" if shard == "tensor" else qwen35_dir
    d = daemon_factory("--config", config(tmp_path, group_model("g", path, f'ranks = 2, shard = "{shard}"')))
    prompts = ["In the beginning there was", "Once upon a time", "The quick brown fox jumps over"]
    max_tokens = 24
    ref = json.loads(subprocess.run([sys.executable, "-c", REFERENCE, str(path), str(max_tokens), json.dumps(prompts)],
                                    check=True, capture_output=True, text=True).stdout)
    pids = load(d, "g")
    client = openai.AsyncOpenAI(base_url=d.v1, api_key="unused", max_retries=0, timeout=120)

    async def main() -> list[str]:
        results = await asyncio.gather(*(client.completions.create(model="g", prompt=p, max_tokens=max_tokens,
                                                                   temperature=0) for p in prompts))
        return [r.choices[0].text for r in results]

    got = asyncio.run(main())
    assert got == ref, f"group {got} != mlx_lm.generate {ref}"
    # the peak comes with the heartbeats (one a second): one sent before the batch formed may still be the latest
    wait_for(lambda: d.model("g")["peak_batch_size"] >= 2, 10, what="a peak batch size of at least 2 (batching)")
    assert [r["pid"] for r in d.model("g")["ranks"]] == pids, "one group served every request"


def test_a_seeded_sampled_request_draws_as_one_worker_does(daemon_factory, model_dir: Path, tmp_path: Path) -> None:
    """Every rank samples the same token (a rank that drew another would feed the group a different input)."""
    d = daemon_factory("--config", config(tmp_path, group_model("g", model_dir / "tiny")
                                          + f'[models.one]\npath = "{model_dir / "tiny"}"\n'))
    body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    texts = [httpx.post(d.v1 + "/completions", json={"model": m, **body}, timeout=120).json()["choices"][0]["text"]
             for m in ("one", "g")]
    assert texts[0] == texts[1]


def test_evict_ends_every_rank(daemon_factory, model_dir: Path, tmp_path: Path) -> None:
    d = daemon_factory("--config", config(tmp_path, group_model("g", model_dir / "tiny")))
    pids = load(d, "g")
    out = subprocess.run([*MLXSUP, "status", "--url", d.url], capture_output=True, text=True, timeout=30)
    assert f"rank 1 127.0.0.1 pid {pids[1]}" in out.stdout, out.stdout
    report = httpx.post(f"{d.url}/api/models/g/evict", timeout=60).json()
    assert report["evicted"] and report["exit"] == 0 and report["signals"] == [], report
    assert_gone(pids)
    assert d.model("g")["state"] == "stopped"
    rank1_log = (d.state_dir / "logs" / "worker-g.rank1.log").read_text()
    assert "[group] model=g rank=1 stop after" in rank1_log, "rank 1 ran its own orderly exit, on rank 0's word"


def stream_signalling_rank_1(d: Daemon, pids: list[int], sig: int) -> tuple[int, dict | None]:
    """Stream from group g, sending `sig` to rank 1 at the first chunk: (chunks read, the error body or None)."""
    client = openai.OpenAI(base_url=d.v1, api_key="unused", max_retries=0, timeout=60)
    chunks, error = 0, None
    try:
        for _ in client.completions.create(model="g", prompt="Tell me", stream=True, **LONG):
            chunks += 1
            if chunks == 1:
                os.kill(pids[1], sig)
    except openai.APIError as exc:
        error = exc.body
    return chunks, error


def test_sigkill_of_rank_1_mid_stream_is_a_clean_worker_crashed(daemon_factory, model_dir: Path,
                                                                tmp_path: Path) -> None:
    d = daemon_factory("--config", config(tmp_path, "max_resumes = 0\n" + group_model("g", model_dir / "tiny")))
    pids = load(d, "g")
    chunks, error = stream_signalling_rank_1(d, pids, signal.SIGKILL)
    assert chunks >= 1 and error is not None and error["code"] == "worker_crashed", error
    assert_gone(pids)
    status = d.model("g")
    assert status["crashes"] == 1 and "rank 1" in status["last_error"], status["last_error"]
    ok = httpx.post(d.v1 + "/completions", json={"model": "g", "prompt": "again", "max_tokens": 2}, timeout=120)
    assert ok.status_code == 200, ok.text
    assert not set(r["pid"] for r in d.model("g")["ranks"]) & set(pids), "the next request started a fresh group"


def test_a_rank_dying_while_the_group_is_idle_ends_the_group(daemon_factory, model_dir: Path,
                                                             tmp_path: Path) -> None:
    """Idle, rank 0 waits on its socket and would never notice: the supervisor, watching every rank, ends it."""
    d = daemon_factory("--config", config(tmp_path, group_model("g", model_dir / "tiny")))
    pids = load(d, "g")
    os.kill(pids[1], signal.SIGKILL)
    assert_gone(pids, timeout=10)
    status = wait_for(lambda: (m := d.model("g"))["crashes"] == 1 and m, 10, what="the crash in status")
    assert "rank 1" in status["last_error"], status["last_error"]


def test_sigkill_of_the_supervisor_leaves_no_rank(daemon_factory, model_dir: Path, tmp_path: Path) -> None:
    d = daemon_factory("--config", config(tmp_path, group_model("g", model_dir / "tiny")))
    pids = load(d, "g")
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(10)
    assert_gone(pids, timeout=10)  # rank 0 by its lifeline; rank 1 by its own, or rank 0's stop


def test_a_rank_left_behind_by_a_dead_supervisor_is_reaped_at_the_next_start(daemon_factory, model_dir: Path,
                                                                              tmp_path: Path) -> None:
    """Rank 1 stopped (it cannot notice its lifeline), the supervisor SIGKILLed: rank 0 still goes (its lifeline's
    hard timer, though its stop for rank 1 never completes); the next daemon on the state directory reaps rank 1."""
    cfg = config(tmp_path, group_model("g", model_dir / "tiny"))
    d = daemon_factory("--config", cfg)
    pids = load(d, "g")
    os.kill(pids[1], signal.SIGSTOP)
    try:
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(10)
        assert_gone(pids[:1], timeout=15)
        assert psutil.pid_exists(pids[1])
        d2 = start_daemon(d.state_dir, "--config", cfg)
        try:
            assert_gone(pids[1:], timeout=10)  # from its pidfile: its title starts "mlxsup-worker g rank 1"
        finally:
            assert d2.stop() == 0
    finally:
        if psutil.pid_exists(pids[1]):
            os.kill(pids[1], signal.SIGKILL)


def test_a_hung_rank_is_detected_like_a_hung_worker(daemon_factory, model_dir: Path, tmp_path: Path) -> None:
    """Rank 1 stopped: rank 0 waits in a collective, its heartbeats stop, and the hang kill ends the group."""
    d = daemon_factory("--config", config(tmp_path, "hang_timeout_s = 2\nhousekeeping_s = 0.2\nmax_resumes = 0\n"
                                          + group_model("g", model_dir / "tiny")))
    pids = load(d, "g")
    chunks, error = stream_signalling_rank_1(d, pids, signal.SIGSTOP)
    assert chunks >= 1 and error is not None and error["code"] == "worker_crashed", error
    assert_gone(pids)
    assert "hung" in d.model("g")["last_error"]
    rank1_log = (d.state_dir / "logs" / "worker-g.rank1.log").read_text()
    assert "(most recent call first)" in rank1_log, "the stopped rank's stacks were asked for before the kill"


def test_a_remote_rank_runs_through_ssh(daemon_factory, model_dir: Path, tmp_path: Path) -> None:
    """hosts = ["127.0.0.1", "otherhost"]: rank 1 is started as `ssh otherhost CMD` (a fake ssh on PATH that
    runs CMD here), serves, and ends with the group's evict."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "ssh"
    fake.write_text('#!/bin/sh\n# fake ssh: drop the options and the host, run the command here\n'
                    'while [ "$1" = "-o" ]; do shift 2; done\nshift\necho "$@" > "$(dirname "$0")/ssh-command"\n'
                    'exec /bin/sh -c "$*"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    d = daemon_factory("--config", config(tmp_path, group_model("g", model_dir / "tiny",
                                                                'ranks = 2, hosts = ["127.0.0.1", '
                                                                '{ ssh = "otherhost", ip = "127.0.0.1" }]')),
                       env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    pids = load(d, "g")
    assert "--group-rank 1" in (bin_dir / "ssh-command").read_text()
    got = httpx.post(d.v1 + "/completions", json={"model": "g", "prompt": "hi", "max_tokens": 4, "temperature": 0},
                     timeout=60)
    assert got.status_code == 200 and got.json()["usage"]["completion_tokens"] >= 1, got.text
    assert httpx.post(f"{d.url}/api/models/g/evict", timeout=60).json()["exit"] == 0
    assert_gone(pids)


def test_a_rank_that_cannot_be_started_fails_the_load_and_ends_the_others(daemon_factory, model_dir: Path,
                                                                         tmp_path: Path) -> None:
    """No ssh on PATH for the remote rank: the load fails saying so, and rank 0, started first, is ended."""
    empty = tmp_path / "no-ssh"
    empty.mkdir()
    hosts = 'ranks = 2, hosts = ["127.0.0.1", { ssh = "otherhost", ip = "127.0.0.1" }]'
    d = daemon_factory("--config", config(tmp_path, group_model("g", model_dir / "tiny", hosts)),
                       env={"PATH": str(empty)})
    r = httpx.post(f"{d.url}/api/models/g/load", timeout=120)
    assert r.status_code >= 500 and "could not start" in r.text, r.text
    spawned = [int(pid) for pid in re.findall(r"\[spawn\] model=g pid=(\d+)", (d.state_dir / "daemon.log").read_text())]
    assert len(spawned) == 1, "rank 0 was started, then rank 1 could not be"
    assert_gone(spawned)
    assert "could not start" in d.model("g")["last_error"]


def test_a_stream_whose_rank_is_killed_resumes_on_the_next_group(daemon_factory, model_dir: Path,
                                                                 tmp_path: Path) -> None:
    """With resumes on (the default), a group's crash suspends its streams and the next group continues them:
    the greedy text is the uninterrupted run's."""
    d = daemon_factory("--config", config(tmp_path, group_model("g", model_dir / "tiny")))
    pids = load(d, "g")
    body = {"model": "g", "prompt": "Tell me", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(d.v1 + "/completions", json=body, timeout=120).json()["choices"][0]["text"]
    client = openai.OpenAI(base_url=d.v1, api_key="unused", max_retries=0, timeout=120)
    parts = []
    for chunk in client.completions.create(stream=True, **{k: v for k, v in body.items() if k != "ignore_eos"},
                                           extra_body={"ignore_eos": True}):
        parts.append(chunk.choices[0].text)
        if len(parts) == 3:
            os.kill(pids[1], signal.SIGKILL)
    assert "".join(parts) == whole
    assert_gone(pids)
    status = d.model("g")
    assert status["resumed"] == 1 and status["crashes"] == 1, status
