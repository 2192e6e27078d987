"""`mlxsup service install | uninstall | restart | status`: run the daemon under the OS service manager.

Renders a launchd user agent (macOS) or a systemd user unit (Linux) for *this* installation,
writes it where the manager looks, and drives `launchctl` / `systemctl --user`. Invariants:
- Every path in the plist/unit is absolute: `sys.executable` (not resolved: a venv stays a venv),
  the config from --config, else MLXSUP_CONFIG, else config.default_config_path(). No shell, no
  `~`, no `$VAR` left for the manager to expand. The job runs in the config's folder.
- A missing config is created (0600, minimal `[server]`), so the service has one place to be
  configured; an existing one is validated before anything is written (no restart loop on a typo).
  The created one serves what `serve` with no arguments serves: the Hugging Face cache (its path written
  out) and the import folder (state_dir/models, created, so a daemon with no model yet waits for one).
- systemd with no user manager to reach (no user session bus: su, sudo, containers, cron): install finds
  out first and writes nothing, saying what to do (a login session, or `loginctl enable-linger` and
  XDG_RUNTIME_DIR, which is filled in where /run/user/UID exists); status says "not running", exit 3;
  uninstall removes the unit and its enable link whatever systemctl says.
- The environment is an allowlist (PATH, MLXSUP_CONFIG, PYTHONUNBUFFERED, and CARRIED when set at
  install): MLXSUP_API_KEY (or any other secret) is never copied; a key belongs in the config file.
- SIGTERM goes to the supervisor alone (it stops its own workers), and the manager waits longer than
  the whole graceful shutdown (shutdown_drain_s + settle_grace_s + kill_timeout_s + STOP_MARGIN_S)
  before SIGKILL. Restart only after a failure; a clean exit stays down.
- Install is idempotent: launchd: a loaded job is booted out, and waited for, before bootstrap;
  systemd: daemon-reload + enable + restart. Restarts are graceful on both (see Launchd.restart).
- Output: launchd appends stdout/stderr to state_dir/logs/service.{out,err}.log (crashes before
  logging starts land there); systemd sends them to the journal. The plist uses plistlib.
- `deploy/` holds both renderings with placeholder paths, kept equal by a test (regenerate:
  `python -m supervisor.cli.service`).
The backend follows `sys.platform` (darwin: launchd, else systemd); `--backend` overrides it. The
home directory is `Path.home()`, which honours HOME.

Why one module of over 400 lines: the invariants above bind what is rendered (paths, environment, stop
timeout) to how each manager is driven (bootout before bootstrap, the stop wait), and one test file and
deploy/'s renderings check them together; the two backends are ~160 lines of it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import plistlib
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from supervisor.cli.exits import EXIT_NO_DAEMON, EXIT_USAGE, CliError
from supervisor.config import ConfigError, Settings, default_config_path, default_hf_cache, default_state_dir, load_file
from supervisor.policy import RELEASE_BYTES_PER_S, kill_timeout

log = logging.getLogger(__name__)

LABEL = "io.mlxsup.daemon"
UNIT = "mlxsup.service"
STOP_MARGIN_S = 15  # past the graceful shutdown, before the manager's SIGKILL
THROTTLE_S = 10  # at most one restart this often
LARGEST_MODEL_BYTES = 512 * 2**30  # the most memory a Mac has (M3 Ultra): its exit's release time is in every stop timeout
RELEASE_S = LARGEST_MODEL_BYTES // RELEASE_BYTES_PER_S  # ... that is, this many seconds (64)
NOFILE = 10240  # macOS OPEN_MAX: the highest soft limit setrlimit accepts there
BOOTSTRAP_RETRIES = 3
RETRY_DELAY_S = 1.0
CARRIED = ("MLXSUP_STATE_DIR", "HF_HOME", "HF_HUB_CACHE")  # paths, never secrets: same files as `serve`
_RACE_CODES = (5, 37)  # launchctl bootstrap while the previous job still leaves: EIO, EALREADY
MINIMAL_CONFIG = """\
# mlxsup config, created by `mlxsup service install`. After editing: `mlxsup service restart`.
# Keep this file private (0600): an api_key set here is the only copy of it.
[server]
host = "127.0.0.1"
port = 8800
# It serves what `mlxsup serve` with no arguments serves: every model in the Hugging Face cache below (`mlxsup
# pull`) and in {import_dir} (`mlxsup import`'s folder, watched by every serve), a model put there
# later included, without a restart. More folders of model folders: model_dirs = ["/Users/me/models"]
model_dirs = []
hf_cache = {hf_cache}
# api_key = "..."                      # then every route but /health needs a bearer token
# allowed_hosts = ["mybox.local"]      # Host names besides localhost and loopback addresses
# allowed_origins = []                 # web pages (origins) allowed to call the API; none by default

