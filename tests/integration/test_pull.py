"""`mlxsup pull`, `ls`, `rm` and /api/pull against a stand-in hub on loopback (standin_hub.py, HF_ENDPOINT
pointed at it, the cache in a temporary HF_HUB_CACHE), with one daemon watching that cache.

Each repo holds a model made by `make-model`; `tiny` (a model folder of the same weights) is the reference:
a pulled model must answer exactly as it does. Covered: a full pull served by repo id and short name
through the openai client; a pull cut mid-file (the stand-in holds the connection), interrupted, refused
for serving (503 while downloading, 404 after), then resumed by a Range request; a corrupt file refused and
never linked; no disk space (the free-space seam of hub/pull.py: a tmpfs cannot be mounted unprivileged);
repos that are not MLX models refused; a revision pin; `ls` and `rm`.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from supervisor.hub import store
from supervisor.hub.pull import PullError, plan, pull
from tests.conftest import MLXSUP, Daemon, assert_gone, make_model, start_daemon, wait_for
from tests.integration.standin_hub import Repo, StandInHub, folder_files

PROMPT = [{"role": "user", "content": "Tell me something"}]
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("made")
    return {"tiny": make_model(root / "tiny", seed=0), "other": make_model(root / "other", seed=1)}


@pytest.fixture(scope="module")
def hub(made: dict[str, Path]) -> Iterator[StandInHub]:
    with StandInHub() as h:
        files = folder_files(made["tiny"])
        for name in ("Tiny-4bit", "Cut-4bit", "Corrupt-4bit", "Gone-4bit", "Api-4bit"):
            h.repos[f"mlx-test/{name}"] = Repo()
            h.repos[f"mlx-test/{name}"].add(files)
        pinned = h.repos["mlx-test/Pinned"] = Repo()
        pinned.add(files, branch="v1")
        pinned.add(folder_files(made["other"]), branch="main")
        config = json.loads(files["config.json"])
        h.repos["mlx-test/Alien"] = Repo()
        h.repos["mlx-test/Alien"].add({**files, "config.json": json.dumps({**config, "model_type": "alien"}).encode()})
        h.repos["mlx-test/Torch"] = Repo()
        h.repos["mlx-test/Torch"].add({"config.json": files["config.json"], "pytorch_model.bin": b"\0" * 64})
        yield h


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf") / "hub"


@pytest.fixture(scope="module")
def env(hub: StandInHub, cache: Path) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_TELEMETRY": "1"}


@pytest.fixture(scope="module")
def daemon(made: dict[str, Path], env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("state"), "--model-dir", str(made["tiny"]), env=env)
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.v1, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(client: openai.OpenAI) -> str:
    return say(client, "tiny")


def say(client: openai.OpenAI, model: str) -> str:
    r = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=12, temperature=0)  # type: ignore
    return r.choices[0].message.content or ""


def mlxsup(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MLXSUP_", "HF_"))}
    return subprocess.run([*MLXSUP, *args], capture_output=True, text=True, timeout=300, env={**clean, **env})


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(cache: Path, repo_id: str, commit: str) -> Path:
    return store.repo_folder(cache, repo_id) / "snapshots" / commit


def test_a_pull_lands_in_the_cache_layout_and_is_served_by_repo_id_and_short_name(
        hub: StandInHub, env: dict, cache: Path, made: dict, daemon: Daemon, client: openai.OpenAI,
        reference: str) -> None:
    out = mlxsup(env, "pull", "mlx-test/Tiny-4bit")
    assert out.returncode == 0, out.stderr
    assert "pulling mlx-test/Tiny-4bit@main" in out.stdout and "complete and verified" in out.stdout
    assert "] 100% " in out.stdout and f"6/6 {WEIGHTS}" in out.stdout  # plain progress lines: not a terminal
    commit = hub.repos["mlx-test/Tiny-4bit"].refs["main"]
    folder = store.repo_folder(cache, "mlx-test/Tiny-4bit")
    assert (folder / "refs" / "main").read_text() == commit
    link = snapshot(cache, "mlx-test/Tiny-4bit", commit) / WEIGHTS
    digest = sha256(made["tiny"] / WEIGHTS)
    assert link.is_symlink() and os.readlink(link) == f"../../blobs/{digest}" and sha256(link) == digest
    assert not list(folder.rglob("*.incomplete")) and not (folder / store.MARK).exists()

    assert say(client, "mlx-test/Tiny-4bit") == reference
    assert say(client, "Tiny-4bit") == reference  # the short name: no other model is called that
    listed = {m.id: m for m in client.models.list()}
    assert listed["mlx-test/Tiny-4bit"].owned_by == "mlx-test" and listed["tiny"].owned_by == "mlxsup"
    assert listed["mlx-test/Tiny-4bit"].model_extra["loaded"] is True  # type: ignore[index]


def test_a_pull_cut_mid_file_is_never_served_and_resumes_where_it_stopped(
        hub: StandInHub, env: dict, cache: Path, made: dict, daemon: Daemon, client: openai.OpenAI,
        reference: str) -> None:
    repo, cut = "mlx-test/Cut-4bit", 300_000
    hub.release.clear()
    hub.cut[(repo, WEIGHTS)] = cut
    digest = sha256(made["tiny"] / WEIGHTS)
    part = store.repo_folder(cache, repo) / "blobs" / f"{digest}.incomplete"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MLXSUP_", "HF_"))}
    # the hub holds the connection at the cut until released: the pull's read must not time out (huggingface_hub's
    # 10 s) and resume before the Ctrl-C, however slowly this machine gets through the checks in between. And the
    # pull must hear Ctrl-C even where this run ignores SIGINT (a background job's shell sets SIG_IGN, which exec
    # keeps): a handler here is reset to the default in the child, where Python makes it KeyboardInterrupt again
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([*MLXSUP, "pull", repo], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**clean, **env, "HF_HUB_DOWNLOAD_TIMEOUT": "600"})
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        wait_for(lambda: part.exists() and part.stat().st_size == cut, 60, what="the cut to be on disk")
        with pytest.raises(openai.APIStatusError) as downloading:
            say(client, repo)
        assert downloading.value.status_code == 503 and "is downloading" in downloading.value.message
        commit = hub.repos[repo].refs["main"]
        assert not (snapshot(cache, repo, commit) / WEIGHTS).exists()  # nothing partial is linked
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        _, err = proc.communicate(timeout=60)
    finally:
        hub.release.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert_gone([proc.pid])
    assert proc.returncode == 130 and "not served until a pull completes" in err, err
    assert part.stat().st_size == cut  # kept for the resume
    for name in (repo, "Cut-4bit"):
        with pytest.raises(openai.NotFoundError) as interrupted:
            say(client, name)
        assert f"mlxsup pull {repo}" in interrupted.value.message
    assert repo not in {m.id for m in client.models.list()}

    out = mlxsup(env, "pull", repo)
    assert out.returncode == 0, out.stderr
    assert ("GET", f"/{repo}/resolve/{commit}/{WEIGHTS}", f"bytes={cut}-") in hub.requests  # resumed, not re-sent
    assert sha256(snapshot(cache, repo, commit) / WEIGHTS) == digest and not part.exists()
    assert say(client, repo) == reference


def test_a_corrupt_file_is_refused_and_never_linked(hub: StandInHub, env: dict, cache: Path, daemon: Daemon,
                                                    client: openai.OpenAI, reference: str) -> None:
    repo = "mlx-test/Corrupt-4bit"
    hub.corrupt[(repo, WEIGHTS)] = True
    try:
        out = mlxsup(env, "pull", repo)
    finally:
        hub.corrupt.clear()
    assert out.returncode == 1 and f"{WEIGHTS} does not match the hub's sha256" in out.stderr, out.stderr
    folder = store.repo_folder(cache, repo)
    commit = hub.repos[repo].refs["main"]
    blobs = {p.name for p in (folder / "blobs").iterdir()}
    assert not any(len(b) == 64 for b in blobs), blobs  # no sha256-named blob: the weights never became one
    assert not (snapshot(cache, repo, commit) / WEIGHTS).exists() and not list(folder.rglob("*.incomplete"))
    with pytest.raises(openai.NotFoundError) as failed:
        say(client, repo)
    assert "did not complete (failed" in failed.value.message

    out = mlxsup(env, "pull", repo)  # the hub serves it right now
    assert out.returncode == 0, out.stderr
    assert say(client, repo) == reference


def test_too_little_disk_space_refuses_before_writing_anything(hub: StandInHub, tmp_path: Path) -> None:
    p = plan("mlx-test/Tiny-4bit", endpoint=hub.url)
    with pytest.raises(PullError, match=f"needs {p.total} more bytes and .* has 4096 free"):
        pull(p, tmp_path / "hub", free_bytes=lambda _: 4096)  # the seam: a tmpfs cannot be mounted unprivileged
    assert not (tmp_path / "hub").exists()


def test_repos_that_are_not_mlx_models_are_refused_before_any_download(env: dict, cache: Path,
                                                                       daemon: Daemon) -> None:
    torch = mlxsup(env, "pull", "mlx-test/Torch")
    assert torch.returncode == 1 and "is not an MLX model" in torch.stderr, torch.stderr
    alien = httpx.post(daemon.url + "/api/pull", json={"model": "mlx-test/Alien"}, timeout=60)
    assert alien.status_code == 400, alien.text
    assert "model_type 'alien'" in alien.json()["error"]["message"]
    missing = mlxsup(env, "pull", "mlx-test/Nowhere")
    assert missing.returncode == 1 and "no model repository 'mlx-test/Nowhere'" in missing.stderr
    for repo in ("mlx-test/Torch", "mlx-test/Alien", "mlx-test/Nowhere"):
        assert not store.repo_folder(cache, repo).exists()


def test_a_revision_pin_pulls_that_revision(hub: StandInHub, env: dict, cache: Path, made: dict) -> None:
    out = mlxsup(env, "pull", "mlx-test/Pinned@v1")
    assert out.returncode == 0, out.stderr
    v1 = hub.repos["mlx-test/Pinned"].refs["v1"]
    folder = store.repo_folder(cache, "mlx-test/Pinned")
    assert (folder / "refs" / "v1").read_text() == v1 and not (folder / "refs" / "main").exists()
    assert sha256(snapshot(cache, "mlx-test/Pinned", v1) / WEIGHTS) == sha256(made["tiny"] / WEIGHTS)
    assert sha256(made["other"] / WEIGHTS) != sha256(made["tiny"] / WEIGHTS)  # main's weights differ


def test_api_pull_streams_progress_and_the_model_is_listed_when_done(daemon: Daemon, client: openai.OpenAI) -> None:
    events = []
    with httpx.stream("POST", daemon.url + "/api/pull", json={"model": "mlx-test/Api-4bit", "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["status"] == "success" and events[-1]["model"] == "mlx-test/Api-4bit"
    progress = [e for e in events if e["status"] == "downloading"]
    assert progress and progress[-1]["done"] == progress[-1]["total"] == events[-1]["total"]
    assert "mlx-test/Api-4bit" in {m.id for m in client.models.list()}


def test_ls_lists_models_and_rm_refuses_a_loaded_one_unless_forced(env: dict, cache: Path, daemon: Daemon,
                                                                   client: openai.OpenAI) -> None:
    repo = "mlx-test/Gone-4bit"
    assert mlxsup(env, "pull", repo).returncode == 0
    r = httpx.post(f"{daemon.url}/api/models/Gone-4bit/load", timeout=120)  # by its short name
    assert r.status_code == 200, r.text
    pid = r.json()["pid"]
    listing = mlxsup(env, "ls", "--url", daemon.url, "--json")
    assert listing.returncode == 0, listing.stderr
    row = next(m for m in json.loads(listing.stdout) if m["id"] == repo)
    assert row["family"] == "llama" and row["loaded"] is True and row["context_length"]
    assert row["path"].startswith(str(cache)) and row["size_bytes"] > 0
    table = mlxsup(env, "ls", "--url", daemon.url).stdout
    assert table.splitlines()[0].split() == ["MODEL", "SIZE", "FAMILY", "QUANT", "CONTEXT", "LOADED", "PATH"]

    refused = mlxsup(env, "rm", "Gone-4bit", "--url", daemon.url)
    assert refused.returncode == 2 and "is loaded" in refused.stderr, refused.stderr
    assert store.repo_folder(cache, repo).is_dir()
    forced = mlxsup(env, "rm", "Gone-4bit", "--force", "--url", daemon.url)
    assert forced.returncode == 0, forced.stderr
    assert f"evicted pid {pid}" in forced.stdout and f"removed {repo}" in forced.stdout
    assert_gone([pid])
    assert not store.repo_folder(cache, repo).exists()
    with pytest.raises(openai.NotFoundError):
        say(client, repo)
    assert repo not in {m.id for m in client.models.list()}


BAD_IDS = ["org--x/name", "org/.git", "org/name@" + "r" * 300, "org/name@a..b", "org/name@main:x"]


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


def test_an_unreachable_hub_is_a_503_and_the_cli_says_what_to_do_in_one_line(
        made: dict, tmp_path: Path, daemon_factory) -> None:
    """No network: httpx's ConnectError escaped the pull (a 500 internal_error, a traceback on the command line)."""
    offline = {"HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}", "HF_HUB_CACHE": str(tmp_path / "hub"),
               "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1"}
    d = daemon_factory("--model-dir", str(made["tiny"]), env=offline)
    for stream in (False, True):
        r = httpx.post(d.url + "/api/pull", json={"model": "mlx-test/Tiny-4bit", "stream": stream}, timeout=120)
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "hub_unreachable" and error["param"] == "model", error
        assert offline["HF_ENDPOINT"] in error["message"] and "network" in error["message"]
        assert "HF_ENDPOINT" in error["message"] and "HF_HUB_OFFLINE" in error["message"]
    again = httpx.post(d.url + "/api/pull", json={"model": "mlx-test/Tiny-4bit"}, timeout=120)
    assert again.status_code == 503, again.text  # not "being pulled already": a failed plan leaves no pull behind
    out = mlxsup(offline, "pull", "mlx-test/Tiny-4bit")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "cannot reach the Hugging Face hub" in out.stderr
    assert not (tmp_path / "hub").exists() or not list((tmp_path / "hub").iterdir())  # nothing written
    assert "unhandled error" not in (d.state_dir / "daemon.log").read_text()


