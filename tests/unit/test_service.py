"""`mlxsup service`: the rendered plist/unit, and the exact launchctl / systemctl calls.

launchctl and systemctl are fakes on PATH: one small script that records its argv and keeps
just enough state (loaded / enabled / active) to answer like the real tools, including their
errors (bootstrap of a loaded job: 5, bootout/print of an unknown one: 3/113).
"""

from __future__ import annotations

import configparser
import json
import os
import plistlib
import shlex
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from supervisor.cli import main, service
from supervisor.config import Settings

UID = os.getuid()
DOMAIN = f"gui/{UID}"
TARGET = f"{DOMAIN}/{service.LABEL}"
REPO = Path(__file__).resolve().parents[2]

FAKE = textwrap.dedent("""\
    import json, os, plistlib, sys
    from pathlib import Path

    tool, args = Path(sys.argv[0]).name, sys.argv[1:]
    state = Path(os.environ["FAKE_STATE"])
    with open(state / "calls.jsonl", "a") as f:
        f.write(json.dumps([tool, *args]) + "\\n")
    verb = next((a for a in args if not a.startswith("--")), "")
    fails = json.loads((state / "fail.json").read_text()) if (state / "fail.json").exists() else {}
    if f"{tool} {verb}" in fails:
        rc, message, times = fails[f"{tool} {verb}"]
        if times:
            fails[f"{tool} {verb}"][2] = times - 1
            (state / "fail.json").write_text(json.dumps(fails))
            print(message, file=sys.stderr)
            sys.exit(rc)

    def flag(name: str) -> bool:
        return (state / name).exists()

    def done(rc: int = 0, out: str = "", err: str = "") -> None:
        print(out, end="")
        print(err, end="", file=sys.stderr)
        sys.exit(rc)

    if tool == "launchctl":
        if verb == "print":
            done(0, "io.mlxsup.daemon = {\\n\\tstate = running\\n}\\n") if flag("loaded") else done(
                113, err="Could not find service \\"io.mlxsup.daemon\\" in domain for port\\n")
        if verb == "bootstrap":
            if flag("loaded"):
                done(5, err="Bootstrap failed: 5: Input/output error\\n")
            job = plistlib.loads(Path(args[2]).read_bytes())  # the plist must be there and valid
            assert job["Label"] == "io.mlxsup.daemon"
            (state / "loaded").touch()
            done()
        if verb == "bootout":
            if not flag("loaded"):
                done(3, err="Boot-out failed: 3: No such process\\n")
            (state / "loaded").unlink()
            done()
    if tool == "systemctl":
        if args[:1] != ["--user"]:
            done(1, err="fake: expected --user first\\n")
        if verb in ("daemon-reload", "enable", "show-environment"):
            (state / "enabled").touch() if verb == "enable" else None
            done()
        if verb == "restart":
            (state / "active").touch()
            done()
        if verb == "disable":
            for name in ("enabled", "active"):
                (state / name).unlink(missing_ok=True)
            done()
        if verb == "status":
            done(0, "Active: active (running)\\n") if flag("active") else done(3, "Active: inactive (dead)\\n")
    done(64, err=f"fake {tool}: unexpected {args}\\n")
""")


@dataclass
class Fakes:
    state: Path
    bin: Path

    def calls(self) -> list[list[str]]:
        path = self.state / "calls.jsonl"
        calls = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        path.unlink(missing_ok=True)
        return calls

    def fail(self, command: str, rc: int, message: str, times: int = 1_000_000) -> None:
        fails = json.loads((self.state / "fail.json").read_text()) if (self.state / "fail.json").exists() else {}
        fails[command] = [rc, message, times]
        (self.state / "fail.json").write_text(json.dumps(fails))


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A HOME with a space in it, and none of the caller's mlxsup / XDG variables."""
    home = tmp_path / "my home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("MLXSUP_CONFIG", "MLXSUP_STATE_DIR", "MLXSUP_API_KEY", "XDG_CONFIG_HOME", "XDG_STATE_HOME",
                 "MLXSUP_OLLAMA_LISTEN"):  # (tests/conftest.py sets it off for the daemons the tests start)
        monkeypatch.delenv(name, raising=False)
    return home