# [models.assistant]
# path = "/Users/me/models/Qwen3-4B-4bit"
"""


@dataclass(frozen=True)
class Install:
    """What the plist/unit says: everything absolute, nothing secret."""

    python: Path
    config: Path
    log_dir: Path
    stop_timeout_s: int
    carried: tuple[tuple[str, str], ...] = ()  # CARRIED variables set at install, made absolute

    @property
    def argv(self) -> list[str]:
        return [str(self.python), "-m", "supervisor", "serve", "--config", str(self.config)]

    @property
    def stdout_log(self) -> Path:
        return self.log_dir / "service.out.log"

    @property
    def stderr_log(self) -> Path:
        return self.log_dir / "service.err.log"

    def environment(self, backend: str) -> dict[str, str]:
        extra = ["/opt/homebrew/bin"] if backend == "launchd" else []
        dirs = [str(self.python.parent), *extra, "/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin"]
        env = {"PATH": ":".join(dict.fromkeys(dirs)), "MLXSUP_CONFIG": str(self.config), "PYTHONUNBUFFERED": "1"}
        if backend == "launchd":  # launchd's stderr file never rotates: the rotated mlxsup.log has it all
            env["MLXSUP_LOG_STDERR"] = "0"
            env["MLXSUP_SERVICE"] = "launchd"  # a start that cannot succeed exits 0: see commands.no_retry_status
        return env | dict(self.carried)


def stop_timeout_s(settings: Settings) -> int:
    """Seconds the manager waits after SIGTERM: the whole graceful shutdown, with the kill timeout of the largest
    model a Mac can hold (policy.kill_timeout: a large model's exit hands back more, and a launchd SIGKILL in the middle
    is what strands wired memory on macOS), plus a margin."""
    graceful = (settings.shutdown_drain_s + settings.settle_grace_s
                + kill_timeout(settings.kill_timeout_s, LARGEST_MODEL_BYTES))
    return math.ceil(graceful) + STOP_MARGIN_S


def render_plist(inst: Install) -> bytes:
    job = {
        "Label": LABEL,
        "ProgramArguments": inst.argv,
        "WorkingDirectory": str(inst.config.parent),
        "EnvironmentVariables": inst.environment("launchd"),
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": THROTTLE_S,
        "ExitTimeOut": inst.stop_timeout_s,
        "ProcessType": "Interactive",
        "StandardOutPath": str(inst.stdout_log),
        "StandardErrorPath": str(inst.stderr_log),
        "SoftResourceLimits": {"NumberOfFiles": NOFILE},
        "HardResourceLimits": {"NumberOfFiles": NOFILE},
    }
    return plistlib.dumps(job, fmt=plistlib.FMT_XML, sort_keys=False)


def _unit_escape(text: str) -> str:
    """Escape systemd specifiers (every % is one)."""
    return text.replace("%", "%%")


def _unit_word(text: str, command: bool = False) -> str:
    """One double-quoted word of ExecStart= (command: $ expands there) or Environment=."""
    quoted = text.replace("\\", "\\\\").replace('"', '\\"')
    if command:
        quoted = quoted.replace("$", "$$")
    return '"' + _unit_escape(quoted) + '"'


def render_unit(inst: Install) -> str:
    env = " ".join(_unit_word(f"{k}={v}") for k, v in inst.environment("systemd").items())
    return "\n".join([
        "[Unit]",
        "Description=mlxsup: local LLMs with MLX, one model per worker process",
        "",
        "[Service]",
        "Type=exec",
        "ExecStart=" + " ".join(_unit_word(a, command=True) for a in inst.argv),
        "WorkingDirectory=" + _unit_escape(str(inst.config.parent)),
        "Environment=" + env,
        "Restart=on-failure",
        f"RestartSec={THROTTLE_S}",
        f"RestartPreventExitStatus={EXIT_USAGE}",  # a bad config: restarting will not fix it
        "KillMode=mixed",  # SIGTERM to the supervisor alone; SIGKILL for leftovers at the end
        "KillSignal=SIGTERM",
        f"TimeoutStopSec={inst.stop_timeout_s}",
        f"LimitNOFILE={NOFILE}",
        "StandardOutput=journal",  # rotated by journald; the daemon also keeps state_dir/logs/mlxsup.log
        "StandardError=journal",
        "",
        "[Install]",
        "WantedBy=default.target",
        "",
    ])


# --- this installation -------------------------------------------------------------------


def minimal_config() -> str:
    """The config install creates: what `serve` with no arguments serves, its paths written out absolute."""
    state_dir = Path(os.environ.get("MLXSUP_STATE_DIR") or default_state_dir()).absolute()
    return MINIMAL_CONFIG.format(import_dir=Settings(state_dir=state_dir).import_dir,
                                 hf_cache=json.dumps(str(default_hf_cache().absolute())))


def config_path(arg: str | None) -> Path:
    raw = arg or os.environ.get("MLXSUP_CONFIG")
    return (Path(raw).expanduser() if raw else default_config_path()).absolute()


def prepare(config_arg: str | None) -> Install:
    """Create the config if missing, validate it, and describe the service for it."""
    path = config_path(config_arg)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(minimal_config())
        print(f"created {path}: it serves what `mlxsup serve` would; to add model folders, edit it, then run "
              "`mlxsup service restart`")
    try:
        settings = load_file(path, Settings())
    except ConfigError as exc:
        raise CliError(f"bad config, nothing installed: {exc}", EXIT_USAGE) from None
    if settings.api_key and path.stat().st_mode & 0o077:
        log.warning("%s holds an api_key and others can read it: chmod 600 %s", path, path)
    carried = tuple((k, str(Path(os.environ[k]).absolute())) for k in CARRIED if os.environ.get(k))
    if env_state := dict(carried).get("MLXSUP_STATE_DIR"):
        settings.state_dir = Path(env_state)  # the variable beats the file, as in `serve`
    # the import folder, there from the start: a daemon with no model yet waits for one there, not exits 2
    (path.parent / settings.import_dir).mkdir(parents=True, exist_ok=True)
    skip = (*CARRIED, "MLXSUP_CONFIG", "MLXSUP_URL")
    if left := sorted(k for k in os.environ if k.startswith("MLXSUP_") and k not in skip):
        print(f"note: not carried into the service: {', '.join(left)}; set them in {path}")
    # the daemon runs in the config's folder: a relative state_dir is relative to it
    return Install(python=Path(sys.executable).absolute(), config=path, log_dir=path.parent / settings.log_dir,
                   stop_timeout_s=stop_timeout_s(settings), carried=carried)


def _write(path: Path, data: bytes) -> None:
    """Replace `path` atomically (a half-written plist/unit must never be loaded)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


