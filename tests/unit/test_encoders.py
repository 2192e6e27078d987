"""The XLM-RoBERTa and ModernBERT encoders (worker/mlx_engine/encoders.py on mlx-vlm's classes) on make-model's tiny
folders, real MLX on CPU: a batch of inputs of different lengths gives each input the vector it gets alone, equal
to transformers' own XLMRobertaModel / ModernBertModel on the same folder (where torch is installed), pooled by CLS
or mean as 1_Pooling/config.json says; the folders read as embedding models; BERT loads without mlx-vlm. The two
families skip, saying so, where mlx-vlm is not installed (the test command installs it with --no-deps)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from protocol.modelkind import EMBEDDING, is_decoder, model_kind
from worker.mlx_engine.embedder import Embedder
from worker.mlx_engine.make_model import make_model

ARCHES = ("xlm-roberta", "modernbert")
needs_mlx_vlm = pytest.mark.skipif(importlib.util.find_spec("mlx_vlm") is None,
                                   reason="XLM-RoBERTa and ModernBERT run on mlx-vlm's classes: pip install --no-deps "
                                          "mlx-vlm==0.7.10")
POOLING = {"xlm-roberta": "cls", "modernbert": "mean"}  # bge-m3's and modernbert-embed's files
# lengths from 3 to ~100 tokens: past ModernBERT tiny's local window (8), so both its attentions are exercised
TEXTS = ["hi", "Hello wörld, 日本語 and a longer sentence that goes on past the local window of the encoder",
         "short one here", "Ünïcödé, emoji 🙂 and digits 12345 " * 4]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("encoders")
    for arch in (*ARCHES, "bert"):
        make_model(root / arch, arch=arch)
    return {arch: root / arch for arch in (*ARCHES, "bert")}


@pytest.fixture(scope="module")
def embedders(folders: dict[str, Path]) -> dict[str, Embedder]:
    return {arch: Embedder(folders[arch]) for arch in ARCHES}


def _pooled(hidden: np.ndarray, mask: np.ndarray, pooling: str) -> np.ndarray:
    if pooling == "cls":
        rows = hidden[:, 0]
    else:
        rows = (hidden * mask[:, :, None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def _padded(seqs: list[list[int]], pad: int) -> tuple[np.ndarray, np.ndarray]:
    n = max(map(len, seqs))
    return (np.array([s + [pad] * (n - len(s)) for s in seqs]),
            np.array([[1] * len(s) + [0] * (n - len(s)) for s in seqs], dtype=np.float64))


@needs_mlx_vlm
@pytest.mark.parametrize("arch", ARCHES)
def test_a_batch_gives_each_input_the_vector_it_gets_alone(embedders: dict[str, Embedder], arch: str) -> None:
    e = embedders[arch]
    seqs = e.encode(TEXTS)
    assert len({len(s) for s in seqs}) == len(seqs) and max(map(len, seqs)) > 3 * min(map(len, seqs))
    batched = np.array(e.forward(seqs, None))
    alone = np.array([e.forward([s], None)[0] for s in seqs])
    np.testing.assert_allclose(batched, alone, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-6)
    assert np.abs(batched @ batched.T - np.eye(len(seqs))).max() > 1e-3  # distinct inputs, distinct vectors


@needs_mlx_vlm
@pytest.mark.parametrize("arch", ARCHES)
def test_the_vectors_equal_transformers_model_on_the_same_folder(folders: dict[str, Path],
                                                                  embedders: dict[str, Embedder], arch: str) -> None:
    """Catches: mlx-vlm's ModernBERT MLP on the tanh GELU where the config says exact (vectors off by ~7e-5), and
    any position, mask or pooling that is not transformers'. torch is a reference here only, never a dependency."""
    torch = pytest.importorskip("torch", reason="transformers' reference models need torch (pip install torch)")
    from transformers import AutoModel

    e = embedders[arch]
    seqs = e.encode(TEXTS)
    ids, mask = _padded(seqs, e.pad_id)
    model = AutoModel.from_pretrained(str(folders[arch]), attn_implementation="eager").eval()
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask, dtype=torch.long))
    want = _pooled(hidden.last_hidden_state.double().numpy(), mask, POOLING[arch])
    np.testing.assert_allclose(np.array(e.forward(seqs, None)), want, atol=5e-6)


