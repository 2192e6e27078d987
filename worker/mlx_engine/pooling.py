"""What every embedding model's engine shares (embedder.py's encoders, decoder_pool.py's decoders): the pooling and
window a sentence-transformers folder names, and the vectors' last step, unit length after an optional Matryoshka cut.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from tokenizers import Tokenizer

POOLINGS = ("mean", "cls")


def pooling_of(path: Path) -> str:
    """The pooling the model's sentence-transformers config names (mean where it names none)."""
    try:
        config = json.loads((path / "1_Pooling" / "config.json").read_text())
    except FileNotFoundError:
        return "mean"
    if config.get("pooling_mode_cls_token"):
        return "cls"
    if config.get("pooling_mode_mean_tokens", True):
        return "mean"
    raise ValueError(f"unsupported pooling in {path / '1_Pooling' / 'config.json'}: only mean and CLS are served")


def window_of(path: Path, config: dict) -> int:
    """Tokens one input may have: the position table (less the padding_idx + 1 rows XLM-R's positions skip), or less
    where sentence-transformers says so."""
    window = int(config["max_position_embeddings"])
    if config.get("model_type") == "xlm-roberta":
        window -= int(config.get("pad_token_id", 1)) + 1
    try:
        st = json.loads((path / "sentence_bert_config.json").read_text())
        window = min(window, int(st.get("max_seq_length") or window))
    except FileNotFoundError:
        pass
    return window


def encode(tokenizer: Tokenizer, texts: list[str], limit: int | None) -> list[list[int]]:
    """Token ids with the model's special tokens (its post-processor's); cut to `limit`, its specials kept, where
    given. The tokenizer is left without truncation, as it was."""
    if limit is None:
        return [e.ids for e in tokenizer.encode_batch(texts)]
    tokenizer.enable_truncation(limit)
    try:
        return [e.ids for e in tokenizer.encode_batch(texts)]
    finally:
        tokenizer.no_truncation()


def unit_rows(pooled: mx.array, dimensions: int | None) -> list[list[float]]:
    """Each row at unit length; `dimensions` keeps the leading components and normalises again (Matryoshka)."""
    pooled = _normalise(pooled)
    if dimensions is not None and dimensions < pooled.shape[1]:
        pooled = _normalise(pooled[:, :dimensions])
    out: list[list[float]] = pooled.tolist()  # type: ignore[assignment]
    return out


def _normalise(x: mx.array) -> mx.array:
    return x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