class Tool:
    """A service manager's command-line tool (launchctl, systemctl): found on PATH, run, its failures worded."""

    def __init__(self, command: str, backend: str, env: dict[str, str] | None = None) -> None:
        self.command = command
        self.backend = backend
        self.exe = shutil.which(command)
        self.env = env  # None: this process's environment

    def require(self) -> str:
        if self.exe is None:
            raise CliError(f"{self.command} not found on PATH: the {self.backend} backend cannot work on this host "
                           f"(choose another with --backend)")
        return self.exe

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        exe = self.require()
        log.debug("running %s %s", self.command, " ".join(args))
        proc = subprocess.run([exe, *args], capture_output=True, text=True, env=self.env)
        if check and proc.returncode != 0:
            raise CliError(self.failure(args, proc))
        return proc

    def failure(self, args: tuple[str, ...], proc: subprocess.CompletedProcess[str]) -> str:
        detail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        return f"`{self.command} {' '.join(args)}` failed (exit {proc.returncode}): {detail}"


class Backend(Protocol):
    """One service manager: where its plist/unit lives, and the four actions (each backend owns its Tool)."""

    name: str
    path: Path
    tool: Tool

    def preflight(self) -> None: ...  # before anything is written: the manager can be reached (else CliError)

    def install(self, inst: Install) -> None: ...

    def uninstall(self) -> bool: ...  # False: there was nothing to remove

    def restart(self) -> None: ...

    def status(self) -> int: ...  # 0 running, EXIT_NO_DAEMON not


