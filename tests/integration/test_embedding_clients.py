"""Real client libraries against the daemon's embeddings and rerank: LangChain's `OpenAIEmbeddings`
(langchain-openai), LiteLLM's `embedding` and its `rerank` through each provider whose request our routes take
(cohere: /v2/rerank, jina_ai: /v1/rerank, hosted_vllm: /rerank), each with its own request shape and parsing,
unmodified. The vectors must equal what the model computes in this process with the same code the worker runs
(worker/mlx_engine/embedder.py), and a rerank's order the order of the in-process scores
(worker/mlx_engine/decoder_pool.py). LiteLLM's infinity provider is not among them: it reads a returned document
as a bare string, where Cohere's shape (ours) has {"text": ...}.

Offline: LangChain is told not to count tokens with tiktoken (`check_embedding_ctx_length=False`: tiktoken would
download its encodings), LiteLLM to read its bundled model cost map (LITELLM_LOCAL_MODEL_COST_MAP: it fetches one
from GitHub at import otherwise, and retries for seconds when there is no network). The models, the daemon
and the in-process references are test_embeddings.py's fixtures (all-MiniLM-L6-v2, a make-model qwen3-reranker).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from tests.conftest import Daemon
from tests.integration.test_embeddings import DOCS, QUERIES, TEXTS, _expected, daemon, models, ref, rerank_ref  # noqa: F401

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # read at litellm's import
langchain_openai = pytest.importorskip("langchain_openai")
litellm = pytest.importorskip("litellm")
pytestmark = pytest.mark.filterwarnings("ignore:Items? .* using the `ReadOnly` qualifier:UserWarning")  # litellm's


def test_langchain_embeds_documents_and_a_query_as_the_model_does(daemon: Daemon, ref: Any) -> None:  # noqa: F811
    emb = langchain_openai.OpenAIEmbeddings(model="minilm", base_url=daemon.v1, api_key="unused", max_retries=0,
                                            check_embedding_ctx_length=False, chunk_size=4)
    docs = emb.embed_documents(DOCS)  # chunk_size 4: three requests, their vectors put back in order
    np.testing.assert_allclose(np.array(docs), _expected(ref, DOCS), atol=1e-5)
    query = next(iter(QUERIES))
    got = np.array(emb.embed_query(query))
    np.testing.assert_allclose(got, _expected(ref, [query])[0], atol=1e-5)
    assert int(np.argmax(np.array(docs) @ got)) == QUERIES[query]


def test_litellm_embedding_through_its_openai_provider(daemon: Daemon, ref: Any) -> None:  # noqa: F811
    resp = litellm.embedding(model="openai/minilm", input=TEXTS, api_base=daemon.v1, api_key="unused")
    assert [d["index"] for d in resp.data] == list(range(len(TEXTS)))
    got = np.array([d["embedding"] for d in resp.data])
    np.testing.assert_allclose(got, _expected(ref, TEXTS), atol=1e-5)
    assert resp.usage.prompt_tokens == sum(len(ids) for ids in ref.encode(TEXTS))


QUERY = next(iter(QUERIES))


@pytest.fixture(scope="module")
def scores(rerank_ref: Any) -> list[float]:  # noqa: F811
    """The reranker's score of each of DOCS for QUERY, computed in this process."""
    return rerank_ref(QUERY, DOCS)


@pytest.mark.parametrize(("provider", "path"), [("cohere", ""), ("jina_ai", "/v1"), ("hosted_vllm", "")])
def test_litellm_rerank_orders_as_the_in_process_scores(daemon: Daemon, scores: list[float], provider: str,  # noqa: F811
                                                        path: str) -> None:
    want = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    gaps = [scores[a] - scores[b] for a, b in zip(want, want[1:])]
    assert min(gaps) > 1e-4, gaps  # the order is the model's, not float noise between batchings
    resp = litellm.rerank(model=f"{provider}/qwen3-reranker", query=QUERY, documents=DOCS, api_base=daemon.url + path,
                          api_key="unused", top_n=5, return_documents=True)
    assert [r["index"] for r in resp.results] == want[:5]
    np.testing.assert_allclose([r["relevance_score"] for r in resp.results], [scores[i] for i in want[:5]], atol=1e-5)
    assert [r["document"]["text"] for r in resp.results] == [DOCS[i] for i in want[:5]]
