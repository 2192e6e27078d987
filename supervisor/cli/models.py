"""`mlxsup pull ORG/NAME[@REV]`, `mlxsup ls`, `mlxsup rm MODEL`: the models on disk, got and removed.

`pull` downloads into the Hugging Face cache the daemon reads ([server] hf_cache, else HF_HUB_CACHE /
HF_HOME's, else ~/.cache/huggingface/hub) with supervisor/hub/pull.py, here in this process: a bar per
file and overall on a terminal, plain lines otherwise; Ctrl-C stops it with its partial file kept for the
next pull to resume, and the model not offered for serving meanwhile. `ls` lists the models the running
daemon serves and looks for (its cache, model folders, config entries and demo: cli/served.py), else those the
configuration finds, with what their config.json says, and which are loaded. `rm` removes a cache entry with
huggingface_hub's own delete strategy, or a model folder a watched folder of model folders holds (where
`mlxsup import` writes); a model a config entry names, and the demo, are refused, saying where they are; a
loaded model is refused unless --force, which evicts it first. An id the hub's rules refuse, or a hub that
cannot be reached (no network, HF_ENDPOINT, HF_HUB_OFFLINE), is one line saying what to do and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

from supervisor.cli.client import client_settings, connect
from supervisor.cli.exits import EXIT_NO_DAEMON, EXIT_USAGE, CliError
from supervisor.cli.served import not_removable, removable_folder, remove_folder, served
from supervisor.cli.views import duration, evict_line, size
from supervisor.config import Settings, default_hf_cache
from supervisor.hub import store
from supervisor.hub.pull import BadReference, HubUnreachable, Progress, PullError, plan, pull, still_needed
from supervisor.registry import ModelSpec, Registry
from supervisor.reports import EvictReport

PLAIN_LINE_S = 5.0  # not on a terminal: a progress line at most this often within a file
BAR = 24


def hub_of(settings: Settings) -> Path:
    return settings.hf_cache or default_hf_cache()


def progress_line(pr: Progress) -> str:
    frac = pr.done / pr.total if pr.total else 1.0
    filled = int(BAR * frac)
    eta = duration(pr.eta_s) if pr.eta_s is not None else "-"
    return (f"[{'#' * filled}{'-' * (BAR - filled)}] {frac:4.0%} {size(pr.done)}/{size(pr.total)} "
            f"{size(int(pr.rate))}/s {eta} left | {pr.index}/{pr.count} {pr.file} "
            f"{size(pr.file_done)}/{size(pr.file_total)}")


class Printer:
    """Progress as one rewritten line on a terminal, else a line per file and every PLAIN_LINE_S."""

    def __init__(self, tty: bool) -> None:
        self.tty = tty
        self.shown: tuple[str, int] | None = None
        self.at = 0.0

    def __call__(self, pr: Progress) -> None:
        line = progress_line(pr)
        if self.tty:
            print("\r" + line[:160].ljust(160), end="", flush=True)
            return
        key = (pr.file, pr.file_done >= pr.file_total)
        now = time.monotonic()
        if key != self.shown or now - self.at >= PLAIN_LINE_S:
            print(line, flush=True)
            self.shown, self.at = key, now

    def end(self) -> None:
        if self.tty:  # past the rewritten line
            print(flush=True)


def cmd_pull(args: argparse.Namespace) -> int:
    hub = hub_of(client_settings(args))
    try:
        p = plan(args.model)
        need = still_needed(p, hub)
        print(f"pulling {p.repo_id}@{p.revision} (commit {p.commit[:12]}): {len(p.files)} files, {size(p.total)}"
              + (f", {size(need)} to fetch" if need != p.total else "") + f", into {hub}", flush=True)
        printer = Printer(sys.stdout.isatty())
        try:
            snapshot = pull(p, hub, printer)
        finally:
            printer.end()
    except (BadReference, HubUnreachable) as exc:  # nothing was asked of the hub, or it could not be reached
        raise CliError(str(exc), EXIT_USAGE) from None
    except PullError as exc:
        raise CliError(str(exc)) from None
    except KeyboardInterrupt:
        print(f"interrupted: {args.model} is not served until a pull completes; run `mlxsup pull {args.model}` "
              "to resume", file=sys.stderr, flush=True)
        return 130
    short = p.repo_id.rpartition("/")[2]
    print(f"{p.repo_id}: complete and verified in {snapshot}\nserve it as '{p.repo_id}' (or '{short}' where no "
          "other model has that name)", flush=True)
    return 0


def daemon_models(args: argparse.Namespace) -> dict[str, dict] | None:
    """The running daemon's models by id (None: no daemon answers)."""
    try:
        return {m["id"]: m for m in connect(args).call("/api/status", timeout=10)["models"]}
    except CliError as exc:
        if exc.code == EXIT_NO_DAEMON:
            return None
        raise