class Launchd:
    name = "launchd"

    def __init__(self) -> None:
        self.tool = Tool("launchctl", self.name)
        self.domain = f"gui/{os.getuid()}"
        self.target = f"{self.domain}/{LABEL}"
        self.path = Path.home() / "Library" / "LaunchAgents" / f"{LABEL}.plist"

    def preflight(self) -> None:
        pass  # launchctl answers without a GUI session too; bootstrap says when there is none

    def loaded(self) -> bool:
        return self.tool.run("print", self.target, check=False).returncode == 0

    def stop_wait_s(self) -> float:
        """How long the loaded job may take to stop: its own ExitTimeOut, plus a little."""
        try:
            return float(plistlib.loads(self.path.read_bytes())["ExitTimeOut"]) + 5
        except (OSError, ValueError, KeyError, TypeError, plistlib.InvalidFileException):
            return 120.0

    def bootout(self) -> None:
        """Unload, then wait until launchd has really let go (bootout can return before that)."""
        timeout_s = self.stop_wait_s()
        proc = self.tool.run("bootout", self.target, check=False)
        if proc.returncode not in (0, 3, 113):  # 3 (ESRCH), 113: it went away meanwhile
            raise CliError(self.tool.failure(("bootout", self.target), proc))
        deadline = time.monotonic() + timeout_s
        while self.loaded():
            if time.monotonic() > deadline:
                raise CliError(f"{self.target} still loaded {timeout_s:.0f}s after bootout")
            time.sleep(0.2)

    def bootstrap(self) -> None:
        for attempt in range(1, BOOTSTRAP_RETRIES + 1):
            proc = self.tool.run("bootstrap", self.domain, str(self.path), check=False)
            if proc.returncode == 0:
                return
            if proc.returncode not in _RACE_CODES or attempt == BOOTSTRAP_RETRIES:
                hint = " (no GUI login session for this user?)" if proc.returncode == 125 else ""
                raise CliError(self.tool.failure(("bootstrap", self.domain, str(self.path)), proc) + hint)
            time.sleep(RETRY_DELAY_S)

    def install(self, inst: Install) -> None:
        if self.loaded():
            self.bootout()
        _write(self.path, render_plist(inst))
        self.bootstrap()

    def uninstall(self) -> bool:
        found = self.path.exists()
        if self.loaded():
            self.bootout()
            found = True
        self.path.unlink(missing_ok=True)
        return found

    def restart(self) -> None:
        """bootout (SIGTERM, then SIGKILL only past ExitTimeOut) + bootstrap. Not `kickstart -k`:
        that SIGKILLs at once, so the workers would never drain."""
        if not self.path.exists():
            raise CliError(f"not installed ({self.path} missing): run `mlxsup service install`")
        if self.loaded():
            self.bootout()
        self.bootstrap()

    def status(self) -> int:
        proc = self.tool.run("print", self.target, check=False)
        print(f"launchd {self.target}: {'loaded' if proc.returncode == 0 else 'not loaded'}; plist {self.path}"
              f"{'' if self.path.exists() else ' (missing)'}")
        if proc.returncode != 0:
            print((proc.stderr or proc.stdout).strip())
            return EXIT_NO_DAEMON
        print(proc.stdout.rstrip())
        return 0


