"""What kind of model a folder holds, read from its files alone: the supervisor's registry and the worker's entry
both ask, so the kind a status shows and the engine a worker builds cannot disagree.

Kinds: "rerank" (a model that scores a query-document pair: a `*ForSequenceClassification` architecture, or a
folder or a config.json `_name_or_path` that names a reranker; in a hub cache, the repo's folder, not the snapshot's), "embedding" (a model whose pooled hidden states are
the output: a sentence-transformers folder, with `modules.json` or `1_Pooling/config.json`, whatever its
architecture, so a decoder with last-token pooling is one too; or a config.json naming an encoder architecture)
"vision" (a generating decoder with a vision tower: config.json's `vision_config` and a preprocessor_config.json,
served by mlx-vlm's classes, text-only requests included), "stt" (speech to text: a Whisper checkpoint, config.json's
model_type "whisper" or a Whisper architecture), "tts" (text to speech: a Kokoro checkpoint, config.json with Kokoro's
`istftnet` and `plbert` sections) and "chat" (all else: a generating decoder, mlx-lm's). Rerank is asked first: a reranker's folder may carry
sentence-transformers files too. Pure file reads, no MLX; an unreadable config reads as "chat", whose loader then
says what is wrong. `is_decoder` says which engine a worker builds for an embedding or rerank model.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT = "chat"
EMBEDDING = "embedding"
RERANK = "rerank"
VISION = "vision"  # a chat model that also reads images: config.json's `vision_config` and the processor's files
STT = "stt"  # speech to text (Whisper): /v1/audio/transcriptions and /v1/audio/translations
TTS = "tts"  # text to speech (Kokoro): /v1/audio/speech
MODEL_KINDS = (CHAT, EMBEDDING, RERANK, VISION, STT, TTS)
AUDIO_KINDS = (STT, TTS)

# config.json architectures that are encoders without a generating head (Hugging Face's class names)
ENCODER_ARCHITECTURES = frozenset({"BertModel", "XLMRobertaModel", "RobertaModel", "ModernBertModel",
                                   "NomicBertModel", "NewModel"})
ENCODER_TYPES = frozenset({"bert", "xlm-roberta", "roberta", "modernbert", "nomic_bert", "new"})
RERANKER_WORD = "rerank"  # in a folder's name or a config's _name_or_path: Qwen3-Reranker, bge-reranker, ...


def _config(path: Path) -> dict:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _architectures(config: dict) -> list[str]:
    found = config.get("architectures")
    return [a for a in found if isinstance(a, str)] if isinstance(found, list) else []


def model_kind(path: Path) -> str:
    """The kind of the model in `path` (see the module docstring)."""
    config = _config(path)
    folder = path.parent.parent.name if path.parent.name == "snapshots" else path.name  # a hub cache's repo folder
    named = f"{folder} {config.get('_name_or_path', '')}".lower()
    if RERANKER_WORD in named or any(a.endswith("ForSequenceClassification") for a in _architectures(config)):
        return RERANK
    if (path / "modules.json").is_file() or (path / "1_Pooling" / "config.json").is_file():
        return EMBEDDING
    if any(a in ENCODER_ARCHITECTURES for a in _architectures(config)):
        return EMBEDDING
    if isinstance(config.get("vision_config"), dict) and (path / "preprocessor_config.json").is_file():
        return VISION
    return audio_kind(config) or CHAT


def audio_kind(config: dict) -> str | None:
    """STT or TTS for an audio model's config.json (see the module docstring), else None."""
    if config.get("model_type") == "whisper" or any(a.startswith("Whisper") for a in _architectures(config)):
        return STT
    if isinstance(config.get("istftnet"), dict) and isinstance(config.get("plbert"), dict):
        return TTS
    return None


def is_decoder(path: Path) -> bool:
    """An embedding or rerank model built on a generating decoder (mlx-lm's classes), not on an encoder."""
    config = _config(path)
    architectures = _architectures(config)
    if any(a in ENCODER_ARCHITECTURES or a.startswith(("Bert", "XLMRoberta", "Roberta", "ModernBert"))
           for a in architectures):
        return False
    return config.get("model_type") not in ENCODER_TYPES


def is_dflash(path: Path) -> bool:
    """A DFlash drafter's folder (worker/mlx_engine/dflash.py): its config names a block size or a dflash_config."""
    config = _config(path)
    return bool(config.get("dflash_config")) or "block_size" in config
