"""issue 53 against a real daemon: the context a model publishes is what fits under the memory ceiling at its
`[cache] kv_bits`, read through the openai client (GET /v1/models/{id}) from the worker's Ready, and a prompt past it
is the API's 400 (context_length_exceeded), as past a checkpoint's window. Ollama's /api/show and /api/ps (through the
ollama client) and /api/status (the dashboard's and `mlxsup status`'s) report the same number, before the model's
worker starts (the supervisor's cap) and after (the worker's). mlxsup has no Anthropic models route.

A ceiling leaving room for N tokens of a float32 model's K/V past its full-precision estimate: the published context
is N at full precision and, at 8 bits, what the room past the 8-bit estimate (admission's: its first request's
kv_tokens of K/V at 8 bits too) holds at 1 byte + a 4-byte scale and bias per group of 32, within a block. A model
whose running cache cannot be quantized (the tiny preset's head dimension of 16 takes no MLX group) publishes N at
kv_bits 8 too: its worker counts the cap back to full precision (engine.full_precision_context).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.modelconfig import kv_bytes_at, model_estimate
from supervisor.registry import weights_bytes
from tests.conftest import Daemon, start_daemon

N = 4096
BLOCK = 64


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.mlx_engine.make_model import FAMILIES, make_model

    root = tmp_path_factory.mktemp("kvctx")
    presets = FAMILIES["llama"].presets
    presets["kv32"] = {**presets["tiny"], "num_attention_heads": 2, "num_key_value_heads": 1,
                       "max_position_embeddings": 65536}
    try:
        make_model(root / "kv32", "kv32", seed=0, arch="llama")
    finally:
        del presets["kv32"]
    make_model(root / "tiny", "tiny", seed=0, arch="llama")
    return root


def published(root: Path, name: str, kv_bits: int, state: Path) -> tuple[int, int, int]:
    """(the context GET /v1/models/{name} reports, the full-precision K/V bytes a token, the tokens of the first
    request's K/V in the estimate) under a ceiling that leaves N tokens of full-precision K/V past the model's
    full-precision estimate."""
    import openai

    path = root / name
    est = model_estimate(path)
    overhead = 2**30  # the estimate's: a worker's footprint (its runtime past the weights) fits under the ceiling
    ceiling = weights_bytes(path) + est.runtime_bytes + overhead + N * est.kv_bytes_per_token
    config = state.parent / f"{state.name}.toml"
    config.write_text(f'[memory]\nceiling = {ceiling}\nworker_overhead = {overhead}\n'
                      f'[cache]\nkv_bits = {kv_bits}\nkv_group_size = 32\n'
                      f'[models.{name}]\npath = "{path}"\n')
    d: Daemon = start_daemon(state, "--config", str(config))
    try:
        client = openai.OpenAI(base_url=d.v1, api_key="none", timeout=120)
        assert reported(d, client, name, loaded=False)  # before a worker: the supervisor's cap, the same everywhere
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        context = reported(d, client, name, loaded=True)  # the worker is up: its Ready's context
        with pytest.raises(openai.BadRequestError) as refused:  # a prompt past the fitted context: the API's 400
            client.chat.completions.create(model=name, messages=[{"role": "user", "content": "word " * (context + 50)}],
                                           max_tokens=1)
        assert refused.value.code == "context_length_exceeded"
    finally:
        assert d.stop() == 0
    return context, est.kv_bytes_per_token, est.kv_tokens


def reported(d: Daemon, client: object, name: str, loaded: bool) -> int:
    """The context every route reports, checked to be one number: OpenAI's GET /v1/models/{id}, Ollama's /api/show
    (model_info's `<arch>.context_length`) and, once loaded, /api/ps and /api/status (the dashboard's and `mlxsup
    status`'s), the first two read through the openai and ollama clients."""
    import ollama

    context = (client.models.retrieve(name).model_extra or {})["context_length"]  # type: ignore[attr-defined]
    ollama_client = ollama.Client(host=d.url, timeout=120)
    reports = {"openai": context, "ollama show": (ollama_client.show(name).modelinfo or {})["llama.context_length"]}
    if loaded:
        reports["ollama ps"] = next(m.context_length for m in ollama_client.ps().models if m.model == f"{name}:latest")
        reports["status"] = d.model(name)["context_length"]
    assert set(reports.values()) == {context}, reports
    return context


def test_the_published_context_is_what_fits_at_the_model_s_kv_bits(models: Path, tmp_path: Path) -> None:
    full, per_token, first = published(models, "kv32", 0, tmp_path / "full")
    assert abs(full - N) < BLOCK
    eight, _, _ = published(models, "kv32", 8, tmp_path / "eight")
    at_8 = kv_bytes_at(per_token, 4, 8, 32)
    fits = (N * per_token + first * (per_token - at_8)) // at_8  # the first request's K/V counted at 8 bits too
    assert abs(eight - fits) < BLOCK and eight > 2 * N  # float32 K/V: 8 bits hold ~3.2x the tokens
    kept, _, _ = published(models, "tiny", 8, tmp_path / "kept")  # not quantized by its worker: counted back
    assert abs(kept - N) < BLOCK
