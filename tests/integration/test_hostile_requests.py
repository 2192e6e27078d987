"""Requests a worker must refuse or end cleanly, through a real daemon: token ids past the vocabulary and grammars
llguidance cannot hold. Each gets a 4xx with an OpenAI error body (or, once streaming, an error event), never a
200 with unconstrained output, and the worker serving them lives on (its pid is unchanged)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import Daemon

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
MANY = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]}
                  for i in range(3000)]}
RECURSIVE = {"type": "object", "description": "x" * 70_000, "required": ["a"],
             "properties": {"a": {"$ref": "#"}, "b": {"type": "string"}}}
# Free at its start (a boolean to choose), then a row past llguidance's item limit: fails only mid-request.
LATE = {"type": "object", "required": ["a", "b"], "properties": {"a": {"type": "boolean"}, "b": MANY}}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def post(daemon: Daemon, **body) -> httpx.Response:
    return httpx.post(daemon.url + CHAT, json={"model": "tiny", "messages": MSGS, "temperature": 0, **body},
                      timeout=120)


@pytest.fixture(scope="module")
def pid(daemon: Daemon) -> int:
    r = post(daemon, max_tokens=2)
    assert r.status_code == 200
    return daemon.model("tiny")["pid"]


@pytest.mark.parametrize("bias", [{"5000": 1}, {"1024": 5}, {str(i): 1 for i in range(1000, 1200)}],
                         ids=["far", "just-past", "a-run"])
def test_logit_bias_past_the_vocabulary_is_a_400_and_the_worker_lives(daemon: Daemon, pid: int, bias: dict) -> None:
    r = post(daemon, max_tokens=4, logit_bias=bias)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_request" and "vocabulary" in r.json()["error"]["message"]
    assert daemon.model("tiny")["pid"] == pid
    assert post(daemon, max_tokens=4, logit_bias={"5": 1}).status_code == 200  # an id it has: served


@pytest.mark.parametrize("schema, reason", [({"$ref": "#"}, "fails where its output starts"),
                                            (RECURSIVE, "Too many items"), (MANY, "max is 2000")],
                         ids=["unsatisfiable", "recursive-huge-description", "anyof-3000"])
def test_a_schema_llguidance_cannot_hold_is_a_400_at_submit(daemon: Daemon, pid: int, schema: dict,
                                                            reason: str) -> None:
    for stream in (False, True):
        r = post(daemon, max_tokens=40, response_format=schema_format(schema), stream=stream)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_request" and reason in error["message"]
        assert len(error["message"]) < 1000  # the reason, not the grammar
    assert daemon.model("tiny")["pid"] == pid


def test_a_grammar_failing_mid_request_ends_it_with_an_error_never_unconstrained(daemon: Daemon, pid: int) -> None:
    r = post(daemon, max_tokens=80, response_format=schema_format(LATE))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_request"
    assert "constrained decoding failed" in r.json()["error"]["message"]

    events = []
    with httpx.stream("POST", daemon.url + CHAT, timeout=120,
                      json={"model": "tiny", "messages": MSGS, "temperature": 0, "max_tokens": 80, "stream": True,
                            "response_format": schema_format(LATE)}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "constrained decoding failed" in events[-1]["error"]["message"]  # the stream ends on the error
    assert not any(e.get("choices") and e["choices"][0].get("finish_reason") for e in events)
    assert daemon.model("tiny")["pid"] == pid
    assert post(daemon, max_tokens=4).status_code == 200
