"""An embedding model's engine: a BERT-family encoder (bert.py), pooled as its files say, normalised.

It is what worker/loop.py drives for a model whose files read as an embedder (protocol/modelkind.py): the
loop's EngineApi with an always empty generation batch (a chat request is refused with a message that says
this model embeds), plus `embed`, which the loop calls for an Embed between its turns. Invariants: the
vectors come back in the inputs' order, each normalised (after `dimensions` cuts it), whatever batches they
were computed in; inputs are packed by length, shortest first, into batches sized by time: as many padded
tokens as the measured speed computes in BATCH_TARGET_S (at most BATCH_TOKENS, at least one input), and
`between` (the loop's heartbeat) runs after each batch, so a long request shows the loop alive and is never
taken for a hung worker; an input over the window is refused naming its index, unless the request asked for
truncation.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from tokenizers import Tokenizer

from protocol.messages import CONTEXT_LENGTH_EXCEEDED, INVALID_REQUEST, Embed, Failed, Finished, Submit
from worker.engine_api import PromptCacheApi, RequestRejected
from worker.memory import process_memory_bytes
from worker.mlx_engine.bert import BertModel, load_bert
from worker.step_cost import StepPlan

log = logging.getLogger(__name__)

BATCH_TOKENS = 8192  # padded tokens per forward pass at most: bounds a batch's activations
BATCH_TARGET_S = 0.5  # a batch's target duration: heartbeats (1 s) keep coming, far inside the hang timeout
FIRST_BATCH_TOKENS = 256  # before any batch has been timed: small, on any device
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
    """Tokens one input may have: the position table, or less where sentence-transformers says so."""
    window = int(config["max_position_embeddings"])
    try:
        st = json.loads((path / "sentence_bert_config.json").read_text())
        window = min(window, int(st.get("max_seq_length") or window))
    except FileNotFoundError:
        pass
    return window


class Embedder:
    """The model, its tokenizer and pooling; `vectors` is the in-process computation the worker serves."""

    def __init__(self, path: Path) -> None:
        config = json.loads((path / "config.json").read_text())
        if config.get("model_type", "bert") != "bert":
            raise ValueError(f"unsupported encoder model_type {config.get('model_type')!r}: only BERT is served")
        self.pooling = pooling_of(path)
        self.window = window_of(path, config)
        weights: dict[str, mx.array] = {}
        for file in sorted(path.glob("*.safetensors")):
            weights.update(mx.load(str(file)))  # type: ignore[arg-type]
        self.model: BertModel = load_bert(weights, config)
        self.weights_bytes = sum(v.nbytes for v in weights.values())
        self.vocab_size = int(config["vocab_size"])
        self.pad_id = int(config.get("pad_token_id") or 0)
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.dim = self.model.config.hidden_size
        self.tokens_per_s: float | None = None  # measured on the last batch

    def encode(self, texts: list[str], limit: int | None = None) -> list[list[int]]:
        """Token ids with the model's special tokens; cut to `limit` (its specials kept) where given."""
        if limit is None:
            return [e.ids for e in self.tokenizer.encode_batch(texts)]
        self.tokenizer.enable_truncation(limit)
        try:
            return [e.ids for e in self.tokenizer.encode_batch(texts)]
        finally:
            self.tokenizer.no_truncation()

    def vectors(self, seqs: list[list[int]], dimensions: int | None = None,
                between: Callable[[], None] = lambda: None) -> list[list[float]]:
        """One normalised vector per sequence of ids, in order (see the module docstring for batching)."""
        out: list[list[float]] = [[] for _ in seqs]
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        start = 0
        while start < len(order):
            budget = self._budget()
            end = start + 1  # sorted by length: the last one taken is the longest, so it sets the padding
            while end < len(order) and len(seqs[order[end]]) * (end + 1 - start) <= budget:
                end += 1
            batch = [seqs[i] for i in order[start:end]]
            started = time.perf_counter()
            for i, vec in zip(order[start:end], self._batch(batch, dimensions)):
                out[i] = vec
            padded = len(batch) * max(len(s) for s in batch)
            self.tokens_per_s = padded / max(time.perf_counter() - started, 1e-6)
            start = end
            between()
        return out

    def _budget(self) -> int:
        """Padded tokens for the next batch: what the last batch's speed computes in BATCH_TARGET_S."""
        if self.tokens_per_s is None:
            return FIRST_BATCH_TOKENS
        return max(1, min(BATCH_TOKENS, int(self.tokens_per_s * BATCH_TARGET_S)))

    def _batch(self, batch: list[list[int]], dimensions: int | None) -> list[list[float]]:
        n = max(len(s) for s in batch)
        ids = mx.array([s + [self.pad_id] * (n - len(s)) for s in batch])
        mask = mx.array([[1] * len(s) + [0] * (n - len(s)) for s in batch])
        hidden = self.model(ids, mask).astype(mx.float32)
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            m = mask[:, :, None].astype(mx.float32)
            pooled = (hidden * m).sum(axis=1) / mx.maximum(m.sum(axis=1), 1e-9)
        pooled = _normalise(pooled)
        if dimensions is not None and dimensions < pooled.shape[1]:
            pooled = _normalise(pooled[:, :dimensions])  # Matryoshka: the leading components, unit length again
        result: list[list[float]] = pooled.tolist()  # type: ignore[assignment]
        return result


