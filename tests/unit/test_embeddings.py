"""Embeddings without a model: the body's checks (gateway/embeddings_routes.py), a model's kind from its files
(protocol/modelkind.py), and the worker loop's Embed handling with fake engines."""

from __future__ import annotations

import base64
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest

from protocol.messages import (
    CONTEXT_LENGTH_EXCEEDED,
    EXIT_OK,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    Embed,
    Embedded,
    Evict,
    Heartbeat,
)
from protocol.modelkind import CHAT, EMBEDDING, model_kind
from supervisor import errors
from supervisor.gateway.embeddings_routes import MAX_INPUTS, _encoded, parse_embeddings
from tests.unit.worker_fakes import FakeEngine, rig
from worker.engine_api import EmbedderApi, RequestRejected


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
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert model_kind(broken) == CHAT


@dataclass
class FakeEmbedder(FakeEngine):
    """The fake engine plus `embed`: a vector [len, index] per input, 'bad' refused, 'boom' raising."""

    batches: int = 0

    def embed(self, msg: Embed, between) -> tuple[list[list[float]], int]:
        self.calls.append(f"embed {msg.rid}")
        if "bad" in msg.inputs:
            raise RequestRejected(CONTEXT_LENGTH_EXCEEDED, "input[0] is too long")
        if "boom" in msg.inputs:
            raise ValueError("boom")
        for _ in msg.inputs:  # one batch per input: the loop's heartbeat runs between them
            self.batches += 1
            self.clock.now += 0.6
            between()
        return [[float(len(x)), float(i)] for i, x in enumerate(msg.inputs)], sum(len(x) for x in msg.inputs)


def _embedder_rig(*inbox) -> object:
    r = rig(*inbox)
    r.engine = FakeEmbedder(r.engine.clock)
    r.loop.engine = r.engine
    return r


def test_a_chat_engine_refuses_an_embed_and_goes_on() -> None:
    r = rig(Embed("e1", ["x"]), Evict("now", 0))
    assert not isinstance(r.engine, EmbedderApi)
    assert r.loop.run() == EXIT_OK
    [reply] = r.sent(Embedded)
    assert (reply.rid, reply.code, reply.vectors) == ("e1", INVALID_REQUEST, [])
    assert "chat model" in reply.message


def test_an_embedder_answers_each_embed_and_heartbeats_between_batches() -> None:
    r = _embedder_rig(Embed("e1", ["ab", "c", "def"]), Embed("bad", ["bad"]), Embed("boom", ["boom"]),
                      Embed("e2", ["z"]), Evict("now", 0))
    assert isinstance(r.engine, EmbedderApi)
    assert r.loop.run() == EXIT_OK
    answers = {e.rid: e for e in r.sent(Embedded)}
    assert (answers["e1"].vectors, answers["e1"].tokens, answers["e1"].code) == (
        [[2.0, 0.0], [1.0, 1.0], [3.0, 2.0]], 6, None)
    assert (answers["bad"].code, answers["bad"].message) == (CONTEXT_LENGTH_EXCEEDED, "input[0] is too long")
    assert answers["boom"].code == INTERNAL_ERROR and "boom" in answers["boom"].message
    assert answers["e2"].vectors == [[1.0, 0.0]]  # the worker went on after both
    # e1's three 0.6 s batches pass the 1 s heartbeat interval: a heartbeat went out during it, after the turn's own
    sent = r.channel.sent
    first_reply = next(i for i, m in enumerate(sent) if isinstance(m, Embedded))
    assert sum(isinstance(m, Heartbeat) for m in sent[:first_reply]) == 2
