"""Decoder models that answer with one number per input instead of text: a last-token embedder (Qwen3-Embedding
style) and a yes/no reranker (Qwen3-Reranker style), both on mlx-lm's own model classes, so every family mlx-lm
builds can serve as either.

They are Scorers as worker/embedding_engine.py drives them (`window`, `vocab_size`, `dim`, `tokens_per_s`,
`weights_bytes`; `encode` / `pairs` to token ids; `forward` of one batch); the engine adds the instruction
prompts, checks windows and measures speed. Invariants: a batch is padded on the RIGHT and each row read at its
own last real position; attention is causal, so padding after a row's end never reaches it, and a row's output is
what the model computes on that row alone (to float rounding), whatever it was batched with. Vectors are unit
length, after a `dimensions` cut too; a score is P("yes") of the softmax over the "no" and "yes" logits of the
model's lm_head or tied embedding (a family that post-processes its logits, as Gemma's softcap, is read before
that step).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, load_model
from tokenizers import Tokenizer

from worker.mlx_engine.pooling import encode, unit_rows, window_of

# Qwen3-Reranker's documented prompt (its model card): a system turn, the pair, an assistant turn with the empty
# think block, after which the next token is "yes" or "no".
RERANK_PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the '
                 'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def _classes(config: dict) -> tuple[type, type]:
    """mlx-lm's model classes for `config`, also reading a bare backbone's checkpoint: Qwen3-Embedding ships the
    weights of Qwen3Model (`layers.0...`, no `model.` prefix, no head), not of Qwen3ForCausalLM."""
    model_class, args_class = _get_classes(config)

    class Pooled(model_class):  # type: ignore[misc, valid-type]
        def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
            if "embed_tokens.weight" in weights:
                weights = {f"model.{k}": v for k, v in weights.items()}
                if "lm_head" in self:  # an untied model stored without its head: only the embedder reads these
                    self.pop("lm_head")
            return super().sanitize(weights) if hasattr(model_class, "sanitize") else weights

    return Pooled, args_class


class _Decoder:
    """The loaded model split as pooling needs it: `backbone` (ids -> final normed hidden states) and `head`."""

    def __init__(self, path: Path) -> None:
        model, config = load_model(path, get_model_classes=_classes)
        model.eval()
        lm: Any = getattr(model, "language_model", model)  # a multimodal wrapper keeps the text model inside
        self.backbone: nn.Module = lm.model
        self.head: Any = lm.lm_head if "lm_head" in lm else self.backbone.embed_tokens.as_linear
        self.config = config
        self.window = window_of(path, config.get("text_config") or config)
        self.vocab_size = int((config.get("text_config") or config)["vocab_size"])
        self.weights_bytes = sum(cast(mx.array, kv[1]).nbytes for kv in tree_flatten(model.parameters()))
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.tokens_per_s: float | None = None  # the engine's measure of the last batch

    def last_hidden(self, batch: list[list[int]]) -> mx.array:
        """Each row's final hidden state at its last real token, [rows, hidden] in float32 (right padding)."""
        n = max(len(s) for s in batch)
        ids = mx.array([s + [0] * (n - len(s)) for s in batch])  # any id: causal attention never looks ahead
        hidden = self.backbone(ids)
        return hidden[mx.arange(len(batch)), mx.array([len(s) - 1 for s in batch])].astype(mx.float32)


class DecoderEmbedder(_Decoder):
    """Last-token pooling, unit length (the instruction prompts are the engine's: worker/embedding_engine.py)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        pooling = _read(path / "1_Pooling" / "config.json")
        if pooling and not pooling.get("pooling_mode_lasttoken"):
            raise ValueError(f"unsupported pooling in {path / '1_Pooling' / 'config.json'}: a decoder embedder "
                             "is served with last-token pooling only")
        self.dim: int | None = int((self.config.get("text_config") or self.config)["hidden_size"])

    def encode(self, texts: list[str], limit: int | None = None) -> list[list[int]]:
        """Token ids, EOS appended by the tokenizer's post-processor as the model was trained (the pooled token);
        cut to `limit` where given, the text's end cut and the EOS kept."""
        return encode(self.tokenizer, texts, limit)

    def forward(self, batch: list[list[int]], dimensions: int | None = None) -> list[list[float]]:
        """One unit vector per row, in order; `dimensions` keeps the leading components (Matryoshka), renormed."""
        return unit_rows(self.last_hidden(batch), dimensions)


class DecoderReranker(_Decoder):
    """P("yes") of Qwen3-Reranker's prompt; the instruction is the model card's unless a request gives one."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.dim = None
        # vLLM's reading of a Qwen3 reranker names the two tokens in config.json; the model card's otherwise
        no, yes = self.config.get("classifier_from_token") or ("no", "yes")
        ids = [self.tokenizer.token_to_id(t) for t in (no, yes)]
        if None in ids:
            raise ValueError(f"the tokenizer has no single token for {no!r} and {yes!r}: not a yes/no reranker")
        self.no_yes = mx.array(ids)
        self.prefix = self.tokenizer.encode(RERANK_PREFIX, add_special_tokens=False).ids
        self.suffix = self.tokenizer.encode(RERANK_SUFFIX, add_special_tokens=False).ids

    def pairs(self, query: str, docs: list[str], limit: int | None = None,
              instruction: str | None = None) -> list[list[int]]:
        """One prompt's ids per document, the pair tokenized as one text as the model card does. Cut to `limit`
        tokens where given by cutting the document's end, never the instruction or the query: a pair whose
        query part alone leaves no room comes back over `limit`, for the caller to refuse."""
        head = f"<Instruct>: {instruction or RERANK_INSTRUCTION}\n<Query>: {query}\n<Document>: "
        room = None if limit is None else limit - len(self.prefix) - len(self.suffix)
        out = []
        for e in self.tokenizer.encode_batch([head + d for d in docs], add_special_tokens=False):
            ids = e.ids
            if room is not None and len(ids) > room:
                # a token that reaches past the head holds document text (" doc" takes the head's last space)
                ids = ids[:max(room, sum(1 for _, end in e.offsets if end <= len(head)))]
            out.append(self.prefix + ids + self.suffix)
        return out

    def forward(self, batch: list[list[int]], dimensions: int | None = None) -> list[list[float]]:
        """[P(yes)] per row, in order."""
        if dimensions is not None:
            raise ValueError("a reranker has no dimensions")
        logits = self.head(self.last_hidden(batch)).astype(mx.float32)
        scores: list[float] = mx.softmax(logits[:, self.no_yes], axis=-1)[:, 1].tolist()  # type: ignore[assignment]
        return [[s] for s in scores]


def _read(path: Path) -> dict:
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return {}
