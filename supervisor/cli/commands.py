"""The `mlxsup` command: serve | status | evict | load | logs | config show | make-model | service.

Client commands talk to a running daemon over HTTP (URL from --url, MLXSUP_URL, or the daemon
file in the state directory). Every failure is a one-line message on stderr and a non-zero
exit: 2 for bad usage or an unknown model, 3 when the daemon is not running.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from supervisor.cli.exits import EXIT_NO_DAEMON, EXIT_USAGE, CliError
from supervisor.cli.service import add_service_parser
from supervisor.config import DEFAULT_PORT, ConfigError, Settings, describe, parse_size, resolve
from supervisor.reports import EvictReport, ModelStatus

# `mlxsup make-model --arch`: the families worker/mlx_engine/make_model writes (the supervisor never imports the worker)
MODEL_ARCHES = ["llama", "qwen3", "qwen3_moe", "gemma3", "gpt_oss", "qwen3_5"]


def daemon_url(args: argparse.Namespace) -> str:
    if args.url:
        return args.url.rstrip("/")
    if env := os.environ.get("MLXSUP_URL"):
        return env.rstrip("/")
    settings = client_settings(args)
    try:
        return json.loads(settings.daemon_file.read_text())["url"]
    except (OSError, ValueError, KeyError):
        return f"http://{settings.host}:{settings.port or DEFAULT_PORT}"


def client_settings(args: argparse.Namespace) -> Settings:
    """Where a running daemon's files are: the same resolution as `serve`, but never fatal."""
    state_dir = Path(args.state_dir) if getattr(args, "state_dir", None) else None
    try:
        return resolve(getattr(args, "config", None), {"state_dir": state_dir})[0]
    except ConfigError:
        return Settings(state_dir=state_dir) if state_dir is not None else Settings()


