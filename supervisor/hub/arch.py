"""Which model architectures a worker can load, found without importing mlx or mlx-lm.

mlx-lm loads a `model_type` by importing `mlx_lm.models.<type>` after its MODEL_REMAPPING; so the
supported types are the module names in that folder (found with importlib.util.find_spec, which
imports nothing) and the remapping's keys (read from utils.py's source with ast); mlx-vlm's, for vision
models, the same way when it is installed. Encoder models (embeddings, rerankers: protocol/modelkind.py)
are served by the worker's own encoder and need no mlx-lm module; audio models (Whisper, Kokoro) by mlx-audio's
classes, when it is installed.
Invariant: when mlx-lm is not installed beside the supervisor, nothing is refused (None: unknown).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

from protocol.modelkind import ENCODER_ARCHITECTURES, audio_kind

ENCODER_PREFIXES = ("Bert", "XLMRoberta", "Roberta", "ModernBert", "NomicBert")


@functools.cache
def supported_types() -> frozenset[str] | None:
    """The model types of mlx-lm (and of mlx-vlm, for vision models, when it is installed); None without mlx-lm."""
    text = _package_types("mlx_lm")
    if text is None:
        return None
    return frozenset(text | (_package_types("mlx_vlm") or set()))


def _package_types(package: str) -> set[str] | None:
    """The module names in `package`/models and the keys of its utils.py MODEL_REMAPPING, read, not imported."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    types = {p.stem if p.is_file() else p.name for p in (root / "models").iterdir()
             if not p.name.startswith("_") and (p.suffix == ".py" or (p / "__init__.py").is_file())} \
        if (root / "models").is_dir() else set()
    try:
        tree = ast.parse((root / "utils.py").read_text())
    except (OSError, SyntaxError):
        return types
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MODEL_REMAPPING" for t in node.targets):
            try:
                types |= set(ast.literal_eval(node.value))
            except ValueError:
                pass
    return types


def unsupported(config: dict) -> str | None:
    """Why a worker cannot load the model of this config.json; None when it can (or this cannot be known)."""
    architectures = config.get("architectures") or []
    if isinstance(architectures, list) and any(isinstance(a, str) and (a in ENCODER_ARCHITECTURES or a.startswith(
            ENCODER_PREFIXES)) for a in architectures):  # the worker's own encoder serves these
        return None
    if audio_kind(config) is not None:  # Whisper, Kokoro: mlx-audio's classes serve them
        if _package_types("mlx_audio") is None and supported_types() is not None:
            return "it is an audio model (Whisper or Kokoro), served with mlx-audio, which is not installed"
        return None
    model_type = config.get("model_type")
    text = config.get("text_config")
    if not model_type and isinstance(text, dict):
        model_type = text.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        return "its config.json names no model_type"
    types = supported_types()
    if types is None or model_type in types:
        return None
    return f"its architecture (model_type '{model_type}') is not one mlx-lm has"