@needs_mlx_vlm
@pytest.mark.parametrize("arch", ARCHES)
def test_pooling_is_the_one_1_pooling_names(folders: dict[str, Path], embedders: dict[str, Embedder], arch: str,
                                            tmp_path: Path) -> None:
    """The made folder pools as its real repo does; the same weights with the other pooling configured pool that
    way: each checked against the pooling computed by hand from the encoder's hidden states."""
    import mlx.core as mx

    flipped = tmp_path / arch
    shutil.copytree(folders[arch], flipped)
    other = "mean" if POOLING[arch] == "cls" else "cls"
    config = json.loads((flipped / "1_Pooling" / "config.json").read_text())
    config.update(pooling_mode_cls_token=other == "cls", pooling_mode_mean_tokens=other == "mean")
    (flipped / "1_Pooling" / "config.json").write_text(json.dumps(config))

    e = embedders[arch]
    seqs = e.encode(TEXTS)
    ids, mask = _padded(seqs, e.pad_id)
    hidden = np.array(e.model(mx.array(ids), mx.array(mask.astype(np.int32))).astype(mx.float32))
    for embedder, pooling in ((e, POOLING[arch]), (Embedder(flipped), other)):
        assert embedder.pooling == pooling
        np.testing.assert_allclose(np.array(embedder.forward(seqs, None)), _pooled(hidden, mask, pooling), atol=1e-5)


@pytest.mark.parametrize("arch", ARCHES)
def test_the_made_folder_reads_as_an_encoder_embedding_model(folders: dict[str, Path], arch: str) -> None:
    path = folders[arch]
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [{"xlm-roberta": "XLMRobertaModel", "modernbert": "ModernBertModel"}[arch]]
    assert model_kind(path) == EMBEDDING and not is_decoder(path)
    for name in ("tokenizer.json", "modules.json", "1_Pooling/config.json", "sentence_bert_config.json"):
        assert (path / name).is_file(), name
    model = json.loads((path / "tokenizer.json").read_text())["model"]["type"]
    assert model == {"xlm-roberta": "Unigram", "modernbert": "BPE"}[arch]


@needs_mlx_vlm
def test_xlm_roberta_window_leaves_out_the_positions_padding_skips(folders: dict[str, Path], tmp_path: Path) -> None:
    """Catches: a window of max_position_embeddings (514) where XLM-R's positions start at padding_idx + 1, so a
    514-token input would index past the position table (MLX gathers garbage there, it raises nothing)."""
    bare = tmp_path / "bare"
    shutil.copytree(folders["xlm-roberta"], bare)
    (bare / "sentence_bert_config.json").unlink()  # the window from config.json alone
    e = Embedder(bare)
    assert e.window == json.loads((bare / "config.json").read_text())["max_position_embeddings"] - 2 == 512
    vec = np.array(e.forward([[0] + [5] * (e.window - 2) + [2]], None))
    assert np.isfinite(vec).all()


def test_bert_loads_without_mlx_vlm_and_the_others_say_they_need_it(folders: dict[str, Path],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "mlx_vlm" or m.startswith("mlx_vlm.")]:
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError, as where mlx-vlm is absent
    monkeypatch.setitem(sys.modules, "mlx_vlm", None)
    assert len(Embedder(folders["bert"]).forward([[2, 7, 3]], None)[0]) == 64
    with pytest.raises(ValueError, match="mlx-vlm"):
        Embedder(folders["xlm-roberta"])