@contextlib.contextmanager
def request(url: str, method: str = "GET", body: dict | None = None, timeout: float = 600) -> Iterator:
    """An HTTP exchange with the daemon; its failures become one-line CliErrors."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if key := os.environ.get("MLXSUP_API_KEY"):
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
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
        raise CliError(f"the mlxsup daemon is not running at {url.split('/api')[0]} ({reason})",
                       EXIT_NO_DAEMON) from None


def call(url: str, method: str = "GET", body: dict | None = None) -> dict:
    with request(url, method, body) as resp:
        return json.loads(resp.read())


def stream_events(url: str, body: dict) -> Iterator[dict]:
    """POST and yield the JSON of each SSE `data:` line."""
    with request(url, "POST", body, timeout=3600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: "):
                yield json.loads(line[6:])


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def cmd_status(args: argparse.Namespace) -> int:
    status = call(daemon_url(args) + "/api/status")
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(f"mlxsup {status['version']}  up {status['uptime_s']:.0f}s")
    rows = [("MODEL", "STATE", "PID", "MEMORY", "IN-FLIGHT", "BATCH", "HOT CACHE", "SSD CACHE", "LAST ERROR")]
    for m in map(ModelStatus.from_dict, status["models"]):
        cache = m.cache or {}
        hot, ssd = cache.get("hot") or {}, cache.get("ssd") or {}
        rows.append((m.id, m.state, str(m.pid or "-"), _mib(m.memory_bytes), str(m.in_flight), str(m.batch_size),
                     _mib(hot.get("bytes")), _mib(ssd.get("bytes")) if ssd.get("enabled") else ("off" if ssd else "-"),
                     (m.last_error or "")[:60]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    base = daemon_url(args)
    models = args.models
    if args.all:
        statuses = map(ModelStatus.from_dict, call(base + "/api/status")["models"])
        models = [m.id for m in statuses if m.state not in ("stopped", "failed")]
    elif not models:
        raise CliError("name a model to evict, or pass --all", EXIT_USAGE)
    body: dict = {"mode": "now" if args.now else "drain"}
    if args.timeout is not None:
        body["timeout"] = args.timeout
    for model in models:
        r = EvictReport.from_dict(call(f"{base}/api/models/{model}/evict", "POST", body))
        if not r.evicted:
            print(f"{r.model}: not loaded")
            continue
        print(f"{r.model}: evicted pid {r.pid} in {r.duration_s or 0.0:.2f}s, returned "
              f"{_mib(r.memory_before_bytes)} (exit {r.exit}, aborted {r.aborted}, "
              f"signals {','.join(r.signals) or 'none'})")
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    tty = sys.stdout.isatty()
    for event in stream_events(f"{daemon_url(args)}/api/models/{args.model}/load", {"stream": True}):
        if "error" in event:
            raise CliError(event["error"]["message"])
        if "stage" in event:
            line = f"loading {args.model}: {event['stage']} {event['fraction']:.0%}"
            print(("\r" + line.ljust(60)) if tty else line, end="" if tty else "\n", flush=True)
            continue
        print(("\n" if tty else "") + f"{event['model']}: {event['state']} (pid {event['pid']}) "
              f"in {event['duration_s']:.2f}s")
    return 0


def log_path(settings: Settings, model: str | None) -> Path:
    return settings.worker_log(model) if model else settings.log_dir / "mlxsup.log"


def cmd_logs(args: argparse.Namespace) -> int:
    path = log_path(client_settings(args), args.model)
    if not path.exists():
        what = f"model '{args.model}'" if args.model else "the daemon"
        raise CliError(f"no log for {what} at {path}", EXIT_USAGE)
    with open(path, "rb") as f:
        lines = f.readlines()[-args.lines:] if args.lines else []
        sys.stdout.write(b"".join(lines).decode("utf-8", "replace"))
        sys.stdout.flush()
        if args.follow:
            follow(path, f)
    return 0


def follow(path: Path, f) -> None:
    """Print what is appended to `path`, across rotations, until interrupted."""
    import time

    inode = os.fstat(f.fileno()).st_ino
    while True:
        chunk = f.read()
        if chunk:
            sys.stdout.write(chunk.decode("utf-8", "replace"))
            sys.stdout.flush()
            continue
        try:
            st = path.stat()
        except FileNotFoundError:
            st = None
        if st is not None and (st.st_ino != inode or st.st_size < f.tell()):  # rotated or truncated
            f.close()
            f = open(path, "rb")
            inode = st.st_ino
            continue
        time.sleep(0.25)  # a tail's poll interval


def cmd_config_show(args: argparse.Namespace) -> int:
    try:
        settings, path = resolve(args.config, {"state_dir": Path(args.state_dir) if args.state_dir else None})
    except ConfigError as exc:
        raise CliError(f"bad config: {exc}", EXIT_USAGE) from None
    print(json.dumps(describe(settings, path), indent=2))
    return 0


def cmd_make_model(args: argparse.Namespace) -> int:
    argv = [sys.executable, "-m", "worker.mlx_engine.make_model", args.dir, "--arch", args.arch,
            "--preset", args.preset, "--seed", str(args.seed)]
    if args.quantize:
        argv += ["--quantize", str(args.quantize)]
    return subprocess.run(argv).returncode


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        ceiling = parse_size(args.memory_ceiling) if args.memory_ceiling is not None else None
        settings, _ = resolve(args.config, {
            "host": args.host, "port": args.port, "state_dir": Path(args.state_dir) if args.state_dir else None,
            "memory_ceiling_bytes": ceiling, "max_loaded_models": args.max_loaded_models,
            "default_ttl_s": args.ttl, "log_level": args.log_level, "demo": args.demo or None,
        })
    except (ConfigError, ValueError) as exc:
        raise CliError(f"bad config: {exc}", EXIT_USAGE) from None
    settings.model_dirs += [Path(d) for d in args.model_dir]
    setup_logging(settings)
    from supervisor.daemon import StartupError, serve

    try:
        return asyncio.run(serve(settings))
    except StartupError as exc:
        logging.getLogger("supervisor.daemon").error("[start] %s", exc)
        raise CliError(str(exc), no_retry_status()) from None


def no_retry_status() -> int:
    """The exit status that tells the service manager not to restart us (a start that cannot succeed).

    systemd's unit names EXIT_USAGE in RestartPreventExitStatus. launchd's KeepAlive
    {SuccessfulExit: false} restarts after any non-zero status, so under launchd (the agent sets
    MLXSUP_SERVICE=launchd) the only "stay down" is 0; the reason is in the log.
    """
    return 0 if os.environ.get("MLXSUP_SERVICE") == "launchd" else EXIT_USAGE


def setup_logging(settings: Settings) -> None:
    """A rotated file under the state dir, and stderr unless MLXSUP_LOG_STDERR=0 (set by the launchd
    agent: launchd's stderr file never rotates; crashes before logging starts still land there)."""
    from logging.handlers import RotatingFileHandler

    settings.log_dir.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    file_handler = RotatingFileHandler(settings.log_dir / "mlxsup.log", maxBytes=10 * 2**20, backupCount=3)
    stderr_handler = logging.StreamHandler(sys.stderr)
    handlers: list[logging.Handler] = [file_handler]
    if os.environ.get("MLXSUP_LOG_STDERR") != "0":
        handlers.append(stderr_handler)
    for h in handlers:
        h.setFormatter(fmt)
    logging.basicConfig(level=settings.log_level.upper(), handlers=handlers, force=True)


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
    s.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"])
    s.set_defaults(func=cmd_serve)

    def client(name: str, help_: str):
        c = sub.add_parser(name, help=help_)
        c.add_argument("--url", default=None, help="daemon URL (or MLXSUP_URL)")
        c.add_argument("--state-dir", default=None)
        c.add_argument("--config", default=None, help="TOML config file (or MLXSUP_CONFIG)")
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

    c = client("load", "load a model now, showing progress")
    c.add_argument("model")
    c.set_defaults(func=cmd_load)

    c = client("logs", "print the daemon's log, or a model worker's")
    c.add_argument("model", nargs="?")
    c.add_argument("-n", "--lines", type=int, default=50)
    c.add_argument("-f", "--follow", action="store_true")
    c.set_defaults(func=cmd_logs)

    cfg = sub.add_parser("config", help="configuration")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    c = cfg_sub.add_parser("show", help="print the effective configuration (file < environment < flags)")
    c.add_argument("--config", default=None)
    c.add_argument("--state-dir", default=None)
    c.set_defaults(func=cmd_config_show)

    m = sub.add_parser("make-model", help="write a random-weight model (for tests, the demo, benchmarks)")
    m.add_argument("dir")
    m.add_argument("--arch", default="llama", choices=MODEL_ARCHES,
                   help="architecture family (mlx-lm's model classes, real config fields, tokens and chat template)")
    m.add_argument("--preset", default="tiny", choices=["tiny", "small", "1b"],
                   help="tiny: a few MB, for tests; small: ~100M parameters; 1b: ~1B parameters in bf16")
    m.add_argument("--quantize", type=int, default=None, choices=[4, 8],
                   help="bits per weight, affine, group size 64, as mlx-lm converts")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=cmd_make_model)

    add_service_parser(sub)
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
