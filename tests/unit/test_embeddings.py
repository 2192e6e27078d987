"""Embeddings and rerank without a model: the bodies' checks (gateway/embeddings_routes.py, rerank_routes.py), a
model's kind from its files (protocol/modelkind.py), and the worker loop driving the real embedding engine
(worker/embedding_engine.py) over a fake scorer: Embed and Rerank queued, batched across requests, withdrawn."""

from __future__ import annotations

import base64
import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from protocol.messages import (
    ABORTED,
    CONTEXT_LENGTH_EXCEEDED,
    EXIT_OK,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    MODEL_EVICTED,
    Abort,
    Bye,
    Embed,
    Embedded,
    Evict,
    Heartbeat,
    Message,
    Rerank,
    Reranked,
)
from protocol.modelkind import CHAT, EMBEDDING, RERANK, is_decoder, model_kind
from supervisor import errors
from supervisor.gateway.embeddings_routes import MAX_INPUTS, _encoded, parse_embeddings
from supervisor.gateway.rerank_routes import MAX_DOCUMENTS, parse_rerank, ranked
from tests.unit.worker_fakes import Clock, FakeChannel, rig
from worker.embedding_engine import EmbeddingEngine, cut, prefixed
from worker.engine_api import EmbedderApi
from worker.loop import WorkerLoop
from worker.shutdown import Shutdown


def test_the_four_input_forms_become_a_list_of_inputs() -> None:
    assert parse_embeddings({"model": "m", "input": "a"}).inputs == ["a"]
    assert parse_embeddings({"model": "m", "input": ["a", "b"]}).inputs == ["a", "b"]
    assert parse_embeddings({"model": "m", "input": [1, 2]}).inputs == [[1, 2]]
    assert parse_embeddings({"model": "m", "input": [[1], [2, 3]]}).inputs == [[1], [2, 3]]


@pytest.mark.parametrize("body, param", [
    ([], None), ({"input": "a"}, "model"), ({"model": "m"}, "input"), ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": ["a"] * (MAX_INPUTS + 1)}, "input"), ({"model": "m", "input": [["a"]]}, "input"),
    ({"model": "m", "input": ["a", [1]]}, "input"), ({"model": "m", "input": [True]}, "input"),
    ({"model": "m", "input": [""]}, "input"), ({"model": "m", "input": None}, "input"),
    ({"model": "m", "input": "a", "encoding_format": "hex"}, "encoding_format"),
    ({"model": "m", "input": "a", "dimensions": True}, "dimensions"),
    ({"model": "m", "input": "a", "dimensions": -1}, "dimensions"),
    ({"model": "m", "input": "a", "truncate": 1}, "truncate"),
    ({"model": "m", "input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    # values the wire cannot carry (past int64) or no API means: the field that holds them is named
    ({"model": "m", "input": "a", "input_type": ["query"]}, "input_type"),
    ({"model": "m", "input": "a", "input_type": {"type": "query"}}, "input_type"),
    ({"model": "m", "input": [1, 2**64]}, "input"), ({"model": "m", "input": [[1], [-(2**63) - 1]]}, "input"),
    ({"model": "m", "input": "a", "dimensions": 2**64}, "dimensions"),
    ({"model": "m", "input": "a", "dimensions": 2**63}, "dimensions"),
    ({"model": "m", "input": "a", "truncate_prompt_tokens": 2**64}, "truncate_prompt_tokens"),
    ({"model": "m", "input": "a", "instruction": ["x"]}, "instruction"),
])
def test_bad_bodies_are_invalid_requests_naming_the_field(body: object, param: str | None) -> None:
    with pytest.raises(errors.InvalidRequest) as err:
        parse_embeddings(body)
    assert err.value.param == param and err.value.status == 400


def test_truncation_and_options_map_onto_the_embed_message() -> None:
    base = {"model": "m", "input": "a"}
    assert parse_embeddings(base).truncate is None
    assert parse_embeddings({**base, "truncate": True}).truncate == 0
    assert parse_embeddings({**base, "truncate": False}).truncate is None
    assert parse_embeddings({**base, "truncate_prompt_tokens": -1}).truncate == 0
    assert parse_embeddings({**base, "truncate_prompt_tokens": 9}).truncate == 9
    req = parse_embeddings({**base, "dimensions": 8, "encoding_format": "base64"})
    assert (req.dimensions, req.encoding_format) == (8, "base64")


def test_base64_is_float32_little_endian() -> None:
    vec = [0.5, -0.25, 1.0]
    assert struct.unpack("<3f", base64.b64decode(_encoded(vec, "base64"))) == tuple(vec)
    assert _encoded(vec, "float") == vec


def test_a_model_kind_is_read_from_its_files(tmp_path: Path) -> None:
    def folder(name: str, config: dict, *extra: str) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
        for file in extra:
            (path / file).parent.mkdir(parents=True, exist_ok=True)
            (path / file).write_text("{}")
        return path

    assert model_kind(folder("llama", {"architectures": ["LlamaForCausalLM"]})) == CHAT
    assert model_kind(folder("bert", {"architectures": ["BertModel"]})) == EMBEDDING
    assert model_kind(folder("st", {"architectures": ["Whatever"]}, "modules.json")) == EMBEDDING
    assert model_kind(folder("pool", {}, "1_Pooling/config.json")) == EMBEDDING
    qwen_embedding = folder("qwen-emb", {"architectures": ["Qwen3ForCausalLM"]}, "modules.json")
    assert model_kind(qwen_embedding) == EMBEDDING and is_decoder(qwen_embedding)
    assert not is_decoder(tmp_path / "bert")
    cross = folder("ms-marco", {"architectures": ["BertForSequenceClassification"], "model_type": "bert"})
    assert model_kind(cross) == RERANK and not is_decoder(cross)
    named = folder("Qwen3-Reranker-0.6B", {"architectures": ["Qwen3ForCausalLM"]}, "modules.json")
    assert model_kind(named) == RERANK and is_decoder(named)
    assert model_kind(folder("local", {"architectures": ["Qwen3ForCausalLM"],
                                       "_name_or_path": "Qwen/Qwen3-Reranker-4B"})) == RERANK
    snapshot = tmp_path / "models--BAAI--bge-reranker-base" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"architectures": ["XLMRobertaModel"]}))
    assert model_kind(snapshot) == RERANK  # a hub cache: the repo's folder names it, not the snapshot's hash
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert model_kind(broken) == CHAT


