"""`make-model --arch qwen3-embedding | qwen3-reranker | bert`: the files the real repos ship (Qwen3-Embedding-0.6B,
Qwen3-Reranker-0.6B, all-MiniLM-L6-v2), read back by the libraries that read the real ones: Hugging Face's
tokenizers, mlx-lm, bert.py, protocol/modelkind.py. Real MLX on the CPU, in process, tiny presets.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlx_lm import load

from protocol.modelkind import EMBEDDING, RERANK, is_decoder, model_kind
from worker.mlx_engine.make_model import FAMILIES, make_model
from worker.mlx_engine.make_model.qwen3_pool import QUERY_PROMPT

ST_FILES = ["modules.json", "1_Pooling/config.json", "sentence_bert_config.json", "config_sentence_transformers.json"]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("made-pool")
    for arch in ("qwen3-embedding", "qwen3-reranker", "bert"):
        make_model(root / arch, "tiny", seed=0, arch=arch)
    return root


def _json(path: Path) -> dict:
    return dict(json.loads(path.read_text()))


def test_qwen3_embedding_ships_last_token_pooling_prompts_and_an_eos_appending_tokenizer(made: Path) -> None:
    path = made / "qwen3-embedding"
    assert all((path / f).is_file() for f in ST_FILES)
    assert [m["path"] for m in json.loads((path / "modules.json").read_text())] == ["", "1_Pooling", "2_Normalize"]
    pooling = _json(path / "1_Pooling" / "config.json")
    assert pooling["pooling_mode_lasttoken"] and not pooling["pooling_mode_mean_tokens"]
    assert _json(path / "config_sentence_transformers.json")["prompts"] == {"query": QUERY_PROMPT, "document": ""}
    assert _json(path / "tokenizer_config.json")["padding_side"] == "left"
    config = _json(path / "config.json")
    assert (config["model_type"], config["architectures"]) == ("qwen3", ["Qwen3ForCausalLM"])
    assert (model_kind(path), is_decoder(path)) == (EMBEDDING, True)
    tok = load(str(path))[1]  # mlx-lm and Hugging Face read it as the real repo
    ids = tok.encode("hello world")
    assert ids[-1] == tok.convert_tokens_to_ids("<|endoftext|>") and ids[:-1] == tok.encode(
        "hello world", add_special_tokens=False)


def test_qwen3_reranker_has_single_yes_and_no_tokens_and_says_it_reranks(made: Path) -> None:
    path = made / "qwen3-reranker"
    assert not any((path / f).exists() for f in ST_FILES)  # the real repo ships the decoder alone
    config = _json(path / "config.json")
    assert config["classifier_from_token"] == ["no", "yes"] and config["is_original_qwen3_reranker"] is True
    assert "Reranker" in config["_name_or_path"]
    assert (model_kind(path), is_decoder(path)) == (RERANK, True)
    tok = load(str(path))[1]
    for word in ("yes", "no"):
        assert tok.encode(word, add_special_tokens=False) == [tok.convert_tokens_to_ids(word)]
    assert tok.encode("hello", add_special_tokens=True) == tok.encode("hello", add_special_tokens=False)


def test_bert_loads_in_bert_py_and_tokenizes_as_hugging_face_bert(made: Path) -> None:
    from transformers import AutoTokenizer

    from worker.mlx_engine.embedder import Embedder

    path = made / "bert"
    assert all((path / f).is_file() for f in [*ST_FILES, "vocab.txt", "model.safetensors", "tokenizer.json"])
    config = _json(path / "config.json")
    assert (config["architectures"], config["model_type"], config["pad_token_id"]) == (["BertModel"], "bert", 0)
    assert (model_kind(path), is_decoder(path)) == (EMBEDDING, False)
    e = Embedder(path)  # bert.py, strict: every weight under Hugging Face's name, the pooler dropped
    assert (e.pooling, e.window, e.dim) == ("mean", 128, 64)
    hf = AutoTokenizer.from_pretrained(str(path))
    text = "Hello World, déjà vu 12345!"
    ids = e.encode([text])[0]
    assert ids == hf(text)["input_ids"]
    assert (ids[0], ids[-1]) == (hf.cls_token_id, hf.sep_token_id) and e.encode(["HELLO"]) == e.encode(["hello"])
    assert len((path / "vocab.txt").read_text().splitlines()) == config["vocab_size"]
    vectors = e.vectors(e.encode(["one", "two words"]))
    assert len(vectors) == 2 and all(len(v) == 64 for v in vectors)


def test_bert_refuses_quantize(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unquantized"):
        make_model(tmp_path / "q", "tiny", arch="bert", quantize=4)
    assert {"qwen3-embedding", "qwen3-reranker", "bert"} <= set(FAMILIES)
