"""What a running daemon serves and where it looks, for `mlxsup ls`, `rm` and `import`.

A daemon is told its folders on its own command line (`--model-dir`, `--demo`, `--state-dir`) and in a config file
a client may not read, so a client asks it (`GET /api/config`: its model folders, Hugging Face cache, state
directory, and every model it knows with its path) and looks in those folders itself, as the daemon does when a
name is new to it. With no daemon answering, the configuration `serve` would use now (files, environment) stands
in. Either way the folders are `model_dirs` and the import folder (`state_dir/models`, watched by every `serve`,
config.Settings.import_dir), the cache, and the `[models]` entries; a daemon adds the demo, if it serves one.
Invariant: a model `mlxsup status` lists with a folder on disk is a model `ls` lists and `rm` finds.
"""

from __future__ import annotations

import argparse
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.cli.client import client_settings, connect
from supervisor.cli.exits import EXIT_NO_DAEMON, EXIT_USAGE, CliError
from supervisor.config import DEMO_MODEL_ID, Settings, default_hf_cache
from supervisor.registry import ModelSpec, Registry, is_model_dir


@dataclass(frozen=True)
class Served:
    """Where models are found: a daemon's (url set) or the local configuration's."""

    model_dirs: list[Path]  # folders of model folders (or model folders themselves), the import folder last
    import_dir: Path  # state_dir/models: what every `serve` watches, `mlxsup import`'s default
    hf_cache: Path | None
    models: list[ModelSpec] = field(default_factory=list)  # known by name: [models] entries, the demo, ...
    configured: frozenset[str] = frozenset()  # ids the config names (their folders are the config's, not mlxsup's)
    url: str | None = None  # the daemon asked; None: no daemon answered

    @property
    def hub(self) -> Path:
        return self.hf_cache or default_hf_cache()

    def registry(self) -> Registry:
        """Every model on disk here: the folders looked at now (a model put there since the daemon last looked
        included), then the models known by name."""
        return Registry.build(self.model_dirs, self.models, self.hf_cache)

    def target_dir(self) -> Path:
        """Where `mlxsup import` puts a model so this daemon (or the next `serve`) serves it: the first folder of
        model folders it watches (a configured one before the import folder)."""
        return next((d for d in self.model_dirs if not is_model_dir(d)), self.import_dir)


def local(args: argparse.Namespace) -> Served:
    """What `serve` would look at now, from the files and the environment (and `ls --model-dir`)."""
    settings = client_settings(args)
    given = getattr(args, "model_dir", None)  # `ls --model-dir` (repeatable); import's own is no folder to list
    extra = [Path(d).expanduser() for d in given] if isinstance(given, list) else []
    dirs = list(dict.fromkeys([*settings.model_dirs, *extra, settings.import_dir]))
    models = list(settings.models)
    if is_model_dir(settings.demo_path):  # imported by an earlier `serve --demo` on this state directory
        models.append(ModelSpec(DEMO_MODEL_ID, settings.demo_path))
    return Served(dirs, settings.import_dir, settings.hf_cache, models, frozenset(s.id for s in settings.models))


def daemons(args: argparse.Namespace) -> Served | None:
    """What the running daemon looks at (None: no daemon answers). The local configuration's `[models]` entries
    and `ls --model-dir` folders are added: they are on disk, served or not."""
    try:
        client = connect(args)
        view = client.call("/api/config", timeout=10)
    except CliError as exc:
        if exc.code == EXIT_NO_DAEMON:
            return None
        raise
    server = view["config"]["server"]
    state_dir = Path(server["state_dir"])
    import_dir = Settings(state_dir=state_dir).import_dir
    mine = local(args)
    dirs = list(dict.fromkeys([*(Path(d) for d in server.get("model_dirs") or []), import_dir, *mine.model_dirs]))
    models = [ModelSpec(model_id, Path(entry["path"]), tuple(entry.get("aliases") or ()))
              for model_id, entry in view["config"].get("models", {}).items()]
    known = {m.id for m in models}
    models += [m for m in mine.models if m.id not in known]
    hf_cache = Path(server["hf_cache"]) if server.get("hf_cache") else None
    # the daemon's ids that no look in its folders finds are named by its config (or are its demo)
    found = set(Registry.build(dirs, [], hf_cache).specs)
    configured = frozenset({m.id for m in models if m.id not in found} | mine.configured)
    return Served(dirs, import_dir, hf_cache, models, configured, client.url)


def served(args: argparse.Namespace) -> Served:
    return daemons(args) or local(args)


def removable_folder(where: Served, spec: ModelSpec) -> Path | None:
    """The model folder `mlxsup rm` may delete for a model outside the cache: one a watched folder of model folders
    holds directly (where `mlxsup import` writes), named by no config entry. None: not such a folder."""
    if spec.id in where.configured or spec.id == DEMO_MODEL_ID:
        return None
    parents = {d.resolve() for d in where.model_dirs if d.is_dir() and not is_model_dir(d)}
    path = spec.path.resolve()
    return path if path.parent in parents and is_model_dir(path) and not spec.path.is_symlink() else None


def not_removable(spec: ModelSpec, where: Served) -> CliError:
    if spec.id == DEMO_MODEL_ID:
        why = (f"demo is `serve --demo`'s model, in {spec.path}: it is imported again by the next `serve --demo` "
               "if removed; remove that folder yourself once no daemon serves it")
    elif spec.id in where.configured:
        why = (f"{spec.id} is named by a [models] entry of the config (its path: {spec.path}): remove the entry, "
               "then the folder yourself if you want it gone")
    else:
        why = f"{spec.id} is not in the Hugging Face cache but in {spec.path}: remove that folder yourself"
    return CliError(why, EXIT_USAGE)


def remove_folder(path: Path) -> int:
    """Delete a model folder (a link in it is removed, never followed); the bytes of the files it held."""
    freed = sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    shutil.rmtree(path)
    return freed
