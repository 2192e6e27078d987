"""The first hour (issue 49): `mlxsup ls`, `rm` and `import` agree with the running daemon, whatever it was told.

Three real daemons, each told its models only on its own command line or in a config file the client does not read:
`serve --model-dir DIR`, `serve --config FILE` with a `[models.X] path=` entry, and `serve --demo`. The client has
no config, another default state directory and another Hugging Face cache; it names the daemon's state directory,
as a user's shell does by default. Every model `mlxsup status` lists is listed by `ls`, `rm` finds it (and removes
it, or says why not and where it is), and `import` writes where that daemon looks, so it serves the model at once.
The converter is a stand-in that copies a tiny model (tests/families/test_gguf_import.py runs the real one). The
demo's folder is seeded where an older mlxsup put it: the daemon moves it, and its import is not paid here
(tests/integration/test_cli.py's `--demo` daemon imports the real one).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from supervisor.cli import importer
from supervisor.cli.commands import main
from tests.conftest import MLXSUP, Daemon, assert_gone, wait_for


def client_env(tmp_path: Path) -> dict[str, str]:
    """A shell that knows nothing of the daemon: no config, its own default state directory and cache."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MLXSUP_", "HF_"))}
    return {**clean, "XDG_CONFIG_HOME": str(tmp_path / "client-config"), "XDG_STATE_HOME": str(tmp_path / "client"),
            "HF_HUB_CACHE": str(tmp_path / "client-hf")}


def mlxsup(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*MLXSUP, *args], capture_output=True, text=True, timeout=120, env=env)


def ls(env: dict[str, str], d: Daemon) -> dict[str, dict]:
    out = mlxsup(env, "ls", "--json", "--state-dir", str(d.state_dir))
    assert out.returncode == 0, out.stderr
    return {row["id"]: row for row in json.loads(out.stdout)}


def served_ids(d: Daemon) -> set[str]:
    return {m["id"] for m in d.status()["models"]}


