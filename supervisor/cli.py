"""The `mlxsup` command: serve | status | evict | load | make-model.

Client commands talk to a running daemon over HTTP (URL from --url, MLXSUP_URL, or the daemon
file in the state directory). Every failure is a one-line message on stderr and a non-zero
exit: 2 for bad usage or an unknown model, 3 when the daemon is not running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from supervisor.config import DEFAULT_PORT, ConfigError, Settings, default_state_dir, load_file, parse_size

EXIT_USAGE = 2
EXIT_NO_DAEMON = 3


class CliError(Exception):
    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def daemon_url(args: argparse.Namespace) -> str:
    if args.url:
        return args.url.rstrip("/")
    if env := os.environ.get("MLXSUP_URL"):
        return env.rstrip("/")
    state = Path(args.state_dir) if args.state_dir else default_state_dir()
    try:
        return json.loads((state / "daemon.json").read_text())["url"]
    except (OSError, ValueError, KeyError):
        return f"http://127.0.0.1:{DEFAULT_PORT}"


def call(url: str, method: str = "GET", body: dict | None = None, timeout: float = 600) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except Exception:
            message = str(exc)
        raise CliError(message, EXIT_USAGE if exc.code in (400, 404) else 1) from None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        raise CliError(f"the mlxsup daemon is not running at {url.split('/api')[0]} ({reason})",
                       EXIT_NO_DAEMON) from None


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def cmd_status(args: argparse.Namespace) -> int:
    status = call(daemon_url(args) + "/api/status")
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(f"mlxsup {status['version']}  up {status['uptime_s']:.0f}s")
    rows = [("MODEL", "STATE", "PID", "MEMORY", "IN-FLIGHT", "BATCH", "HOT CACHE", "SSD CACHE", "LAST ERROR")]
    for m in status["models"]:
        cache = m.get("cache") or {}
        hot, ssd = cache.get("hot") or {}, cache.get("ssd") or {}
        rows.append((m["id"], m["state"], str(m["pid"] or "-"), _mib(m["memory_bytes"]), str(m["in_flight"]),
                     str(m.get("batch_size", "-")), _mib(hot.get("bytes")),
                     _mib(ssd.get("bytes")) if ssd.get("enabled") else ("off" if ssd else "-"),
                     (m.get("last_error") or "")[:60]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    base = daemon_url(args)
    models = args.models
    if args.all:
        models = [m["id"] for m in call(base + "/api/status")["models"] if m["state"] not in ("stopped", "failed")]
    elif not models:
        raise CliError("name a model to evict, or pass --all", EXIT_USAGE)
    body: dict = {"mode": "now" if args.now else "drain"}
    if args.timeout is not None:
        body["timeout"] = args.timeout
    for model in models:
        r = call(f"{base}/api/models/{model}/evict", "POST", body)
        if not r.get("evicted"):
            print(f"{r['model']}: not loaded")
            continue
        print(f"{r['model']}: evicted pid {r['pid']} in {r['duration_s']:.2f}s, returned "
              f"{_mib(r['memory_before_bytes'])} (exit {r['exit']}, aborted {r['aborted']}, "
              f"signals {','.join(r['signals']) or 'none'})")
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    r = call(f"{daemon_url(args)}/api/models/{args.model}/load", "POST", {})
    print(f"{r['model']}: {r['state']} (pid {r['pid']}) in {r['duration_s']:.2f}s")
    return 0


def cmd_make_model(args: argparse.Namespace) -> int:
    argv = [sys.executable, "-m", "worker.make_model", args.dir, "--preset", args.preset, "--seed", str(args.seed)]
    return subprocess.run(argv).returncode


def cmd_serve(args: argparse.Namespace) -> int:
    settings = Settings()
    config_path = args.config or os.environ.get("MLXSUP_CONFIG")
    try:
        if config_path:
            load_file(Path(config_path), settings)
    except ConfigError as exc:
        raise CliError(f"bad config: {exc}", EXIT_USAGE) from None
    if args.host:
        settings.host = args.host
    if args.port is not None:
        settings.port = args.port
    if args.state_dir:
        settings.state_dir = Path(args.state_dir)
    settings.model_dirs += [Path(d) for d in args.model_dir]
    if args.memory_ceiling is not None:
        try:
            settings.memory_ceiling_bytes = parse_size(args.memory_ceiling)
        except ValueError as exc:
            raise CliError(f"--memory-ceiling: {exc}", EXIT_USAGE) from None
    if args.max_loaded_models is not None:
        settings.max_loaded_models = args.max_loaded_models
    if args.ttl is not None:
        settings.default_ttl_s = args.ttl
    settings.demo = args.demo
    settings.log_level = args.log_level
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from supervisor.daemon import serve

    return asyncio.run(serve(settings))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlxsup", description="Serve local LLMs with MLX, one model per worker process.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the daemon")
    s.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=None, help=f"HTTP port (default {DEFAULT_PORT}; 0 picks one)")
    s.add_argument("--model-dir", action="append", default=[], help="a folder of model folders (repeatable)")
    s.add_argument("--config", default=None, help="TOML config file (or MLXSUP_CONFIG)")
    s.add_argument("--state-dir", default=None)
    s.add_argument("--demo", action="store_true", help="serve a small random-weight model as 'demo'")
    s.add_argument("--memory-ceiling", default=None, help="e.g. 24GiB (default: RAM minus a reserve)")
    s.add_argument("--max-loaded-models", type=int, default=None)
    s.add_argument("--ttl", type=float, default=None, help="default idle TTL in seconds (default: none)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(func=cmd_serve)

    def client(name: str, help_: str):
        c = sub.add_parser(name, help=help_)
        c.add_argument("--url", default=None, help="daemon URL (or MLXSUP_URL)")
        c.add_argument("--state-dir", default=None)
        return c

    c = client("status", "show the loaded models")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_status)

    c = client("evict", "unload models and wait until their processes are gone")
    c.add_argument("models", nargs="*")
    c.add_argument("--all", action="store_true")
    c.add_argument("--now", action="store_true", help="abort running requests instead of draining them")
    c.add_argument("--timeout", type=float, default=None, help="drain deadline in seconds")
    c.set_defaults(func=cmd_evict)

    c = client("load", "load a model now")
    c.add_argument("model")
    c.set_defaults(func=cmd_load)

    m = sub.add_parser("make-model", help="write a random-weight model (for tests, the demo, benchmarks)")
    m.add_argument("dir")
    m.add_argument("--preset", default="tiny", choices=["tiny", "small", "1b"])
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=cmd_make_model)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CliError as exc:
        print(f"mlxsup: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