@pytest.fixture
def fakes(tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch) -> Fakes:
    state, bin_ = tmp_path / "fake-state", tmp_path / "fake-bin"
    state.mkdir()
    bin_.mkdir()
    for tool in ("launchctl", "systemctl"):
        script = bin_ / tool
        script.write_text(f"#!{sys.executable}\n{FAKE}")
        script.chmod(0o755)
    monkeypatch.setenv("FAKE_STATE", str(state))
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(service, "RETRY_DELAY_S", 0.0)
    return Fakes(state, bin_)


def mlxsup(*argv: str) -> int:
    return main(["service", *argv])


def config_of(home: Path) -> Path:
    return home / ".config" / "mlxsup" / "config.toml"


def plist_of(home: Path) -> Path:
    return home / "Library" / "LaunchAgents" / f"{service.LABEL}.plist"


def unit_of(home: Path) -> Path:
    return home / ".config" / "systemd" / "user" / service.UNIT


def strings(value: object) -> list[str]:
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (k, *strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return [value] if isinstance(value, str) else []


# --- launchd -----------------------------------------------------------------------------


def test_plist_has_every_key_with_absolute_paths(fakes: Fakes, home: Path) -> None:
    config = config_of(home)
    config.parent.mkdir(parents=True)
    config.write_text("[server]\nshutdown_drain_s = 40\nsettle_grace_s = 7.5\nkill_timeout_s = 5\n")
    assert mlxsup("install", "--backend", "launchd") == 0

    job = plistlib.loads(plist_of(home).read_bytes())
    log_dir = Settings().log_dir  # the default state dir under this HOME
    assert job["Label"] == service.LABEL
    assert job["ProgramArguments"] == [sys.executable, "-m", "supervisor", "serve", "--config", str(config)]
    assert job["RunAtLoad"] is True
    assert job["KeepAlive"] == {"SuccessfulExit": False}
    assert job["ThrottleInterval"] == service.THROTTLE_S
    assert job["ExitTimeOut"] > 40 + 7.5 + 5 and job["ExitTimeOut"] == 53 + service.RELEASE_S + service.STOP_MARGIN_S
    assert job["ProcessType"] == "Interactive"
    assert job["StandardOutPath"] == str(log_dir / "service.out.log")
    assert job["StandardErrorPath"] == str(log_dir / "service.err.log")
    assert log_dir.is_dir()  # launchd does not create it
    assert job["WorkingDirectory"] == str(config.parent)
    env = job["EnvironmentVariables"]
    assert set(env) == {"PATH", "MLXSUP_CONFIG", "PYTHONUNBUFFERED", "MLXSUP_LOG_STDERR", "MLXSUP_SERVICE"}
    assert env["MLXSUP_CONFIG"] == str(config) and env["PYTHONUNBUFFERED"] == "1"
    assert env["MLXSUP_LOG_STDERR"] == "0"  # launchd's stderr file never rotates
    assert env["MLXSUP_SERVICE"] == "launchd"  # a start that cannot succeed then exits 0: no restart loop
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)
    assert job["SoftResourceLimits"] == job["HardResourceLimits"] == {"NumberOfFiles": service.NOFILE}
    paths = [job["ProgramArguments"][0], job["ProgramArguments"][-1], job["StandardOutPath"],
             job["StandardErrorPath"], job["WorkingDirectory"], *env["PATH"].split(":")]
    assert all(Path(p).is_absolute() for p in paths), paths
    assert not [s for s in strings(job) if "~" in s or "$" in s]


def test_launchd_install_then_reinstall_boots_out_first(fakes: Fakes, home: Path) -> None:
    plist = plist_of(home)
    assert mlxsup("install", "--backend", "launchd") == 0
    assert fakes.calls() == [["launchctl", "print", TARGET], ["launchctl", "bootstrap", DOMAIN, str(plist)]]
    first = plistlib.loads(plist.read_bytes())

    config_of(home).write_text("[server]\nshutdown_drain_s = 100\n")
    assert mlxsup("install", "--backend", "launchd") == 0
    assert fakes.calls() == [
        ["launchctl", "print", TARGET],
        ["launchctl", "bootout", TARGET],
        ["launchctl", "print", TARGET],  # waits until launchd has let go
        ["launchctl", "bootstrap", DOMAIN, str(plist)],
    ]
    assert (plistlib.loads(plist.read_bytes())["ExitTimeOut"] == 110 + service.RELEASE_S + service.STOP_MARGIN_S
            > first["ExitTimeOut"])