@pytest.mark.parametrize("ref", BAD_IDS)
def test_an_id_the_hub_refuses_is_a_400_naming_the_rule_and_exit_2(ref: str, env: dict, daemon: Daemon) -> None:
    r = httpx.post(daemon.url + "/api/pull", json={"model": ref}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "model" and "ORG/NAME[@REVISION]" in error["message"], error
    out = mlxsup(env, "pull", ref)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "ORG/NAME[@REVISION]" in out.stderr


def test_a_pull_request_revision_is_pulled(hub: StandInHub, env: dict, cache: Path, made: dict) -> None:
    """`refs/pr/N` is how the hub names a pull request's head (huggingface_hub's own examples): a revision, not a
    malformed id. Its ref lands as huggingface_hub writes it, refs/refs/pr/1."""
    repo = hub.repos["mlx-test/Reviewed"] = Repo()
    commit = repo.add(folder_files(made["tiny"]), branch="refs/pr/1")
    out = mlxsup(env, "pull", "mlx-test/Reviewed@refs/pr/1")
    assert out.returncode == 0, out.stderr
    folder = store.repo_folder(cache, "mlx-test/Reviewed")
    assert (folder / "refs" / "refs" / "pr" / "1").read_text() == commit
    assert sha256(snapshot(cache, "mlx-test/Reviewed", commit) / WEIGHTS) == sha256(made["tiny"] / WEIGHTS)