def test_rerank_bodies_in_the_cohere_and_jina_shapes() -> None:
    req = parse_rerank({"model": "r", "query": "q", "documents": ["a", {"text": "b"}], "top_n": 1,
                        "return_documents": True, "max_tokens_per_doc": 64, "rank_fields": ["text"]})
    assert (req.documents, req.top_n, req.return_documents, req.truncate) == (["a", "b"], 1, True, 64)
    assert parse_rerank({"model": "r", "query": "q", "documents": ["a"]}).return_documents is False
    assert ranked(req, [0.25, 0.75]) == [{"index": 1, "relevance_score": 0.75, "document": {"text": "b"}}]
    req.top_n, req.return_documents = None, False
    assert [r["index"] for r in ranked(req, [0.5, 0.5, 0.9])] == [2, 0, 1]  # by score, ties in document order


@pytest.mark.parametrize("body, param", [
    ([], None), ({"query": "q", "documents": ["a"]}, "model"), ({"model": "r", "documents": ["a"]}, "query"),
    ({"model": "r", "query": "", "documents": ["a"]}, "query"), ({"model": "r", "query": "q"}, "documents"),
    ({"model": "r", "query": "q", "documents": []}, "documents"),
    ({"model": "r", "query": "q", "documents": "a"}, "documents"),
    ({"model": "r", "query": "q", "documents": [{"title": "a"}]}, "documents"),
    ({"model": "r", "query": "q", "documents": [1]}, "documents"),
    ({"model": "r", "query": "q", "documents": ["a"] * (MAX_DOCUMENTS + 1)}, "documents"),
    ({"model": "r", "query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
    ({"model": "r", "query": "q", "documents": ["a"], "top_n": "2"}, "top_n"),
    ({"model": "r", "query": "q", "documents": ["a"], "return_documents": "yes"}, "return_documents"),
    ({"model": "r", "query": "q", "documents": ["a"], "instruction": 5}, "instruction"),
    ({"model": "r", "query": "q", "documents": ["a"], "max_tokens_per_doc": -1}, "max_tokens_per_doc"),
    ({"model": "r", "query": "q", "documents": ["a"], "max_tokens_per_doc": 2**64}, "max_tokens_per_doc"),
    ({"model": "r", "query": "q", "documents": ["a"], "max_tokens_per_doc": 2**63}, "max_tokens_per_doc"),
    ({"model": "r", "query": "q", "documents": ["a"], "truncate_prompt_tokens": 2**64}, "truncate_prompt_tokens"),
    ({"model": "r", "query": "q", "documents": ["a"], "top_n": 2**64}, "top_n"),
])
def test_bad_rerank_bodies_are_invalid_requests_naming_the_field(body: object, param: str | None) -> None:
    with pytest.raises(errors.InvalidRequest) as err:
        parse_rerank(body)
    assert err.value.param == param and err.value.status == 400


def test_input_type_takes_ours_and_cohere_names() -> None:
    base = {"model": "m", "input": "a"}
    assert parse_embeddings({**base, "input_type": "search_query"}).input_type == "query"
    assert parse_embeddings({**base, "input_type": "search_document"}).input_type == "document"
    assert parse_embeddings({**base, "input_type": "clustering"}).input_type is None
    with pytest.raises(errors.InvalidRequest) as err:
        parse_embeddings({**base, "input_type": "passage!"})
    assert err.value.param == "input_type"


def test_prompts_prefix_by_input_type_and_an_instruction_keeps_the_models_framing() -> None:
    qwen = {"query": "Instruct: Given a web search query, retrieve relevant passages\nQuery:", "document": ""}
    assert prefixed(qwen, None, None) == ""
    assert prefixed(qwen, "query", None) == qwen["query"]
    assert prefixed(qwen, "query", "Find code") == "Instruct: Find code\nQuery:"
    assert prefixed(qwen, None, "Find code") == "Instruct: Find code\nQuery:"
    assert prefixed(qwen, "document", "Find code") == ""
    assert prefixed({"query": "query: ", "document": "passage: "}, "document", None) == "passage: "
    assert prefixed({}, "query", "Represent this: ") == "Represent this: "
    assert cut([3.0, 4.0, 12.0], 2) == [0.6, 0.8] and cut([1.0], None) == [1.0]


@dataclass
class FakeScorer:
    """A scorer as the engine drives it: a row [length, first id] per input (a reranker: [pair length]), one
    fake-clock second per batch; "boom" in a batch raises; `during` runs inside the n-th batch."""

    clock: Clock
    dim: int | None = 2
    window: int = 16
    vocab_size: int = 128
    speed: float = 1e9  # padded tokens per second, as measured: it sets the budget
    batches: list[list[list[int]]] = field(default_factory=list)
    during: dict[int, Callable[[], None]] = field(default_factory=dict)
    max_rows: int | None = None  # a device that runs out of memory on a batch of more rows than this

    @property
    def tokens_per_s(self) -> float:
        return self.speed

    @tokens_per_s.setter
    def tokens_per_s(self, measured: float) -> None:  # the fake keeps the speed the test set
        pass

    def encode(self, texts: list[str], limit: int | None = None) -> list[list[int]]:
        return [[ord(c) for c in t][:limit] for t in texts]

    def pairs(self, query: str, docs: list[str], limit: int, instruction: str | None = None) -> list[list[int]]:
        return [self.encode([query + "|" + d], limit)[0] for d in docs]

    def forward(self, batch: list[list[int]], dimensions: int | None) -> list[list[float]]:
        self.batches.append(batch)
        self.clock.now += 1.0
        if len(self.batches) in self.during:
            self.during[len(self.batches)]()
        if [ord(c) for c in "boom"] in batch:
            raise RuntimeError("boom")
        if self.max_rows is not None and len(batch) > self.max_rows:
            raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")
        return [[float(len(s))] if self.dim is None else [float(len(s)), float(s[0])] for s in batch]


@dataclass
class EmbedRig:
    clock: Clock
    channel: FakeChannel
    model: FakeScorer
    loop: WorkerLoop

    def replies(self) -> dict[str, Message]:
        return {m.rid: m for m in self.channel.sent if isinstance(m, (Embedded, Reranked))}


def _rig(*inbox: Message, reranker: bool = False, speed: float = 1e9) -> EmbedRig:
    """The loop over the real engine and a fake scorer; an Evict ends it once the queue is empty and idle."""
    clock = Clock()
    channel = FakeChannel(clock)
    channel.put(*inbox)
    channel.when_idle.append(lambda: channel.put(Evict("now", 0)))
    model = FakeScorer(clock, dim=None if reranker else 2, speed=speed)
    loop = WorkerLoop(channel, EmbeddingEngine(model), "m", Shutdown(clock), clock=clock, memory=lambda: 1)
    return EmbedRig(clock, channel, model, loop)


def _vec(text: str) -> list[float]:
    return cut([float(len(text)), float(ord(text[0]))], None)


def test_concurrent_requests_share_a_batch_and_each_gets_its_own_rows() -> None:
    r = _rig(Embed("e1", ["ab", "c", "def"]), Embed("e2", ["zz"], dimensions=1), Embed("e3", [[5, 6]]))
    assert r.loop.run() == EXIT_OK
    got = r.replies()
    assert got["e1"] == Embedded("e1", [_vec("ab"), _vec("c"), _vec("def")], 6)
    assert got["e2"] == Embedded("e2", [[1.0]], 2)  # its own dimensions, cut from the shared batch's row
    assert got["e3"] == Embedded("e3", [[2.0, 5.0]], 2)
    assert len(r.model.batches) == 1 and len(r.model.batches[0]) == 5  # one batch across the three requests


def test_bad_requests_are_refused_at_once_and_the_queue_goes_on() -> None:
    r = _rig(Embed("long", ["x" * 17]), Embed("dims", ["x"], dimensions=3), Embed("ids", [[128]]),
             Rerank("rr", "q", ["a"]), Embed("ok", ["x" * 17], truncate=0))
    assert r.loop.run() == EXIT_OK
    got = r.replies()
    assert got["long"].code == CONTEXT_LENGTH_EXCEEDED and "input[0]" in got["long"].message
    assert got["dims"].code == INVALID_REQUEST and got["ids"].code == INVALID_REQUEST
    assert isinstance(got["rr"], Reranked) and got["rr"].code == INVALID_REQUEST and "embedding model" in \
        got["rr"].message
    assert got["ok"].code is None and got["ok"].tokens == 16


def test_a_pair_over_the_requests_own_limit_says_that_limit_not_the_window() -> None:
    """max_tokens_per_doc: 1 used to answer "this model's window is 1": the limit was the request's, the window
    (16 here) the model's. A pair's query part is never cut (decoder_pool.py's pairs), so the fake keeps it."""
    r = _rig(Rerank("small", "query", ["doc"], truncate=1), Rerank("big", "q" * 20, ["doc"]), reranker=True)
    r.model.pairs = lambda query, docs, limit, instruction=None: [[ord(c) for c in query + "|"] for _ in docs]
    assert r.loop.run() == EXIT_OK
    small, big = r.replies()["small"], r.replies()["big"]
    assert small.code == INVALID_REQUEST and not re.search(r"window is 1\b", small.message), small.message
    assert "documents[0] takes 6 tokens" in small.message and "max_tokens_per_doc" in small.message
    assert "limit of 1 token" in small.message and "window is 16" in small.message
    assert big.code == CONTEXT_LENGTH_EXCEEDED and "takes 21 tokens; this model's window is 16" in big.message


def test_a_reranker_scores_each_document_in_order_and_refuses_an_embed() -> None:
    r = _rig(Rerank("k1", "q", ["a", "bbb", "cc"]), Embed("e1", ["x"]), reranker=True)
    assert r.loop.run() == EXIT_OK
    got = r.replies()
    assert got["k1"] == Reranked("k1", [3.0, 5.0, 4.0], 12)
    assert isinstance(got["e1"], Embedded) and got["e1"].code == INVALID_REQUEST and "reranker" in got["e1"].message


def test_a_chat_engine_refuses_an_embed_and_a_rerank_and_goes_on() -> None:
    r = rig(Embed("e1", ["x"]), Rerank("k1", "q", ["d"]), Evict("now", 0))
    assert not isinstance(r.engine, EmbedderApi)
    assert r.loop.run() == EXIT_OK
    [embedded] = r.sent(Embedded)
    [reranked] = r.sent(Reranked)
    assert (embedded.rid, embedded.code, embedded.vectors) == ("e1", INVALID_REQUEST, [])
    assert (reranked.rid, reranked.code) == ("k1", INVALID_REQUEST) and "does not serve rerank" in reranked.message


def test_heartbeats_come_between_batches() -> None:
    """Catches: a request of many batches computed in one go, its minute without a heartbeat taken for a hang."""
    r = _rig(Embed("e1", ["ab", "c", "def", "gh"]), speed=2.0)  # a budget of one token: one input per batch
    assert r.loop.run() == EXIT_OK
    assert len(r.model.batches) == 4
    sent = r.channel.sent
    reply = next(i for i, m in enumerate(sent) if isinstance(m, Embedded))
    assert sum(isinstance(m, Heartbeat) for m in sent[:reply]) >= 4  # one a second, the batches a second each


def test_an_evict_between_batches_answers_the_pending_requests_with_its_code() -> None:
    """Catches: a queued request left without an answer at an evict (its client would wait out the timeout)."""
    r = _rig(Embed("e1", ["ab", "c", "def"]), Rerank("k1", "q", ["d"]), Embed("e2", ["z"]), speed=2.0)
    r.model.during[1] = lambda: r.channel.put(Evict("now", 0), Embed("late", ["x"]))
    assert r.loop.run() == EXIT_OK
    got = r.replies()
    assert len(r.model.batches) == 1
    assert {rid: m.code for rid, m in got.items()} == {"e1": MODEL_EVICTED, "k1": INVALID_REQUEST,
                                                      "e2": MODEL_EVICTED, "late": MODEL_EVICTED}
    bye = r.channel.sent[-1]
    assert isinstance(bye, Bye) and bye.aborted == 2


def test_an_abort_answers_its_request_and_the_others_go_on() -> None:
    r = _rig(Embed("e1", ["ab", "c", "def"]), Embed("e2", ["zz", "y"]), speed=2.0)
    r.model.during[1] = lambda: r.channel.put(Abort("e1"), Abort("unknown"))
    assert r.loop.run() == EXIT_OK
    got = r.replies()
    assert (got["e1"].code, got["e1"].vectors) == (ABORTED, [])
    assert got["e2"] == Embedded("e2", [_vec("zz"), _vec("y")], 3)
    later = [ids for batch in r.model.batches[1:] for ids in batch]
    assert [ord("a"), ord("b")] not in later and [ord("d"), ord("e"), ord("f")] not in later  # withdrawn at once


def test_a_failing_batch_fails_its_requests_and_the_worker_goes_on() -> None:
    r = _rig(Embed("bad", ["boom"]), Embed("e1", ["x"]), speed=2.0)
    r.model.during[2] = lambda: r.channel.put(Embed("e2", ["yy"]))
    assert r.loop.run() == EXIT_OK
    got = r.replies()
    assert got["bad"].code == INTERNAL_ERROR and "boom" in got["bad"].message
    assert got["e1"].code is None and got["e2"] == Embedded("e2", [_vec("yy")], 2)


def test_a_batch_the_device_cannot_hold_is_split_and_every_request_answered() -> None:
    """Catches: a batch that ran the device out of memory failing every request in it (a 500 for each client, seen
    on a GPU at 64 clients); its inputs must be computed again in smaller batches, and later batches stay smaller."""
    r = _rig(*(Embed(f"e{k}", ["ab"]) for k in range(6)))
    r.model.max_rows = 2
    assert r.loop.run() == EXIT_OK
    got = r.replies()
    assert all(got[f"e{k}"] == Embedded(f"e{k}", [_vec("ab")], 2) for k in range(6)), got
    assert len(r.model.batches[0]) == 6 and all(len(b) <= 2 for b in r.model.batches[-3:])
