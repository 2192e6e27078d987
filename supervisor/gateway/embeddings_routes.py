"""`POST /v1/embeddings` (OpenAI's shape): the body checked here, the vectors from the model's worker (an Embed).

Only a model whose kind is embedding (protocol/modelkind.py, the registry's) is asked; any other is a 400
that says so, before a worker is started for it. The worker does the rest of the checking (token ids in the
vocabulary, an input over the window, `dimensions` beyond the model's width) and its refusals come back
with their codes, as 4xx. Invariants: every bad body is a 4xx in OpenAI's error shape, raised before the
worker is asked; the lease taken for the request is released on every path; `base64` is the float32
little-endian bytes of the same vector `float` gives. `input_type` ("query", "document", or Cohere's names for
them) picks the model's prompt for text inputs, `instruction` a query's task (protocol/messages.py's Embed).
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from protocol.messages import Embed, Embedded
from protocol.modelkind import EMBEDDING
from supervisor import errors
from supervisor.config import Settings
from supervisor.gateway.http import read_json
from supervisor.gateway.worker_ask import ask_worker
from supervisor.router import Router

MAX_INPUTS = 2048  # OpenAI's own limit per request
ENCODINGS = ("float", "base64")
# input_type as clients send it -> Embed.input_type: ours, Cohere's (whose classification and clustering have no
# prompt of their own in the models served here: no prefix)
INPUT_TYPES: dict[str, str | None] = {"query": "query", "document": "document", "search_query": "query",
                                      "search_document": "document", "classification": None, "clustering": None}


@dataclass
class EmbeddingsRequest:
    model: str
    inputs: list  # each a str or a list of token ids
    encoding_format: str = "float"
    dimensions: int | None = None
    truncate: int | None = None  # Embed.truncate: None refuses an input over the window, 0 cuts to it, n > 0 to n
    input_type: str | None = None
    instruction: str | None = None


MAX_COUNT = 2**31 - 1  # the most a count (dimensions, a token limit) or a token id may be: every vocabulary and
# window is far smaller, and the wire (msgpack's 64-bit integers) could not carry what lies past int64


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def positive_count(body: dict, name: str) -> int | None:
    """`body[name]`: absent (None), or a positive integer up to MAX_COUNT; else a 400 naming `name`."""
    value = body.get(name)
    if value is not None and (not _is_int(value) or not 1 <= value <= MAX_COUNT):
        raise errors.InvalidRequest(f"{name} must be a positive integer (at most {MAX_COUNT})", param=name)
    return value


def _inputs(value: Any) -> list:
    """OpenAI's four input forms, as a list of texts and token-id lists (see the module docstring)."""
    bad = errors.InvalidRequest("input must be a string, a list of strings, a list of token ids or a list of "
                                "lists of token ids", param="input")
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(_is_int(t) for t in value):
        value = [value]
    if not isinstance(value, list):
        raise bad
    if not value:
        raise errors.InvalidRequest("input must not be empty", param="input")
    if len(value) > MAX_INPUTS:
        raise errors.InvalidRequest(f"input has {len(value)} items; at most {MAX_INPUTS} are accepted per request",
                                    param="input")
    for i, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise errors.InvalidRequest(f"input[{i}] is an empty string", param="input")
        elif isinstance(item, list) and all(_is_int(t) for t in item):
            if not item:
                raise errors.InvalidRequest(f"input[{i}] is an empty list of token ids", param="input")
            if not all(0 <= t <= MAX_COUNT for t in item):
                raise errors.InvalidRequest(f"input[{i}] holds an integer that is no token id (ids are 0 to "
                                            f"{MAX_COUNT}, below the model's vocabulary size)", param="input")
        else:
            raise bad
    if len({type(item) for item in value}) > 1:
        raise errors.InvalidRequest("input mixes strings and token ids", param="input")
    return value


def parse_embeddings(body: Any) -> EmbeddingsRequest:
    """The request, or InvalidRequest naming the field at fault."""
    if not isinstance(body, dict):
        raise errors.InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise errors.InvalidRequest("model is required (a string)", param="model")
    if "input" not in body:
        raise errors.InvalidRequest("input is required", param="input")
    req = EmbeddingsRequest(model, _inputs(body["input"]))
    fmt = body.get("encoding_format")
    if fmt is not None:
        if fmt not in ENCODINGS:
            raise errors.InvalidRequest(f"encoding_format must be one of {', '.join(ENCODINGS)}",
                                        param="encoding_format")
        req.encoding_format = fmt
    req.dimensions = positive_count(body, "dimensions")
    truncate, tokens = body.get("truncate"), body.get("truncate_prompt_tokens")
    if truncate is not None and not isinstance(truncate, bool):
        raise errors.InvalidRequest("truncate must be true or false", param="truncate")
    if tokens is not None and (not _is_int(tokens) or tokens == 0 or tokens < -1 or tokens > MAX_COUNT):
        raise errors.InvalidRequest(f"truncate_prompt_tokens must be a positive token count (at most {MAX_COUNT}), "
                                    "or -1 for the window", param="truncate_prompt_tokens")
    if tokens is not None:
        req.truncate = 0 if tokens == -1 else tokens
    elif truncate:
        req.truncate = 0
    input_type, instruction = body.get("input_type"), body.get("instruction")
    if input_type is not None:
        if not isinstance(input_type, str) or input_type not in INPUT_TYPES:
            raise errors.InvalidRequest(f"input_type must be one of {', '.join(INPUT_TYPES)}", param="input_type")
        req.input_type = INPUT_TYPES[input_type]
    if instruction is not None:
        if not isinstance(instruction, str) or not instruction:
            raise errors.InvalidRequest("instruction must be a non-empty string", param="instruction")
        req.instruction = instruction
    return req


def _encoded(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


class EmbeddingsRoutes:
    def __init__(self, router: Router, settings: Settings) -> None:
        self.router = router
        self.settings = settings

    async def embeddings(self, request: Request) -> Response:
        req = parse_embeddings(await read_json(request, self.settings.max_body_bytes))
        spec = self.router.registry.resolve(req.model)
        if spec.kind != EMBEDDING:
            raise errors.InvalidRequest(f"'{spec.id}' is a {spec.kind} model: /v1/embeddings needs an embedding "
                                        "model", param="model")
        reply = await ask_worker(self.router, spec.id,
                                 lambda rid: Embed(rid, req.inputs, req.truncate, req.dimensions, req.input_type,
                                                   req.instruction),
                                 self.settings.embed_timeout_s, "embed the inputs", param="input", request=request,
                                 silence=True)  # the worker heartbeats between batches: a limit on its silence
        assert isinstance(reply, Embedded)
        data = [{"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
                for i, v in enumerate(reply.vectors)]
        return JSONResponse({"object": "list", "data": data, "model": spec.id,
                             "usage": {"prompt_tokens": reply.tokens, "total_tokens": reply.tokens}})


def embeddings_routes(router: Router, settings: Settings) -> list[Route]:
    routes = EmbeddingsRoutes(router, settings)
    return [Route("/v1/embeddings", routes.embeddings, methods=["POST"])]
