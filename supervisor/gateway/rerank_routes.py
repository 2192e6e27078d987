"""`POST /v1/rerank`, `/rerank` and `/v2/rerank` (the Cohere / Jina shape): the body checked here, the scores from
the model's worker (a Rerank).

The three paths are what clients call: LiteLLM's cohere provider /v1/rerank, its cohere v2 /v2/rerank, its
hosted_vllm provider /rerank, Jina's /v1/rerank. The answer carries what each of them reads: `results` sorted
by `relevance_score`, highest first, each with the document's `index` (and the document, when asked); `meta`
(Cohere's: billed units and tokens) and `usage` (Jina's and vLLM's). Only a model whose kind is rerank
(protocol/modelkind.py) is asked; any other is a 400 that says so, before a worker is started. Invariants: every
bad body is a 4xx in the same error shape as /v1/embeddings, raised before the worker is asked; the lease taken
for the request is released on every path (gateway/worker_ask.py).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from protocol.messages import Rerank, Reranked
from protocol.modelkind import RERANK
from supervisor import errors
from supervisor.config import Settings
from supervisor.gateway.embeddings_routes import positive_count
from supervisor.gateway.http import read_json
from supervisor.gateway.worker_ask import ask_worker
from supervisor.router import Router

MAX_DOCUMENTS = 1000  # Cohere's recommended most per request


@dataclass
class RerankRequest:
    model: str
    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = False  # Cohere's default
    instruction: str | None = None
    truncate: int | None = None  # Rerank.truncate: tokens per query-document pair (None: the window)


def _documents(value: Any) -> list[str]:
    if not isinstance(value, list) or not value:
        raise errors.InvalidRequest("documents must be a non-empty list of strings or {\"text\": ...} objects",
                                    param="documents")
    if len(value) > MAX_DOCUMENTS:
        raise errors.InvalidRequest(f"documents has {len(value)} items; at most {MAX_DOCUMENTS} are accepted per "
                                    "request", param="documents")
    texts = []
    for i, doc in enumerate(value):
        text = doc.get("text") if isinstance(doc, dict) else doc
        if not isinstance(text, str):
            raise errors.InvalidRequest(f"documents[{i}] must be a string or an object with a string \"text\"",
                                        param="documents")
        texts.append(text)
    return texts


def parse_rerank(body: Any) -> RerankRequest:
    """The request, or InvalidRequest naming the field at fault."""
    if not isinstance(body, dict):
        raise errors.InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise errors.InvalidRequest("model is required (a string)", param="model")
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise errors.InvalidRequest("query is required (a non-empty string)", param="query")
    req = RerankRequest(model, query, _documents(body.get("documents")), top_n=positive_count(body, "top_n"))
    flag = body.get("return_documents")
    if flag is not None:
        if not isinstance(flag, bool):
            raise errors.InvalidRequest("return_documents must be true or false", param="return_documents")
        req.return_documents = flag
    instruction = body.get("instruction")
    if instruction is not None:
        if not isinstance(instruction, str) or not instruction:
            raise errors.InvalidRequest("instruction must be a non-empty string", param="instruction")
        req.instruction = instruction
    # Cohere v2's per-document cap and vLLM's per-prompt one both bound the pair here
    per_doc, per_prompt = positive_count(body, "max_tokens_per_doc"), positive_count(body, "truncate_prompt_tokens")
    req.truncate = per_doc or per_prompt
    return req


def ranked(req: RerankRequest, scores: list[float]) -> list[dict]:
    """Results by score, highest first (ties by document order), cut to top_n."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:req.top_n]
    results: list[dict] = []
    for i in order:
        result: dict = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            result["document"] = {"text": req.documents[i]}
        results.append(result)
    return results


class RerankRoutes:
    def __init__(self, router: Router, settings: Settings) -> None:
        self.router = router
        self.settings = settings

    async def rerank(self, request: Request) -> Response:
        req = parse_rerank(await read_json(request, self.settings.max_body_bytes))
        spec = self.router.registry.resolve(req.model)
        if spec.kind != RERANK:
            raise errors.InvalidRequest(f"'{spec.id}' is a {spec.kind} model: rerank needs a reranker", param="model")
        reply = await ask_worker(self.router, spec.id,
                                 lambda rid: Rerank(rid, req.query, req.documents, req.instruction, req.truncate),
                                 self.settings.embed_timeout_s, "rerank the documents", param="documents",
                                 request=request, silence=True)  # a limit on the worker's silence, not a deadline
        assert isinstance(reply, Reranked)
        tokens = reply.tokens
        return JSONResponse({
            "id": f"rerank-{uuid.uuid4().hex}", "model": spec.id, "results": ranked(req, reply.scores),
            "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1, "total_tokens": tokens},
                     "tokens": {"input_tokens": tokens, "output_tokens": 0}},
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def rerank_routes(router: Router, settings: Settings) -> list[Route]:
    routes = RerankRoutes(router, settings)
    return [Route(path, routes.rerank, methods=["POST"]) for path in ("/v1/rerank", "/rerank", "/v2/rerank")]
