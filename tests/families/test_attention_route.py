"""With short prefills' attention routed unfused (worker/mlx_engine/attention.py, on by default on CUDA), every
family generates the tokens it generates with MLX's fused attention (issue 15).

Real MLX on the CPU, each family's tiny model, the product's Engine: a request alone (its prefill's mask is
"causal") and then three together with prompts of different lengths (a batch prefill, its mask an array that
hides each prompt's left padding), greedy, under both settings.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest

from protocol.messages import Submit
from tests.families.conftest import MODELS
from worker.mlx_engine import attention
from worker.mlx_engine.engine import Engine

PROMPTS = {"a": [(i * 7919) % 200 + 20 for i in range(23)], "b": [(i * 104729) % 180 + 30 for i in range(9)],
           "c": [(i * 31) % 150 + 25 for i in range(40)]}


@pytest.fixture(autouse=True)
def fast_after() -> Iterator[None]:
    yield
    attention.install("fast")


def generate(path: Path, mode: str) -> dict[str, list[int]]:
    engine = Engine(path, attention=mode)
    assert engine.attention_routed == (mode == "routed")
    got: dict[str, list[int]] = {}
    for wave in (["a"], ["a", "b", "c"]):
        for rid in wave:
            engine.submit(Submit(rid=f"{rid}{len(wave)}", max_tokens=12, prompt_ids=PROMPTS[rid], temperature=0.0,
                                 ignore_eos=True))
        while len(engine):
            chunks, finished = engine.step()
            for chunk in chunks:
                got.setdefault(chunk[0], []).extend(chunk[3])
            for f in finished:
                got.setdefault(f.rid, []).extend(f.token_ids)
    return got


@pytest.mark.parametrize("name", [m.name for m in MODELS])
def test_routed_attention_generates_what_fused_does(family_models: Path, name: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = family_models / name
    unfused = attention.unfused_attention
    calls: list[tuple] = []
    monkeypatch.setattr(attention, "unfused_attention", lambda q, *a: calls.append(q.shape) or unfused(q, *a))
    fused = generate(path, "fast")
    assert not calls
    routed = generate(path, "routed")
    assert routed == fused and all(len(v) == 12 for v in routed.values())
    assert any(shape[0] == 1 for shape in calls) and any(shape[0] == 3 for shape in calls)  # the solo's, the batch's
    assert mx.fast.scaled_dot_product_attention is attention.routed_attention