class NoUserBus(CliError):
    """`systemctl --user` reached no user manager: this session has no user bus (su, sudo, a container, cron)."""


# what systemctl says when it reaches no user manager (sd_bus: no $XDG_RUNTIME_DIR, no socket there, none running)
NO_BUS_SIGNS = ("Failed to connect to bus", "Failed to connect to user scope bus", "$DBUS_SESSION_BUS_ADDRESS")


def runtime_dir_env() -> dict[str, str] | None:
    """systemctl's environment: this one, with XDG_RUNTIME_DIR where it is unset but the user's runtime directory
    is there (a `su -` or ssh-without-PAM shell of a user whose manager runs: lingering); None: as it is."""
    runtime = Path(f"/run/user/{os.getuid()}")
    if os.environ.get("XDG_RUNTIME_DIR") or not runtime.is_dir():
        return None
    return {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}


def no_bus_help(detail: str) -> str:
    user = os.environ.get("USER") or str(os.getuid())
    return (f"`systemctl --user` reaches no systemd user manager here ({detail}): this shell has no user session "
            f"bus (a su or sudo shell, a container, a cron job, ssh without a login session). Either run this in a "
            f"login session of {user} (ssh or a console log-in), or start {user}'s manager without one: "
            f"`sudo loginctl enable-linger {user}` (it then also runs at boot), `export XDG_RUNTIME_DIR=/run/user/"
            f"{os.getuid()}`, and run the command again. Without systemd, run `mlxsup serve` yourself")


