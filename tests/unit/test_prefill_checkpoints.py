"""A prompt's prefill leaves its blocks to the prompt caches as it computes them (issue 47): a request aborted
mid-prefill (its client left) and sent again picks up from its last whole block, and its output is the one it would
have had. Real MLX on the CPU, the tiny model, the product's Engine driven by submit/step; in the batch (two prompts
of different lengths: padded rows) and as the solo."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.messages import Submit
from tests.unit.test_solo import collect, reference  # noqa: F401 (reference: a fixture)
from worker.mlx_engine.engine import Engine
from worker.mlx_engine.prompt_cache import CacheOptions

BLOCK = 16
PROMPT = [(i * 7919) % 1000 + 3 for i in range(300)]
SHORTER = [(i * 104729) % 1000 + 3 for i in range(170)]


def engine_of(model_dir: Path) -> Engine:
    return Engine(model_dir / "tiny", cache=CacheOptions(hot_bytes=1 << 28, block_tokens=BLOCK), prefill_step_size=24)


def submit(engine: Engine, rid: str, ids: list[int], max_tokens: int = 8) -> None:
    engine.submit(Submit(rid=rid, max_tokens=max_tokens, prompt_ids=ids, temperature=0.0))


def step_until_mid_prefill(engine: Engine, rid: str, blocks: int) -> int:
    """Step until `rid` has prefilled at least `blocks` blocks but not all its prompt; its position then."""
    for _ in range(200):
        engine.step()
        req = engine._by_rid[rid]
        if req.position >= blocks * BLOCK:
            assert req.prefill_left > 0, "the prompt was prefilled whole before the test could abort it"
            return req.position
    raise AssertionError("no prefill progress in 200 steps")


@pytest.mark.parametrize("lane", ["batch", "solo"])
def test_a_prompt_aborted_mid_prefill_is_picked_up_from_its_last_block(model_dir: Path, reference, lane: str) -> None:  # noqa: F811
    engine = engine_of(model_dir)
    submit(engine, "a", PROMPT)
    if lane == "batch":
        submit(engine, "b", SHORTER, 4)  # a second prompt, shorter: the batch, its rows padded
    assert (engine.lane.solo is not None) == (lane == "solo")
    position = step_until_mid_prefill(engine, "a", 5)
    # checkpointed while it runs: the caches hold its whole blocks so far
    assert engine.caches is not None and engine.caches.lookup(PROMPT)[0] >= position // BLOCK * BLOCK - BLOCK
    engine.abort("a")  # its client left
    engine.abort("b")
    submit(engine, "retry", PROMPT)
    ids, done = [], []
    while len(engine):
        chunks, finished = engine.step()
        ids += [i for c in chunks for i in c[3]]
        done += finished
    ids += done[0].token_ids
    assert ids == reference(PROMPT, 8)  # the blocks kept are the ones it would have computed
    assert done[0].cached_tokens >= position // BLOCK * BLOCK  # nothing the first attempt computed was lost


def test_checkpointed_blocks_serve_another_prompt_with_the_same_head(model_dir: Path, reference) -> None:  # noqa: F811
    engine = engine_of(model_dir)
    submit(engine, "a", PROMPT)
    submit(engine, "b", SHORTER, 4)
    step_until_mid_prefill(engine, "a", 8)
    head = PROMPT[:8 * BLOCK] + [7, 7, 7]
    cached, _ = engine.caches.lookup(head) if engine.caches is not None else (0, None)
    assert cached == 8 * BLOCK
    collect(engine, {})