def test_launchd_uninstall_and_again(fakes: Fakes, home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert mlxsup("install", "--backend", "launchd") == 0
    fakes.calls()
    assert mlxsup("uninstall", "--backend", "launchd") == 0
    assert fakes.calls() == [["launchctl", "print", TARGET], ["launchctl", "bootout", TARGET],
                             ["launchctl", "print", TARGET]]
    assert not plist_of(home).exists()
    assert config_of(home).exists()  # the config is the user's: kept
    capsys.readouterr()
    assert mlxsup("uninstall", "--backend", "launchd") == 0
    assert fakes.calls() == [["launchctl", "print", TARGET]]
    assert "not installed" in capsys.readouterr().out


def test_launchd_restart(fakes: Fakes, home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert mlxsup("restart", "--backend", "launchd") == 1
    assert "not installed" in capsys.readouterr().err
    assert fakes.calls() == []

    assert mlxsup("install", "--backend", "launchd") == 0
    fakes.calls()
    assert mlxsup("restart", "--backend", "launchd") == 0  # graceful: never `kickstart -k` (SIGKILL)
    assert fakes.calls() == [["launchctl", "print", TARGET], ["launchctl", "bootout", TARGET],
                             ["launchctl", "print", TARGET], ["launchctl", "bootstrap", DOMAIN, str(plist_of(home))]]
    assert (fakes.state / "loaded").exists()

    (fakes.state / "loaded").unlink()  # booted out behind our back: restart loads it again
    assert mlxsup("restart", "--backend", "launchd") == 0
    assert fakes.calls() == [["launchctl", "print", TARGET], ["launchctl", "bootstrap", DOMAIN, str(plist_of(home))]]


def test_launchd_status(fakes: Fakes, home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert mlxsup("status", "--backend", "launchd") == 3
    assert "not loaded" in capsys.readouterr().out
    assert mlxsup("install", "--backend", "launchd") == 0
    fakes.calls()
    capsys.readouterr()
    assert mlxsup("status", "--backend", "launchd") == 0
    assert fakes.calls() == [["launchctl", "print", TARGET]]
    out = capsys.readouterr().out
    assert "loaded" in out and "state = running" in out


def test_launchctl_failure_is_a_clear_nonzero_exit(fakes: Fakes, home: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    fakes.fail("launchctl bootstrap", 1, "Bootstrap failed: 1: Operation not permitted")
    assert mlxsup("install", "--backend", "launchd") == 1
    err = capsys.readouterr().err
    assert err.startswith("mlxsup: `launchctl bootstrap ")
    assert "failed (exit 1): Bootstrap failed: 1: Operation not permitted" in err
    assert [c[1] for c in fakes.calls()] == ["print", "bootstrap"]  # not retried: not a race


def test_bootstrap_race_is_retried(fakes: Fakes, home: Path) -> None:
    fakes.fail("launchctl bootstrap", 5, "Bootstrap failed: 5: Input/output error", times=1)
    assert mlxsup("install", "--backend", "launchd") == 0
    assert [c[1] for c in fakes.calls()] == ["print", "bootstrap", "bootstrap"]
    assert (fakes.state / "loaded").exists()


def test_missing_launchctl_writes_nothing(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert mlxsup("install", "--backend", "launchd") == 1
    assert "launchctl not found on PATH" in capsys.readouterr().err
    assert not plist_of(home).exists() and not config_of(home).exists()


def test_cli_subprocess_exit_code_and_message(fakes: Fakes, home: Path) -> None:
    fakes.fail("launchctl print", 1, "unexpected")
    fakes.fail("launchctl bootstrap", 1, "Bootstrap failed: 1: Operation not permitted")
    proc = subprocess.run([sys.executable, "-m", "supervisor", "service", "install", "--backend", "launchd"],
                          capture_output=True, text=True, env=os.environ, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("mlxsup: `launchctl bootstrap")


# --- config ------------------------------------------------------------------------------


def test_config_is_created_minimal_and_private(fakes: Fakes, home: Path) -> None:
    assert mlxsup("install", "--backend", "launchd") == 0
    config = config_of(home)
    assert config.stat().st_mode & 0o777 == 0o600
    settings = service.load_file(config, Settings())
    assert (settings.host, settings.port, settings.models) == ("127.0.0.1", 8800, [])


def fake_model(path: Path) -> None:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"x" * 10)


def test_the_created_config_serves_what_serve_with_no_arguments_serves(fakes: Fakes, home: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from supervisor.daemon import build_registry

    hub = tmp_path / "hf cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    fake_model(hub / "models--org--Pulled" / "snapshots" / ("0" * 40))  # `mlxsup pull`'s
    assert mlxsup("install", "--backend", "systemd") == 0
    settings = service.load_file(config_of(home), Settings())
    assert settings.hf_cache == hub and settings.import_dir == Settings().import_dir
    assert settings.import_dir.is_dir()  # there from the start: the service waits there for a model, not exits 2
    fake_model(settings.import_dir / "imported")  # `mlxsup import`'s, after the install
    text = config_of(home).read_text()
    assert "model_dirs = []" in text and str(settings.import_dir) in text  # and it says where it looks
    assert build_registry(settings).ids() == build_registry(Settings()).ids() == ["imported", "org/Pulled"]


def test_existing_config_kept_and_explicit_paths_win(fakes: Fakes, home: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    env_config, arg_config = tmp_path / "env.toml", tmp_path / "arg.toml"
    env_config.write_text("[server]\nport = 9001\n")
    arg_config.write_text("[server]\nport = 9002\n")
    monkeypatch.setenv("MLXSUP_CONFIG", str(env_config))
    assert mlxsup("install", "--backend", "launchd") == 0
    assert plistlib.loads(plist_of(home).read_bytes())["ProgramArguments"][-1] == str(env_config)
    monkeypatch.chdir(tmp_path)
    assert mlxsup("install", "--backend", "launchd", "--config", "arg.toml") == 0  # relative: made absolute
    job = plistlib.loads(plist_of(home).read_bytes())
    assert job["ProgramArguments"][-1] == str(arg_config)
    assert job["EnvironmentVariables"]["MLXSUP_CONFIG"] == str(arg_config)
    assert arg_config.read_text() == "[server]\nport = 9002\n" and not config_of(home).exists()


def test_path_variables_are_carried_and_others_named(fakes: Fakes, home: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    config_of(home).parent.mkdir(parents=True)
    config_of(home).write_text('[server]\nstate_dir = "/the/file/loses"\n')
    monkeypatch.setenv("MLXSUP_STATE_DIR", str(tmp_path / "state"))  # beats the file, as in `serve`
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("MLXSUP_PORT", "9999")
    assert mlxsup("install", "--backend", "launchd") == 0
    job = plistlib.loads(plist_of(home).read_bytes())
    assert job["EnvironmentVariables"] == {
        "PATH": job["EnvironmentVariables"]["PATH"], "MLXSUP_CONFIG": str(config_of(home)), "PYTHONUNBUFFERED": "1",
        "MLXSUP_LOG_STDERR": "0", "MLXSUP_SERVICE": "launchd", "MLXSUP_STATE_DIR": str(tmp_path / "state"),
        "HF_HOME": str(tmp_path / "hf")}
    assert job["StandardErrorPath"] == str(tmp_path / "state" / "logs" / "service.err.log")
    assert "not carried into the service: MLXSUP_PORT;" in capsys.readouterr().out


def test_bad_config_installs_nothing(fakes: Fakes, home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config_of(home).parent.mkdir(parents=True)
    config_of(home).write_text("[server]\nprot = 1\n")
    assert mlxsup("install", "--backend", "systemd") == 2
    assert "server.prot: unknown key" in capsys.readouterr().err
    assert fakes.calls() == [["systemctl", "--user", "show-environment"]]  # only the look that changes nothing
    assert not unit_of(home).exists()


@pytest.mark.parametrize("backend", ["launchd", "systemd"])
def test_api_key_never_leaves_the_config(fakes: Fakes, home: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str], backend: str) -> None:
    monkeypatch.setenv("MLXSUP_API_KEY", "sk-from-env-123")
    config_of(home).parent.mkdir(parents=True)
    config_of(home).write_text('[server]\napi_key = "sk-from-file-456"\n')
    config_of(home).chmod(0o600)
    assert mlxsup("install", "--backend", backend) == 0
    written = (plist_of(home) if backend == "launchd" else unit_of(home)).read_text()
    out = capsys.readouterr()
    for secret in ("sk-from-env-123", "sk-from-file-456"):
        assert secret not in written and secret not in out.out + out.err
    assert "MLXSUP_API_KEY" not in written and "not carried into the service: MLXSUP_API_KEY" in out.out


# --- systemd -----------------------------------------------------------------------------


def read_unit(path: Path) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string(path.read_text())
    return unit


def test_unit_has_every_setting(fakes: Fakes, home: Path) -> None:
    config = config_of(home)
    config.parent.mkdir(parents=True)
    config.write_text("[server]\nshutdown_drain_s = 20\n")
    assert mlxsup("install", "--backend", "systemd") == 0
    s = read_unit(unit_of(home))["Service"]
    assert shlex.split(s["ExecStart"]) == [sys.executable, "-m", "supervisor", "serve", "--config", str(config)]
    assert s["Restart"] == "on-failure" and s["RestartPreventExitStatus"] == "2"
    assert s["KillMode"] == "mixed" and s["KillSignal"] == "SIGTERM"
    assert int(s["TimeoutStopSec"]) == 20 + 5 + 5 + service.RELEASE_S + service.STOP_MARGIN_S
    assert s["LimitNOFILE"] == str(service.NOFILE)
    env = dict(word.split("=", 1) for word in shlex.split(s["Environment"]))
    assert env == {"PATH": env["PATH"], "MLXSUP_CONFIG": str(config), "PYTHONUNBUFFERED": "1"}
    assert s["StandardOutput"] == s["StandardError"] == "journal"  # the daemon keeps its own rotated log too
    assert read_unit(unit_of(home))["Install"]["WantedBy"] == "default.target"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_unit_passes_systemd_analyze_verify(fakes: Fakes, home: Path, tmp_path: Path) -> None:
    config = tmp_path / "odd 100% $dir" / "config.toml"  # every character the unit must escape
    config.parent.mkdir()
    config.write_text("")
    assert mlxsup("install", "--backend", "systemd", "--config", str(config)) == 0
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    proc = subprocess.run(["systemd-analyze", "--user", "verify", str(unit_of(home))], capture_output=True,
                          text=True, env=dict(os.environ, XDG_RUNTIME_DIR=str(runtime)), timeout=60)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert '"--config" "' + str(config).replace("%", "%%").replace("$", "$$") + '"' in unit_of(home).read_text()


def test_systemd_install_reinstall_uninstall(fakes: Fakes, home: Path) -> None:
    install = [["systemctl", "--user", "show-environment"],  # the user manager can be reached: before any write
               ["systemctl", "--user", "daemon-reload"], ["systemctl", "--user", "enable", service.UNIT],
               ["systemctl", "--user", "restart", service.UNIT]]
    assert mlxsup("install", "--backend", "systemd") == 0
    assert fakes.calls() == install
    assert mlxsup("install", "--backend", "systemd") == 0
    assert fakes.calls() == install  # restart: the running daemon picks up the new unit
    assert mlxsup("uninstall", "--backend", "systemd") == 0
    assert fakes.calls() == [["systemctl", "--user", "disable", "--now", service.UNIT],
                             ["systemctl", "--user", "daemon-reload"]]
    assert not unit_of(home).exists() and config_of(home).exists()
    assert mlxsup("uninstall", "--backend", "systemd") == 0
    assert fakes.calls() == []


def test_systemd_restart_and_status(fakes: Fakes, home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert mlxsup("restart", "--backend", "systemd") == 1
    assert "not installed" in capsys.readouterr().err
    assert mlxsup("status", "--backend", "systemd") == 3
    assert fakes.calls() == [["systemctl", "--user", "--no-pager", "status", service.UNIT]]
    assert mlxsup("install", "--backend", "systemd") == 0
    fakes.calls()
    assert mlxsup("restart", "--backend", "systemd") == 0
    assert mlxsup("status", "--backend", "systemd") == 0
    assert fakes.calls() == [["systemctl", "--user", "restart", service.UNIT],
                             ["systemctl", "--user", "--no-pager", "status", service.UNIT]]
    assert "active (running)" in capsys.readouterr().out


def test_systemctl_failure_is_a_clear_nonzero_exit(fakes: Fakes, home: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    fakes.fail("systemctl enable", 1, "Failed to enable unit: Unit file mlxsup.service does not exist.")
    assert mlxsup("install", "--backend", "systemd") == 1
    assert capsys.readouterr().err.strip() == ("mlxsup: `systemctl --user enable mlxsup.service` failed (exit 1): "
                                               "Failed to enable unit: Unit file mlxsup.service does not exist.")
    fakes.fail("systemctl status", 1, "Failed to get properties: Access denied")
    assert mlxsup("status", "--backend", "systemd") == 1


NO_BUS = "Failed to connect to bus: No medium found"  # systemctl --user in a shell with no user session bus


def no_bus(fakes: Fakes) -> None:
    for verb in ("show-environment", "daemon-reload", "enable", "restart", "disable", "status"):
        fakes.fail(f"systemctl {verb}", 1, NO_BUS)


def test_no_user_bus_install_writes_nothing_and_says_what_to_do(fakes: Fakes, home: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    no_bus(fakes)
    assert mlxsup("install", "--backend", "systemd") == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("mlxsup: nothing installed: `systemctl --user` reaches no systemd user manager here "
                          f"(`systemctl --user show-environment` failed (exit 1): {NO_BUS})"), err
    user = os.environ.get("USER") or str(UID)
    assert f"sudo loginctl enable-linger {user}" in err and f"XDG_RUNTIME_DIR=/run/user/{UID}" in err
    assert "login session" in err and "mlxsup serve" in err and len(err.splitlines()) == 1
    assert fakes.calls() == [["systemctl", "--user", "show-environment"]]
    assert not unit_of(home).exists() and not config_of(home).exists()


def test_no_user_bus_status_is_not_running_exit_3(fakes: Fakes, home: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    no_bus(fakes)
    assert mlxsup("status", "--backend", "systemd") == 3  # as documented: 3 when not running
    out = capsys.readouterr().out
    assert out.startswith(f"systemd --user {service.UNIT}: not running; unit ") and "enable-linger" in out


def test_no_user_bus_uninstall_removes_what_install_wrote(fakes: Fakes, home: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert mlxsup("install", "--backend", "systemd") == 0
    wants = unit_of(home).parent / "default.target.wants" / service.UNIT
    wants.parent.mkdir()
    wants.symlink_to(unit_of(home))  # what a real `systemctl --user enable` links
    fakes.calls()
    capsys.readouterr()
    no_bus(fakes)
    assert mlxsup("uninstall", "--backend", "systemd") == 0
    out = capsys.readouterr()
    assert not unit_of(home).exists() and not wants.is_symlink() and config_of(home).exists()
    assert f"uninstalled {unit_of(home)}" in out.out and "removed all the same" in out.err and NO_BUS in out.err
    assert fakes.calls() == [["systemctl", "--user", "disable", "--now", service.UNIT]]  # no daemon-reload to fail
    assert mlxsup("uninstall", "--backend", "systemd") == 0
    assert "not installed" in capsys.readouterr().out


def test_a_failed_disable_still_removes_the_unit_and_says_it_may_run(fakes: Fakes, home: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert mlxsup("install", "--backend", "systemd") == 0
    capsys.readouterr()
    fakes.fail("systemctl disable", 1, "Failed to stop mlxsup.service: Transaction is destructive.")
    assert mlxsup("uninstall", "--backend", "systemd") == 1
    err = capsys.readouterr().err
    assert not unit_of(home).exists() and "may still run" in err and "Transaction is destructive" in err


def test_xdg_runtime_dir_is_filled_in_only_where_unset(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert service.runtime_dir_env() is None
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    env = service.runtime_dir_env()
    if Path(f"/run/user/{UID}").is_dir():
        assert env is not None and env["XDG_RUNTIME_DIR"] == f"/run/user/{UID}"
    else:
        assert env is None


# --- the seam and deploy/ -----------------------------------------------------------------


@pytest.mark.parametrize("platform, expected", [("darwin", service.Launchd), ("linux", service.Systemd)])
def test_backend_follows_platform(home: Path, monkeypatch: pytest.MonkeyPatch, platform: str,
                                  expected: type) -> None:
    monkeypatch.setattr(sys, "platform", platform)
    assert type(service.backend(None)) is expected
    assert type(service.backend("systemd" if platform == "darwin" else "launchd")) is not expected


@pytest.mark.parametrize("drain, settle, kill", [(5, 5, 5), (0, 0, 0), (30.2, 1, 0.5)])
def test_stop_timeout_outlasts_graceful_shutdown(drain: float, settle: float, kill: float) -> None:
    settings = Settings(shutdown_drain_s=drain, settle_grace_s=settle, kill_timeout_s=kill)
    assert service.stop_timeout_s(settings) >= drain + settle + kill + service.RELEASE_S + service.STOP_MARGIN_S


def test_deploy_templates_match_the_renderers() -> None:
    for rel, data in service.templates().items():
        assert (REPO / "deploy" / rel).read_bytes() == data, f"deploy/{rel} is stale: python -m supervisor.cli.service"
