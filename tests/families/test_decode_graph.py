"""A solo's compiled decode steps give mlx-lm's greedy tokens in every family it takes (issue 15).

Real MLX on the CPU, each family's tiny model, the product's Engine driven by submit/step. The
graph (worker/mlx_engine/decode_graph.py) must be what decodes where the family's caches allow it,
its tokens must be mlx_lm.generate_step's across capacity steps (the buffers grow and the step
is traced again), and the cache it hands back must continue as an uncompiled one would: a second
request that arrives mid-decode moves the solo into the batch, with nothing lost or repeated.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from protocol.messages import Submit
from tests.families.conftest import MODELS
from worker.mlx_engine.decode_graph import DecodeGraph, capacity_for
from worker.mlx_engine.engine import Engine

PROMPT = [(i * 7919) % 200 + 20 for i in range(40)]
COMPILED = {"llama", "qwen3", "qwen3_moe", "qwen3_5", "qwen3-4bit", "qwen3_5-4bit"}  # KVCache and ArraysCache only


def reference(path: Path, ids: list[int], n: int) -> list[int]:
    """mlx-lm's greedy tokens, EOS ignored (stream_generate's loop without its stop)."""
    model, _ = load(str(path))
    return [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]


def run(engine: Engine, got: dict[str, list[int]], until: int | None = None, rid: str = "a") -> None:
    while len(engine) and (until is None or len(got.get(rid, [])) < until):
        chunks, finished = engine.step()
        for chunk in chunks:
            got.setdefault(chunk[0], []).extend(chunk[3])
        for f in finished:
            got.setdefault(f.rid, []).extend(f.token_ids)


@pytest.mark.parametrize("name", [m.name for m in MODELS])
def test_the_graph_decodes_where_the_caches_allow_and_matches_mlx_lm(family_models: Path, name: str) -> None:
    path = family_models / name
    engine = Engine(path)
    assert DecodeGraph.fits(prefilled(engine)) == (name in COMPILED)
    n = 150  # past several capacities: grown and traced again at 64, 128 and 192 positions
    engine.submit(Submit(rid="a", max_tokens=n, prompt_ids=PROMPT, temperature=0.0, ignore_eos=True))
    got: dict[str, list[int]] = {}
    run(engine, got, until=3)
    solo = engine._solo
    assert solo is not None and (solo._state is not None) == (name in COMPILED)
    run(engine, got)
    assert got["a"] == reference(path, PROMPT, n)
    if name in COMPILED:
        assert solo._state is not None and solo._state.keys[0].shape[2] == capacity_for(len(PROMPT) + n) == 192


def prefilled(engine: Engine) -> list:
    cache = make_prompt_cache(engine.model)
    engine.model(mx.array([PROMPT[:4]]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


@pytest.mark.parametrize("name", sorted(COMPILED - {"qwen3-4bit", "qwen3_5-4bit"}))
def test_a_second_request_takes_the_graph_s_cache_into_the_batch(family_models: Path, name: str) -> None:
    path = family_models / name
    engine = Engine(path)
    engine.submit(Submit(rid="a", max_tokens=24, prompt_ids=PROMPT, temperature=0.0, ignore_eos=True))
    got: dict[str, list[int]] = {}
    run(engine, got, until=10)
    assert engine._solo is not None and engine._solo._state is not None
    other = PROMPT[::-1][:12]
    engine.submit(Submit(rid="b", max_tokens=8, prompt_ids=other, temperature=0.0, ignore_eos=True))
    assert engine._solo is None  # in the batch now, from the graph's cache
    run(engine, got)
    assert got["a"] == reference(path, PROMPT, 24)
    assert got["b"] == reference(path, other, 8)


def test_capacities_step_by_64_then_by_a_sixteenth_to_an_eighth_of_the_fill() -> None:
    assert [capacity_for(n) for n in (1, 64, 65, 1000, 1024, 1025, 5000)] == [64, 64, 128, 1024, 1024, 1152, 5120]
    for n in range(1, 20000, 37):
        c = capacity_for(n)
        assert n <= c and c - n < max(64, n // 8)  # at most this many masked positions read
