"""The batch-shape warm-up (issue 15): run a step at a time while the engine is idle (after Ready), it runs
every generation batch size within a time budget, waits while a request is in flight, and greedy output is
still token for token mlx-lm's in one process.

Real MLX on the CPU, the tiny model, the product's Engine driven by submit/step (no sockets).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm import load, stream_generate

from protocol.messages import Submit
from worker.mlx_engine.engine import Engine
from worker.mlx_engine.warmup import wants_warm_up

PROMPTS = [[5, 9, 17, 33, 2, 41], [7] * 12, [100, 200, 300], list(range(10, 60))]
MAX_TOKENS = 12


def engine_tokens(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy ids the engine generates for `prompts`, all in one batch."""
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for i, ids in enumerate(prompts):
        engine.submit(Submit(rid=f"r{i}", max_tokens=MAX_TOKENS, prompt_ids=ids, temperature=0.0))
    while len(engine):
        chunks, finished = engine.step()
        for chunk in chunks:
            got[chunk[0]] += chunk[3]
        for f in finished:
            got[f.rid] += f.token_ids
    return [got[f"r{i}"] for i in range(len(prompts))]


def reference_tokens(model_path: Path, prompts: list[list[int]]) -> list[list[int]]:
    model, tok = load(str(model_path))
    out = []
    for ids in prompts:
        responses = list(stream_generate(model, tok, ids, max_tokens=MAX_TOKENS))
        tokens = [r.token for r in responses]
        out.append(tokens[:-1] if responses[-1].finish_reason == "stop" else tokens)  # the EOS is not output
    return out


def test_warm_up_runs_every_batch_size_and_greedy_output_stays_mlx_lms(model_dir: Path) -> None:
    engine = Engine(model_dir / "tiny", max_batch_size=16, prefill_batch_size=4, warm="on", warm_budget_s=120)
    warmed = engine.warmed
    assert warmed is not None and warmed.steps == 0  # nothing before Ready: the worker loop runs it when idle
    assert engine.graph is not None and engine.graph.warm_s is None
    assert engine.warm_step() and engine.graph.warm_s is not None  # first a solo's compiled step, traced
    assert engine.warm_step() and warmed.steps == 1
    engine.submit(Submit(rid="busy", max_tokens=3, prompt_ids=PROMPTS[0], temperature=0.0))
    assert engine.warm_step() and warmed.steps == 1  # a request in flight: it waits
    while len(engine):
        engine.step()
    while engine.warm_step():
        pass
    assert warmed.complete and engine.warmer is None  # over: the scratch generator is closed
    assert set(range(1, 17)) <= warmed.decode_sizes  # every generation batch size the engine can form
    assert warmed.arrivals_per_step == [1, 2, 3, 4]  # arrivals of 1..prefill_batch_size per step
    assert len(engine) == 0 and engine.batch_size() == 0  # its own generator untouched
    assert engine_tokens(engine, PROMPTS) == reference_tokens(model_dir / "tiny", PROMPTS)


def test_warm_up_stops_at_its_budget_and_is_off_on_the_cpu_unless_asked(model_dir: Path) -> None:
    engine = Engine(model_dir / "tiny", max_batch_size=32, warm="on", warm_budget_s=0.0)
    assert engine.warm_step()  # the decode graph's trace
    assert not engine.warm_step()  # the budget is spent by the batch shapes' first step
    assert engine.warmed is not None and not engine.warmed.complete and engine.warmed.steps == 1
    assert engine_tokens(engine, PROMPTS[:2]) == reference_tokens(model_dir / "tiny", PROMPTS[:2])
    assert not wants_warm_up("auto")  # MLX runs on the CPU here: nothing is built per shape
    assert not wants_warm_up("off") and wants_warm_up("on")
    with pytest.raises(ValueError):
        wants_warm_up("sometimes")