def ls_rows(registry: Registry, hub: Path | None, loaded: dict[str, dict] | None) -> list[dict]:
    rows = []
    for spec in registry.on_disk():
        facts = store.facts(spec.path)
        state = loaded.get(spec.id, {}).get("state", "stopped") if loaded is not None else None
        rows.append({"id": spec.id, "size_bytes": store.disk_bytes(spec.path), "family": facts.family,
                     "quantization": facts.quantization, "context_length": facts.context_length,
                     "path": str(spec.path), "loaded": None if state is None else state not in ("stopped", "failed"),
                     "state": state, "aliases": list(spec.aliases)})
    for mark in store.marks(hub).values():
        rows.append({"id": mark.repo_id, "size_bytes": store.disk_bytes(store.repo_folder(hub, mark.repo_id))
                     if hub else 0, "family": None, "quantization": None, "context_length": None,
                     "path": str(store.repo_folder(hub, mark.repo_id)) if hub else "", "loaded": False,
                     "state": mark.state, "aliases": []})
    return rows


def cmd_ls(args: argparse.Namespace) -> int:
    where = served(args)  # the running daemon's folders and models (its --model-dir and demo too), else the config's
    loaded = daemon_models(args) if where.url else None
    rows = ls_rows(where.registry(), where.hf_cache, loaded)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = [("MODEL", "SIZE", "FAMILY", "QUANT", "CONTEXT", "LOADED", "PATH")]
    for r in rows:
        state = "-" if r["state"] is None else ("yes" if r["loaded"] else "no") if r["state"] not in (
            store.DOWNLOADING, store.INTERRUPTED, store.FAILED) else r["state"]
        table.append((r["id"], size(r["size_bytes"]), r["family"] or "-", r["quantization"] or "-",
                      str(r["context_length"] or "-"), state, r["path"]))
    widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip())
    if loaded is None:
        print("(no daemon is running: LOADED is unknown)")
    return 0


def _cache_model(args: argparse.Namespace) -> tuple[str, Path, ModelSpec | None, Path | None]:
    """(repo id, cache, spec, folder) of the model `args.model` names: a cache entry (a served model or a marked,
    partial pull; folder None) or a model folder in a watched folder of model folders (`mlxsup import`'s)."""
    where = served(args)  # what the running daemon serves, else what the configuration finds
    registry, hub = where.registry(), where.hub
    try:
        spec: ModelSpec | None = registry.resolve(args.model)
    except Exception:
        spec = None
    if spec is None:
        mark = next((m for m in store.marks(hub).values() if args.model in (m.repo_id, m.repo_id.rpartition("/")[2])),
                    None)
        if mark is None:
            raise CliError(f"no model '{args.model}' on disk (see `mlxsup ls`)", EXIT_USAGE)
        return mark.repo_id, hub, None, None
    if not spec.path.is_relative_to(hub.resolve()) and not spec.path.is_relative_to(hub):
        if (folder := removable_folder(where, spec)) is None:
            raise not_removable(spec, where)
        return spec.id, hub, spec, folder
    return spec.id, hub, spec, None


def cmd_rm(args: argparse.Namespace) -> int:
    repo_id, hub, spec, folder = _cache_model(args)
    live = daemon_models(args)
    model = (live or {}).get(repo_id)
    if model is not None and model.get("pid") and model["state"] not in ("stopped", "failed"):
        if not args.force:
            raise CliError(f"{repo_id} is loaded (pid {model['pid']}): evict it first (`mlxsup evict {repo_id}`), "
                           "or pass --force to evict and remove it", EXIT_USAGE)
        report = connect(args).call(f"/api/models/{quote(repo_id, safe='/')}/evict", "POST", {"mode": "drain"})
        print(evict_line(EvictReport.from_dict(report)), flush=True)
    if folder is not None:
        freed = remove_folder(folder)
        print(f"removed {repo_id}: {folder}, {size(freed)} freed", flush=True)
        return 0
    freed = store.remove(hub, repo_id)
    print(f"removed {repo_id} from {hub}: {size(freed)} freed", flush=True)
    return 0


def add_model_parsers(sub: argparse._SubParsersAction, client: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """`client(name, help)` adds a command with the daemon's --url, --state-dir and --config; `pull` asks no
    daemon, only the configuration (for the cache it writes to)."""
    c = sub.add_parser("pull", help="download a model from the Hugging Face hub into its cache, showing progress")
    c.add_argument("--config", default=None, help="TOML config file, for [server] hf_cache (or MLXSUP_CONFIG)")
    c.add_argument("--state-dir", default=None, help="the daemon's state directory (for its config)")
    c.add_argument("model", help="ORG/NAME or ORG/NAME@REVISION (a branch, tag or commit), e.g. "
                   "mlx-community/Qwen3-4B-4bit")
    c.set_defaults(func=cmd_pull)

    c = client("ls", "list the models on disk: size, family, quantization, context, path, loaded")
    c.add_argument("--model-dir", action="append", default=[], help="a folder of model folders to list too")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.set_defaults(func=cmd_ls)

    c = client("rm", "remove a model from the Hugging Face cache")
    c.add_argument("model", help="its repo id, short name or alias")
    c.add_argument("--force", action="store_true", help="evict it first if it is loaded")
    c.set_defaults(func=cmd_rm)

