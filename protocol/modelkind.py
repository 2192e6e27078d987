"""What kind of model a folder holds, read from its files alone: the supervisor's registry and the worker's entry
both ask, so the kind a status shows and the engine a worker builds cannot disagree.

Kinds: "embedding" (an encoder whose pooled hidden states are the output: a sentence-transformers folder, with
`modules.json` or `1_Pooling/config.json`, or a config.json naming an encoder architecture) and "chat" (all else:
a generating decoder, mlx-lm's). Pure file reads, no MLX; an unreadable config reads as "chat", whose loader
then says what is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT = "chat"
EMBEDDING = "embedding"
MODEL_KINDS = (CHAT, EMBEDDING)

# config.json architectures that are encoders without a generating head (Hugging Face's class names)
ENCODER_ARCHITECTURES = frozenset({"BertModel", "XLMRobertaModel", "RobertaModel", "ModernBertModel",
                                   "NomicBertModel", "NewModel"})


def model_kind(path: Path) -> str:
    """The kind of the model in `path` (see the module docstring)."""
    if (path / "modules.json").is_file() or (path / "1_Pooling" / "config.json").is_file():
        return EMBEDDING
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return CHAT
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if isinstance(architectures, list) and any(a in ENCODER_ARCHITECTURES for a in architectures):
        return EMBEDDING
    return CHAT
