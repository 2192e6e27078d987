"""`mlxsup import GGUF [--name NAME] [--model-dir DIR]`: a GGUF file becomes an MLX model folder the daemon serves.

The conversion is worker-side code (worker/mlx_engine/gguf_import.py imports MLX; the supervisor never
does), run as `python -m worker.mlx_engine.gguf_import`, whose progress and errors reach the terminal as
they are. The folder goes into --model-dir, else where the running daemon looks (the first of its model folders,
else its import folder, `state_dir/models`: the demo's daemon has only that one), else the first of the configured
`model_dirs`, else the import folder, which every `serve` watches; a daemon watching that folder serves the model
once the import has renamed it into place.

A model name (`--name`, else the file's name) is one plain folder name, NAME_RULE: 1 to 128 characters, ASCII
letters, digits, `_`, `.` and `-`, the first a letter, a digit or `_` (so never `.`, `..`, a hidden or temporary
folder, an option, a path: no `/`, `\\`, NUL). Any other is refused with exit 2 before anything is read or
written. The target is DIR/NAME, a direct child of the model folder (a symbolic link there is refused, never
followed); the converter replaces it under --force only where it is a model folder, and by a swap.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from supervisor.cli.exits import EXIT_USAGE, CliError
from supervisor.cli.served import daemons
from supervisor.config import ConfigError, resolve

MAX_NAME = 128
NAME_RULE = re.compile(rf"[A-Za-z0-9_][A-Za-z0-9._-]{{0,{MAX_NAME - 1}}}")
RULE_TEXT = (f"a model name is one folder name of 1 to {MAX_NAME} ASCII letters, digits, '_', '.' and '-', "
             "starting with a letter, a digit or '_' (no '/', no '\\', not '.' or '..'), e.g. qwen3-4b")


def default_name(gguf: Path) -> str:
    """The file's name without `.gguf`, in characters a model id keeps (`Qwen3-4B-Q4_0`): always a NAME_RULE name."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", gguf.name.removesuffix(".gguf")).strip("-.")
    return name[:MAX_NAME].rstrip("-.") or "model"


def check_name(name: str) -> str:
    if not NAME_RULE.fullmatch(name):
        shown = repr(name) if len(name) <= 80 else repr(name[:80]) + f"... ({len(name)} characters)"
        raise CliError(f"--name {shown} is not a model name: {RULE_TEXT}", EXIT_USAGE)
    return name


def model_target(model_dir: Path, name: str) -> Path:
    """DIR/NAME, resolved: a direct child of the model folder that is not a link (whatever NAME is, a checked one)."""
    check_name(name)
    if model_dir.exists() and not model_dir.is_dir():
        raise CliError(f"the model folder {model_dir} is not a folder", EXIT_USAGE)
    root = model_dir.resolve()
    out = root / name
    if out.is_symlink():
        raise CliError(f"--name {name!r}: {out} is a symbolic link; mlxsup import neither follows nor replaces one "
                       "(choose another name)", EXIT_USAGE)
    if out.resolve().parent != root:  # the rule and the link check make this unreachable: a last guard
        raise CliError(f"--name {name!r}: {out} is not a folder directly in {root}", EXIT_USAGE)
    return out


def target_dir(args: argparse.Namespace) -> Path:
    if args.model_dir:
        return Path(args.model_dir).expanduser()
    try:
        settings, _ = resolve(args.config, {"state_dir": Path(args.state_dir) if args.state_dir else None})
    except ConfigError as exc:
        raise CliError(f"bad config: {exc}", EXIT_USAGE) from None
    where = daemons(args)  # a running daemon's folders: its --model-dir, or its import folder (the demo's daemon)
    if where is not None:
        folder = where.target_dir()
        print(f"importing into {folder}, which the daemon at {where.url} watches", file=sys.stderr, flush=True)
        return folder
    if settings.model_dirs:
        return settings.model_dirs[0]
    print(f"importing into {settings.import_dir}, which every `mlxsup serve` watches (no daemon runs now)",
          file=sys.stderr, flush=True)
    return settings.import_dir


def cmd_import(args: argparse.Namespace) -> int:
    gguf = Path(args.gguf).expanduser()
    if not gguf.is_file():
        raise CliError(f"no such file: {gguf}", EXIT_USAGE)
    name = check_name(args.name) if args.name is not None else default_name(gguf)  # before the config is read
    out = model_target(target_dir(args), name)
    argv = [sys.executable, "-m", "worker.mlx_engine.gguf_import", str(gguf), str(out)]
    argv += ["--force"] if args.force else []
    argv += ["--quantize", str(args.quantize)] if args.quantize else []
    return subprocess.run(argv).returncode


def add_import_parser(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("import", help="convert a GGUF file (llama, qwen2, qwen3) into an MLX model folder")
    m.add_argument("gguf", help="the .gguf file (Ollama's blobs and LM Studio's models folder hold them)")
    m.add_argument("--name", default=None, help="the model's name, one folder name of up to 128 letters, digits, "
                   "'_', '.' and '-', not starting with '.' or '-' (default: the file's name without .gguf)")
    m.add_argument("--model-dir", default=None, help="the folder of model folders to write it to (default: the "
                   "running daemon's first model folder, else the first configured model_dirs, else "
                   "STATE_DIR/models, which every `mlxsup serve` watches)")
    m.add_argument("--config", default=None, help="TOML config file, for model_dirs (or MLXSUP_CONFIG)")
    m.add_argument("--state-dir", default=None, help="the daemon's state directory (for its config)")
    m.add_argument("--force", action="store_true", help="replace a model folder of that name (never a folder that "
                   "is not a model: config.json and *.safetensors)")
    m.add_argument("--quantize", type=int, default=None, choices=[4, 8],
                   help="tensor types MLX cannot read as they are (K-quants, IQ*) are dequantized, then quantized "
                        "to this many bits (group size 64); default: kept in bf16. Q4_0, Q4_1, Q8_0, F16, BF16 and "
                        "F32 are converted without loss either way")
    m.set_defaults(func=cmd_import)
