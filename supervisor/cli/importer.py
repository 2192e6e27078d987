"""`mlxsup import GGUF [--name NAME] [--model-dir DIR]`: a GGUF file becomes an MLX model folder the daemon serves.

The conversion is worker-side code (worker/mlx_engine/gguf_import.py imports MLX; the supervisor never
does), run as `python -m worker.mlx_engine.gguf_import`, whose progress and errors reach the terminal as
they are. The folder goes into --model-dir, else the first of the configured `model_dirs`; a daemon
watching that folder serves the model once the import has renamed it into place.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from supervisor.cli.exits import EXIT_USAGE, CliError
from supervisor.config import ConfigError, resolve


def default_name(gguf: Path) -> str:
    """The file's name without `.gguf`, in characters a model id keeps (`Qwen3-4B-Q4_0`)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", gguf.name.removesuffix(".gguf")).strip("-.") or "model"


def target_dir(args: argparse.Namespace) -> Path:
    if args.model_dir:
        return Path(args.model_dir).expanduser()
    try:
        settings, _ = resolve(args.config, {"state_dir": Path(args.state_dir) if args.state_dir else None})
    except ConfigError as exc:
        raise CliError(f"bad config: {exc}", EXIT_USAGE) from None
    if not settings.model_dirs:
        raise CliError("no model folder is configured: pass --model-dir DIR (or set [server] model_dirs)", EXIT_USAGE)
    return settings.model_dirs[0]


def cmd_import(args: argparse.Namespace) -> int:
    gguf = Path(args.gguf).expanduser()
    if not gguf.is_file():
        raise CliError(f"no such file: {gguf}", EXIT_USAGE)
    out = target_dir(args) / (args.name or default_name(gguf))
    argv = [sys.executable, "-m", "worker.mlx_engine.gguf_import", str(gguf), str(out)]
    argv += ["--force"] if args.force else []
    argv += ["--quantize", str(args.quantize)] if args.quantize else []
    return subprocess.run(argv).returncode


def add_import_parser(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("import", help="convert a GGUF file (llama, qwen2, qwen3) into an MLX model folder")
    m.add_argument("gguf", help="the .gguf file (Ollama's blobs and LM Studio's models folder hold them)")
    m.add_argument("--name", default=None, help="the model's name (default: the file's name without .gguf)")
    m.add_argument("--model-dir", default=None, help="the folder of model folders to write it to "
                   "(default: the first configured model_dirs)")
    m.add_argument("--config", default=None, help="TOML config file, for model_dirs (or MLXSUP_CONFIG)")
    m.add_argument("--state-dir", default=None, help="the daemon's state directory (for its config)")
    m.add_argument("--force", action="store_true", help="replace a model folder of that name")
    m.add_argument("--quantize", type=int, default=None, choices=[4, 8],
                   help="tensor types MLX cannot read as they are (K-quants, IQ*) are dequantized, then quantized "
                        "to this many bits (group size 64); default: kept in bf16. Q4_0, Q4_1, Q8_0, F16, BF16 and "
                        "F32 are converted without loss either way")
    m.set_defaults(func=cmd_import)
