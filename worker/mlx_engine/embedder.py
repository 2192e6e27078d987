"""An encoder embedding model (BERT, XLM-RoBERTa, ModernBERT: encoders.py) pooled as its files say, normalised; and
`load_engine`, which builds the embedding engine (worker/embedding_engine.py) for any embedding or rerank model.

`Embedder` is a scorer as the engine drives it: `encode` texts to ids, `forward` a padded batch of id lists to
unit vectors. `vectors` is the in-process computation the worker serves (the same queue and batches, one
request): what tests and the bench compare the daemon's answers with. Invariant: a sequence's vector does not
depend on what it was batched with beyond float rounding (the attention mask hides padding).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from tokenizers import Tokenizer

from protocol.modelkind import RERANK, is_decoder, model_kind
from worker.embedding_engine import EmbeddingEngine, Reranker, TextEmbedder, run_alone
from worker.mlx_engine.encoders import Encoder, load_encoder
from worker.mlx_engine.pooling import encode, pooling_of, unit_rows, window_of
from worker.mlx_engine.release import release

log = logging.getLogger(__name__)

CACHE_LIMIT_BYTES = 1 << 30  # MLX's buffer cache in an embedding worker: a few batches' activations

class Embedder:
    """The model, its tokenizer and pooling; `vectors` is the in-process computation the worker serves."""

    def __init__(self, path: Path) -> None:
        config = json.loads((path / "config.json").read_text())
        self.pooling = pooling_of(path)
        self.window = window_of(path, config)
        weights: dict[str, mx.array] = {}
        for file in sorted(path.glob("*.safetensors")):
            weights.update(mx.load(str(file)))  # type: ignore[arg-type]
        self.model: Encoder = load_encoder(config, weights)
        self.weights_bytes = sum(v.nbytes for v in weights.values())
        self.vocab_size = int(config["vocab_size"])
        self.pad_id = int(config.get("pad_token_id") or 0)
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.dim = int(config["hidden_size"])
        self.tokens_per_s: float | None = None  # measured on the last batch

    def encode(self, texts: list[str], limit: int | None = None) -> list[list[int]]:
        """Token ids with the model's special tokens; cut to `limit` (its specials kept) where given."""
        return encode(self.tokenizer, texts, limit)

    def vectors(self, seqs: list[list[int]], dimensions: int | None = None,
                between: Callable[[], None] = lambda: None) -> list[list[float]]:
        """One unit vector per sequence of ids, in order, batched as the worker batches them; `between` runs
        after each batch."""
        return run_alone(self, seqs, dimensions, between)

    def forward(self, batch: list[list[int]], dimensions: int | None) -> list[list[float]]:
        """A unit vector per id list (padded to the longest, masked), cut to `dimensions` and normalised again."""
        n = max(len(s) for s in batch)
        ids = mx.array([s + [self.pad_id] * (n - len(s)) for s in batch])
        mask = mx.array([[1] * len(s) + [0] * (n - len(s)) for s in batch])
        hidden = self.model(ids, mask).astype(mx.float32)
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            m = mask[:, :, None].astype(mx.float32)
            pooled = (hidden * m).sum(axis=1) / mx.maximum(m.sum(axis=1), 1e-9)
        return unit_rows(pooled, dimensions)


def prompts_of(path: Path) -> dict[str, str]:
    """The model's sentence-transformers prompts by name ("query", "document", ...; none where it names none)."""
    try:
        config = json.loads((path / "config_sentence_transformers.json").read_text())
    except FileNotFoundError:
        return {}
    prompts = config.get("prompts") if isinstance(config, dict) else None
    return {k: v for k, v in prompts.items() if isinstance(v, str)} if isinstance(prompts, dict) else {}


def load_engine(path: Path, report: Callable[[str, float], None] = lambda stage, fraction: None) -> EmbeddingEngine:
    """The engine of the embedding or rerank model in `path`: a decoder's on mlx-lm's classes
    (worker/mlx_engine/decoder_pool.py), an encoder's on encoders.py's."""
    started = time.perf_counter()
    report("weights", 0.0)
    model: TextEmbedder | Reranker
    if is_decoder(path):
        from worker.mlx_engine.decoder_pool import DecoderEmbedder, DecoderReranker

        model = DecoderReranker(path) if model_kind(path) == RERANK else DecoderEmbedder(path)
    elif model_kind(path) == RERANK:
        raise ValueError(f"{path}: encoder rerankers (cross-encoders) are not served yet")
    else:
        model = Embedder(path)
    report("weights", 1.0)
    # MLX keeps freed buffers for reuse up to the device's memory by default: batches of ever new shapes would
    # grow that cache until another process on the device (a second worker) runs out of memory
    mx.set_cache_limit(CACHE_LIMIT_BYTES)
    weights = int(getattr(model, "weights_bytes", 0)) or sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return EmbeddingEngine(model, prompts_of(path), weights_bytes=weights, load_s=time.perf_counter() - started,
                           release=mx.clear_cache, unload=release)
