"""The decoder embedder and reranker (worker/mlx_engine/decoder_pool.py) against the computation their model cards
describe, done by hand here on mlx-lm's own model and Hugging Face's tokenizer (`mlx_lm.load`), one sequence at a
time, unpadded: a batch of inputs of different lengths must give each input exactly what it gives alone.

Real MLX on the CPU, in process, on `make-model`'s tiny qwen3-embedding and qwen3-reranker.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from worker.mlx_engine.decoder_pool import (
    RERANK_INSTRUCTION,
    RERANK_PREFIX,
    RERANK_SUFFIX,
    DecoderEmbedder,
    DecoderReranker,
)
from worker.mlx_engine.make_model import make_model
from worker.mlx_engine.make_model.qwen3_pool import QUERY_PROMPT

TEXTS = ["a", "Héllo wörld, 日本語 😀", "short one", " ".join(["syllable words and numbers 12345"] * 12),
         "def f(x):\n\treturn x+1", " ".join(["padding never reaches an earlier row"] * 4)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pool-models")
    make_model(root / "embedding", "tiny", seed=0, arch="qwen3-embedding")
    make_model(root / "reranker", "tiny", seed=1, arch="qwen3-reranker")
    return root


@pytest.fixture(scope="module")
def reference(models: Path) -> dict[str, Any]:
    """mlx-lm's model and Hugging Face's tokenizer for each made model: the hand computation's tools."""
    return {name: load(str(models / name)) for name in ("embedding", "reranker")}


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x)


def _alone(model: Any, ids: list[int]) -> mx.array:
    """mlx-lm's final (normed) hidden states of one unpadded sequence."""
    return model.model(mx.array([ids]))[0].astype(mx.float32)


def test_embedder_tokenizes_as_hugging_face_with_the_endoftext_it_pools(models: Path, reference: dict) -> None:
    e = DecoderEmbedder(models / "embedding")
    _, tok = reference["embedding"]
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    texts = [QUERY_PROMPT + t for t in TEXTS[:3]] + TEXTS[3:]
    ids = e.encode(texts)
    assert ids == [tok.encode(t) for t in texts]  # Qwen3-Embedding's tokenizer appends <|endoftext|> itself
    assert all(seq[-1] == eot for seq in ids)
    cut = e.encode([TEXTS[3]], limit=10)[0]
    assert len(cut) == 10 and cut[-1] == eot and cut[:9] == ids[3][:9]


def test_a_batch_of_different_lengths_gives_each_input_its_vector_alone(models: Path, reference: dict) -> None:
    e = DecoderEmbedder(models / "embedding")
    model, tok = reference["embedding"]
    assert (e.dim, e.window, e.vocab_size) == (64, 512, len(tok.get_vocab()))
    seqs = e.encode(TEXTS) + [[5, 6, 7]]  # token ids are used as given
    assert len({len(s) for s in seqs}) == len(seqs)  # every row padded differently but the longest
    expected = np.array([_unit(np.array(_alone(model, s)[-1])) for s in seqs])
    got = np.array(e.forward(seqs, None))
    np.testing.assert_allclose(got, expected, atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    cut = np.array(e.forward(seqs, 16))  # Matryoshka: the leading components, unit length again
    np.testing.assert_allclose(cut, np.array([_unit(v[:16]) for v in expected]), atol=2e-5)


def test_reranker_prompt_and_scores_are_the_model_cards(models: Path, reference: dict) -> None:
    r = DecoderReranker(models / "reranker")
    model, tok = reference["reranker"]
    query, docs = "what is the capital?", TEXTS
    ids = r.pairs(query, docs)
    # the model card's process_inputs: prefix + the formatted pair + suffix, no special tokens added
    card = [tok.encode(RERANK_PREFIX, add_special_tokens=False)
            + tok.encode(f"<Instruct>: {RERANK_INSTRUCTION}\n<Query>: {query}\n<Document>: {d}", add_special_tokens=False)
            + tok.encode(RERANK_SUFFIX, add_special_tokens=False) for d in docs]
    assert ids == card
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    expected = []
    for seq in ids:  # the model card's compute_logits, one pair at a time: log_softmax over [no, yes], exp
        last = np.array(model(mx.array([seq]))[0, -1].astype(mx.float32))
        expected.append(float(np.exp(last[yes]) / (np.exp(last[no]) + np.exp(last[yes]))))
    got = r.forward(ids, None)
    assert all(len(row) == 1 for row in got) and r.dim is None
    np.testing.assert_allclose([row[0] for row in got], expected, atol=2e-5)
    assert len({round(s, 4) for s in expected}) > 1  # the documents are told apart: the scores are not all one
    other = r.pairs(query, docs[:1], instruction="Find code")
    assert tok.decode(other[0]).count("<Instruct>: Find code\n") == 1


def test_reranker_cuts_the_document_never_the_query(models: Path, reference: dict) -> None:
    r = DecoderReranker(models / "reranker")
    _, tok = reference["reranker"]
    query, doc = "which one?", TEXTS[3]
    full = r.pairs(query, [doc])[0]
    limit = len(full) - 20
    cut = r.pairs(query, [doc], limit)[0]
    assert len(cut) == limit and cut[:limit - len(r.suffix)] == full[:limit - len(r.suffix)]
    assert cut[-len(r.suffix):] == r.suffix
    text = tok.decode(cut)
    assert f"<Query>: {query}\n<Document>: " in text and text.endswith(RERANK_SUFFIX)
    frame = len(r.prefix) + len(r.suffix)
    long_query = " ".join(["zebra"] * 100)
    over = r.pairs(long_query, ["doc"], frame + 50)[0]
    assert len(over) > frame + 50  # the query is never cut: the pair comes back over, for the engine to refuse
    assert f"<Query>: {long_query}\n<Document>:" in tok.decode(over)


def test_a_bare_backbone_checkpoint_loads_as_qwen3_embedding_ships_it(models: Path, tmp_path: Path) -> None:
    """The real repo stores Qwen3Model's weights (`layers.0...`, no `model.` prefix): the same vectors."""
    bare = tmp_path / "bare"
    shutil.copytree(models / "embedding", bare)
    for index in bare.glob("*.index.json"):
        index.unlink()
    weights = mx.load(str(bare / "model.safetensors"))
    assert isinstance(weights, dict) and all(k.startswith("model.") for k in weights)
    mx.save_safetensors(str(bare / "model.safetensors"), {k.removeprefix("model."): v for k, v in weights.items()})
    seqs = [[1, 2, 3], [4, 5, 6, 7, 8]]
    np.testing.assert_allclose(DecoderEmbedder(bare).forward(seqs, None),
                               DecoderEmbedder(models / "embedding").forward(seqs, None), atol=1e-6)