def load(d: Daemon, model: str) -> int:
    r = httpx.post(f"{d.url}/api/models/{model}/load", timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["pid"]


@pytest.fixture
def shell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The client's environment, for subprocesses and for this process's own `main(...)` calls alike."""
    env = client_env(tmp_path)
    for name in [k for k in os.environ if k.startswith(("MLXSUP_", "HF_"))]:
        monkeypatch.delenv(name)
    for name in ("XDG_CONFIG_HOME", "XDG_STATE_HOME", "HF_HUB_CACHE"):
        monkeypatch.setenv(name, env[name])
    return env


def import_stand_in(monkeypatch: pytest.MonkeyPatch, model: Path, tmp_path: Path, d: Daemon, name: str,
                    capsys: pytest.CaptureFixture) -> Path:
    """`mlxsup import FILE --name NAME` with no --model-dir; the converter copies `model` to where it was told."""
    started: list[list[str]] = []

    def converter(argv: list[str], *a, **kw) -> subprocess.CompletedProcess:
        started.append(argv)
        shutil.copytree(model, argv[4])
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(importer, "subprocess", SimpleNamespace(run=converter))
    gguf = tmp_path / "some.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    assert main(["import", str(gguf), "--name", name, "--state-dir", str(d.state_dir)]) == 0
    assert len(started) == 1
    err = capsys.readouterr().err
    assert f"which the daemon at {d.url} watches" in err, err
    return Path(started[0][4])


def served_soon(d: Daemon, model: str) -> None:
    wait_for(lambda: httpx.get(f"{d.v1}/models/{model}", timeout=10).status_code == 200, 15,
             what=f"the daemon to serve {model}")


def test_model_dir_daemon_ls_rm_and_import(daemon_factory, model_dir: Path, tmp_path: Path, shell: dict,
                                           monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    models = tmp_path / "models"
    shutil.copytree(model_dir / "tiny", models / "smol2")
    shutil.copytree(model_dir / "tiny2", models / "other")
    d = daemon_factory("--model-dir", str(models), name="dirs")

    rows = ls(shell, d)
    assert served_ids(d) <= set(rows) and {"smol2", "other"} <= set(rows), rows
    assert rows["smol2"]["path"] == str((models / "smol2").resolve()) and rows["smol2"]["loaded"] is False
    table = mlxsup(shell, "ls", "--state-dir", str(d.state_dir))
    assert table.returncode == 0 and any(line.startswith("smol2 ") for line in table.stdout.splitlines())

    pid = load(d, "smol2")
    assert ls(shell, d)["smol2"]["loaded"] is True
    refused = mlxsup(shell, "rm", "smol2", "--state-dir", str(d.state_dir))
    assert refused.returncode == 2 and "smol2 is loaded" in refused.stderr, refused.stderr
    assert (models / "smol2").is_dir()
    forced = mlxsup(shell, "rm", "smol2", "--force", "--state-dir", str(d.state_dir))
    assert forced.returncode == 0, forced.stderr
    assert f"evicted pid {pid}" in forced.stdout and f"removed smol2: {(models / 'smol2').resolve()}" in forced.stdout
    assert_gone([pid])
    assert not (models / "smol2").exists() and "smol2" not in ls(shell, d)
    assert httpx.get(f"{d.v1}/models/smol2", timeout=10).status_code == 404

    out = import_stand_in(monkeypatch, model_dir / "tiny", tmp_path, d, "fresh", capsys)
    assert out == (models / "fresh").resolve()  # the daemon's --model-dir, which this shell was never told
    served_soon(d, "fresh")
    assert "fresh" in ls(shell, d)


def test_config_entry_daemon_ls_rm_and_import(daemon_factory, model_dir: Path, tmp_path: Path, shell: dict,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture) -> None:
    weights = tmp_path / "elsewhere" / "weights"
    shutil.copytree(model_dir / "tiny", weights)
    config = tmp_path / "daemon.toml"  # the daemon's own file: the client is not given it
    config.write_text(f'[models.assistant]\npath = "{weights}"\naliases = ["helper"]\n')
    d = daemon_factory("--config", str(config), name="entries")

    rows = ls(shell, d)
    assert served_ids(d) <= set(rows) and rows["assistant"]["path"] == str(weights)
    assert rows["assistant"]["aliases"] == ["helper"]
    for name in ("assistant", "helper"):
        refused = mlxsup(shell, "rm", name, "--state-dir", str(d.state_dir))
        assert refused.returncode == 2, refused.stderr
        assert "assistant is named by a [models] entry of the config" in refused.stderr and str(weights) in refused.stderr
    assert weights.is_dir()

    out = import_stand_in(monkeypatch, model_dir / "tiny", tmp_path, d, "imported", capsys)
    assert out == (d.state_dir / "models" / "imported").resolve()  # no model folder given: its import folder
    served_soon(d, "imported")
    assert ls(shell, d)["imported"]["path"] == str(out)


def test_demo_daemon_ls_rm_and_import(daemon_factory, model_dir: Path, tmp_path: Path, shell: dict,
                                      monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    old = tmp_path / "demo" / "models" / "SmolLM2-135M-Instruct"  # where an earlier mlxsup imported it
    shutil.copytree(model_dir / "tiny", old)
    d = daemon_factory("--demo", name="demo")
    demo = d.state_dir / "demo" / "SmolLM2-135M-Instruct"
    assert demo.is_dir() and not old.exists()  # moved out of the import folder: served once, as `demo`

    rows = ls(shell, d)
    assert served_ids(d) == {"demo"} and set(rows) == {"demo"} and rows["demo"]["path"] == str(demo), rows
    refused = mlxsup(shell, "rm", "demo", "--state-dir", str(d.state_dir))
    assert refused.returncode == 2 and "`serve --demo`'s model" in refused.stderr and str(demo) in refused.stderr
    assert demo.is_dir()

    out = import_stand_in(monkeypatch, model_dir / "tiny", tmp_path, d, "mine", capsys)
    assert out == (d.state_dir / "models" / "mine").resolve()  # the demo's daemon looks there, and only there
    served_soon(d, "mine")
    assert set(ls(shell, d)) == {"demo", "mine"}

    assert d.stop() == 0  # no daemon: the state directory's own folders are still listed
    offline = mlxsup(shell, "ls", "--state-dir", str(d.state_dir))
    assert offline.returncode == 0, offline.stderr
    listed = [line.split()[0] for line in offline.stdout.splitlines()[1:] if not line.startswith("(")]
    assert sorted(listed) == ["demo", "mine"], offline.stdout
    removed = mlxsup(shell, "rm", "mine", "--state-dir", str(d.state_dir))
    assert removed.returncode == 0 and not out.exists(), removed.stderr


@pytest.fixture
def big_status() -> Iterator[str]:
    """A daemon stand-in whose /api/status is far larger than a pipe holds."""
    body = json.dumps({"version": "0", "uptime_s": 1.0, "models": [{"id": f"m{i}", "pad": "x" * 1000}
                                                                     for i in range(1000)]}).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_status_json_into_head_ends_quietly_with_exit_0(big_status: str, tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "supervisor", "status", "--json", "--url", big_status],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=client_env(tmp_path))
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline() == b"{\n"  # `| head -n 1`: one line read, then the pipe closed
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 0 and err == "", err