def _normalise(x: mx.array) -> mx.array:
    return x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


class EmbeddingEngine:
    """worker/engine_api.py's EngineApi for an embedder (no generation batch) and the `embed` the loop calls."""

    def __init__(self, model_path: Path, report: Callable[[str, float], None] = lambda stage, fraction: None) -> None:
        started = time.perf_counter()
        report("weights", 0.0)
        self.embedder = Embedder(model_path)
        report("weights", 1.0)
        self.context_length = self.embedder.window
        self.vocab_size = self.embedder.vocab_size
        self.weights_bytes = self.embedder.weights_bytes
        self.generated_tokens = 0
        self.peak_batch_size = 0
        self.prefill_batch_size = 1
        self.embedded_tokens = 0
        self.load_s = time.perf_counter() - started

    # --- embeddings ----------------------------------------------------------------------

    def embed(self, msg: Embed, between: Callable[[], None]) -> tuple[list[list[float]], int]:
        """The vectors of `msg`'s inputs and the tokens they took; RequestRejected for a bad input."""
        e = self.embedder
        if msg.dimensions is not None and not 0 < msg.dimensions <= e.dim:
            raise RequestRejected(INVALID_REQUEST, f"dimensions must be between 1 and {e.dim} for this model "
                                                   f"(got {msg.dimensions})")
        if msg.truncate is not None and msg.truncate < 0:
            raise RequestRejected(INVALID_REQUEST, "truncate must be 0 (the window) or a positive token count")
        limit = e.window if not msg.truncate else min(msg.truncate, e.window)
        texts = [(i, x) for i, x in enumerate(msg.inputs) if isinstance(x, str)]
        seqs: list[list[int]] = [x if isinstance(x, list) else [] for x in msg.inputs]
        for (i, _), ids in zip(texts, e.encode([t for _, t in texts], limit if msg.truncate is not None else None)):
            seqs[i] = ids
        for i, seq in enumerate(seqs):
            if not seq:
                raise RequestRejected(INVALID_REQUEST, f"input[{i}] is empty")
            if isinstance(msg.inputs[i], list) and not all(type(t) is int and 0 <= t < e.vocab_size for t in seq):
                raise RequestRejected(INVALID_REQUEST, f"input[{i}] holds a token id outside 0..{e.vocab_size - 1}")
            if len(seq) > limit:
                if msg.truncate is None:
                    raise RequestRejected(CONTEXT_LENGTH_EXCEEDED,
                                          f"input[{i}] has {len(seq)} tokens; this model's window is {e.window} "
                                          "(send truncate to cut it)")
                seqs[i] = seq[:limit]
        tokens = sum(len(s) for s in seqs)
        vectors = e.vectors(seqs, msg.dimensions, between)
        self.embedded_tokens += tokens
        return vectors, tokens

    # --- EngineApi: no generation ----------------------------------------------------------

    def _refuse(self) -> RequestRejected:
        return RequestRejected(INVALID_REQUEST, "this model is an embedding model: it serves /v1/embeddings, "
                                                "not chat or completions")

    @property
    def caches(self) -> PromptCacheApi | None:
        return None

    @property
    def rids(self) -> list[str]:
        return []

    def __len__(self) -> int:
        return 0

    def batch_size(self) -> int:
        return 0

    def waiting(self) -> int:
        return 0

    def submit(self, msg: Submit) -> None:
        raise self._refuse()

    def tokenize(self, msg: Submit) -> list[int]:
        raise self._refuse()

    def abort(self, rid: str) -> bool:
        return False

    def plan_step(self) -> StepPlan:
        return StepPlan(0, 0, 0, 0, 0.0, 0.0)

    def step(self) -> tuple[list[list], list[Finished | Failed]]:
        return [], []

    def fail_all(self, code: str, message: str) -> list[Failed]:
        return []

    def warm_step(self) -> bool:
        return False

    def close_caches(self) -> None:
        pass

    def settle(self) -> int:
        gc.collect()
        mx.clear_cache()
        return process_memory_bytes()