class Systemd:
    name = "systemd"

    def __init__(self) -> None:
        self.tool = Tool("systemctl", self.name, env=runtime_dir_env())
        config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
        self.path = Path(config_home) / "systemd" / "user" / UNIT
        self.wants = self.path.parent / "default.target.wants" / UNIT  # what `enable` links (WantedBy=)

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`systemctl ARGS`; no user manager to reach is a NoUserBus saying what to do (check or not)."""
        proc = self.tool.run(*args, check=False)
        said = proc.stderr + proc.stdout
        if proc.returncode != 0 and any(sign in said for sign in NO_BUS_SIGNS):
            raise NoUserBus(no_bus_help(self.tool.failure(args, proc)))
        if check and proc.returncode != 0:
            raise CliError(self.tool.failure(args, proc))
        return proc

    def preflight(self) -> None:
        try:
            self.run("--user", "show-environment")
        except NoUserBus as exc:
            raise NoUserBus(f"nothing installed: {exc}") from None

    def install(self, inst: Install) -> None:
        _write(self.path, render_unit(inst).encode())
        self.run("--user", "daemon-reload")
        self.run("--user", "enable", UNIT)
        self.run("--user", "restart", UNIT)  # starts it, or restarts it on the new unit
        user = os.environ.get("USER") or str(os.getuid())
        if not Path("/var/lib/systemd/linger", user).exists():
            print(f"note: it runs while you are logged in; to start it at boot: loginctl enable-linger {user}")

    def uninstall(self) -> bool:
        """Stop and disable it where systemctl can; remove the unit and its enable link whatever systemctl says."""
        if not self.path.exists() and not self.wants.is_symlink():
            return False
        failed: CliError | None = None
        try:
            self.run("--user", "disable", "--now", UNIT)
        except CliError as exc:
            failed = exc
        self.path.unlink(missing_ok=True)
        if self.wants.is_symlink():  # `disable` did not run: the link `enable` made goes too
            self.wants.unlink()
        if isinstance(failed, NoUserBus):  # no manager reachable: none runs it, and there is nothing to reload
            print(f"note: removed all the same; {failed}", file=sys.stderr)
            return True
        self.run("--user", "daemon-reload", check=False)
        if failed is not None:
            raise CliError(f"{self.path} removed, but {failed}: the daemon may still run "
                           f"(`systemctl --user stop {UNIT}`)")
        return True

    def restart(self) -> None:
        if not self.path.exists():
            raise CliError(f"not installed ({self.path} missing): run `mlxsup service install`")
        self.run("--user", "restart", UNIT)

    def status(self) -> int:
        try:
            proc = self.run("--user", "--no-pager", "status", UNIT, check=False)
        except NoUserBus as exc:  # no user manager to run it: not running (exit 3, as documented)
            print(f"systemd --user {UNIT}: not running; unit {self.path}{'' if self.path.exists() else ' (missing)'}")
            print(exc)
            return EXIT_NO_DAEMON
        if proc.returncode not in (0, 3, 4):  # 3: not running, 4: no such unit
            raise CliError(self.tool.failure(("--user", "--no-pager", "status", UNIT), proc))
        print(f"systemd --user {UNIT}: {'running' if proc.returncode == 0 else 'not running'}; unit {self.path}"
              f"{'' if self.path.exists() else ' (missing)'}")
        print((proc.stdout or proc.stderr).rstrip())
        return 0 if proc.returncode == 0 else EXIT_NO_DAEMON


def backend(name: str | None) -> Backend:
    name = name or ("launchd" if sys.platform == "darwin" else "systemd")
    return Launchd() if name == "launchd" else Systemd()


# --- the command ---------------------------------------------------------------------------


def cmd_service(args: argparse.Namespace) -> int:
    mgr = backend(args.backend)
    if args.action == "install":
        mgr.tool.require()  # before anything is written
        mgr.preflight()
        inst = prepare(args.config)
        inst.log_dir.mkdir(parents=True, exist_ok=True)  # launchd does not create it
        mgr.install(inst)
        print(f"installed {mgr.path} ({mgr.name}); config {inst.config}; logs {inst.log_dir}")
        return 0
    if args.action == "uninstall":
        found = mgr.uninstall()
        print(f"uninstalled {mgr.path} (config and logs kept)" if found else "not installed: nothing to do")
        return 0
    if args.action == "restart":
        mgr.restart()
        print(f"restarted ({mgr.name})")
        return 0
    return mgr.status()


def add_service_parser(sub: argparse._SubParsersAction) -> None:
    """Register `mlxsup service ...` on the CLI's subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--backend", choices=["launchd", "systemd"], default=None,
                        help="service manager (default: launchd on macOS, systemd elsewhere)")
    s = sub.add_parser("service", help="run the daemon as a launchd agent / systemd user service")
    actions = s.add_subparsers(dest="action", required=True)
    i = actions.add_parser("install", parents=[common],
                           help="write the agent/unit for this installation and start it (re-install replaces)")
    i.add_argument("--config", default=None,
                   help="config file (or MLXSUP_CONFIG; default ~/.config/mlxsup/config.toml, created if missing)")
    actions.add_parser("uninstall", parents=[common], help="stop and remove it (config and logs are kept)")
    actions.add_parser("restart", parents=[common], help="restart the daemon (after editing the config)")
    actions.add_parser("status", parents=[common], help="what the service manager says; exit 3 when not running")
    s.set_defaults(func=cmd_service)


# --- deploy/ templates ---------------------------------------------------------------------

TEMPLATE_INSTALL = Install(python=Path("/ABSOLUTE/PATH/TO/venv/bin/python"),
                           config=Path("/HOME/.config/mlxsup/config.toml"),
                           log_dir=Path("/STATE_DIR/logs"), stop_timeout_s=stop_timeout_s(Settings()))


def templates() -> dict[str, bytes]:
    """deploy/ paths and their content: the renderers applied to placeholder paths."""
    return {f"launchd/{LABEL}.plist": render_plist(TEMPLATE_INSTALL),
            f"systemd/{UNIT}": render_unit(TEMPLATE_INSTALL).encode()}


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[2] / "deploy"
    for rel, data in templates().items():
        _write(root / rel, data)
        print(root / rel)
