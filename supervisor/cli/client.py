"""How the client commands reach a running daemon: its URL, its API key, and HTTP calls to it.

The URL comes from --url, else $MLXSUP_URL, else the daemon file in the state directory, else the
configured host and port; but a state directory named (--state-dir, $MLXSUP_STATE_DIR, the config file's) is
reached only through its daemon file: with none there, or one naming a process that has exited, the command says
so (EXIT_NO_DAEMON) rather than reach whatever daemon answers on the configured port. A daemon file naming a dead
process is never followed. The API key comes from $MLXSUP_API_KEY, else the config file's
`api_key` (the same file and variables `serve` reads), so a client on the daemon's machine needs
nothing exported. Every failure is one CliError line: the daemon's own error message for an HTTP
error, "not running" (EXIT_NO_DAEMON) when nothing answers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.client import HTTPResponse
from pathlib import Path
from typing import Any

from supervisor.cli.exits import EXIT_NO_DAEMON, EXIT_USAGE, CliError
from supervisor.config import DEFAULT_PORT, ConfigError, Settings, default_state_dir, resolve


def client_settings(args: argparse.Namespace) -> Settings:
    """Where a running daemon's files are, and its key: the same resolution as `serve`, but never fatal."""
    state_dir = Path(args.state_dir) if getattr(args, "state_dir", None) else None
    try:
        return resolve(getattr(args, "config", None), {"state_dir": state_dir})[0]
    except ConfigError:
        return Settings(state_dir=state_dir) if state_dir is not None else Settings()


@dataclass(frozen=True)
class Client:
    url: str  # the daemon's base URL, no trailing slash
    api_key: str | None = None

    @contextlib.contextmanager
    def request(self, path: str, method: str = "GET", body: dict | None = None,
                timeout: float = 600) -> Iterator[HTTPResponse]:
        """An HTTP exchange with the daemon; its failures become one-line CliErrors."""
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                yield resp
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read())["error"]["message"]
            except Exception:
                message = str(exc)
            raise CliError(message, EXIT_USAGE if exc.code in (400, 404) else 1) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            raise CliError(f"the mlxsup daemon is not running at {self.url} ({reason})", EXIT_NO_DAEMON) from None

    def call(self, path: str, method: str = "GET", body: dict | None = None, timeout: float = 600) -> Any:
        with self.request(path, method, body, timeout) as resp:
            return json.loads(resp.read())

    def stream_events(self, path: str, body: dict) -> Iterator[dict]:
        """POST and yield the JSON of each SSE `data:` line."""
        with self.request(path, "POST", body, timeout=3600) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    yield json.loads(line[6:])


def daemon_url(args: argparse.Namespace, settings: Settings | None = None) -> str:
    if getattr(args, "url", None):
        return args.url.rstrip("/")
    if env := os.environ.get("MLXSUP_URL"):
        return env.rstrip("/")
    settings = settings or client_settings(args)
    try:
        info = json.loads(settings.daemon_file.read_text())
        url, pid = str(info["url"]), int(info["pid"])
    except FileNotFoundError:
        if named_state_dir(args, settings):
            raise CliError(f"no mlxsup daemon runs on {settings.state_dir}: no daemon file ({settings.daemon_file}); "
                           f"start one with `mlxsup serve --state-dir {settings.state_dir}`, or name a daemon with "
                           "--url", EXIT_NO_DAEMON) from None
        return f"http://{settings.host}:{settings.port or DEFAULT_PORT}"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CliError(f"the daemon file {settings.daemon_file} cannot be read ({exc}); name the daemon with --url",
                       EXIT_NO_DAEMON) from None
    if not alive(pid):
        raise CliError(f"the mlxsup daemon of {settings.state_dir} is not running: its daemon file names pid {pid}, "
                       "which has exited", EXIT_NO_DAEMON)
    return url.rstrip("/")


def named_state_dir(args: argparse.Namespace, settings: Settings) -> bool:
    """Whether a state directory was named (an option, the environment, a config file), not the default."""
    return bool(getattr(args, "state_dir", None) or os.environ.get("MLXSUP_STATE_DIR")
                or settings.state_dir != default_state_dir())


def alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def connect(args: argparse.Namespace) -> Client:
    """The daemon these arguments name, with the API key the environment or the config file holds."""
    settings = client_settings(args)
    return Client(daemon_url(args, settings), os.environ.get("MLXSUP_API_KEY") or settings.api_key)
