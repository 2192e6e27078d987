"""The running K/V cache quantized (`kv_bits`, issue 53): one quantized cache, the same greedy ids on every path.

Real MLX on the CPU, the families' tiny models with a head dimension of 32 (the tiny preset's 16 takes no MLX
quantization group), the product's Engine driven by submit/step. With kv_bits 8 and 4 the attention layers'
running cache is a QuantizedKV (a sliding window's and a recurrent layer's stay as they are; gpt-oss's attention
sinks keep it full precision), and a request's greedy ids are the same alone (the solo), in the batch (joined by
another request), with drafting on, after a hot hit and an SSD hit (the blocks are the running cache's quantized
rows, restored as they are) and resumed after some of its tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.families.test_speculative import FREE, PROMPT, drive, greedy, partly_wrong, run
from worker.mlx_engine.engine import Engine
from worker.mlx_engine.prompt_cache import CacheOptions
from worker.mlx_engine.quantized_kv import BatchQuantizedKVCache, QuantizedKV
from worker.mlx_engine.speculative import Oracle, Speculation

NAMES = ("llama", "gemma3", "qwen3_5")
OTHER = [5, 9, 17, 33, 2, 41, 8, 11, 70, 3]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.mlx_engine.make_model import FAMILIES, make_model

    root = tmp_path_factory.mktemp("kv32")
    for name in (*NAMES, "gpt_oss"):
        presets = FAMILIES[name].presets
        tiny = presets["tiny"]
        presets["kv32"] = {**tiny, "head_dim": 32} if "head_dim" in tiny else {
            **tiny, "num_attention_heads": 2, "num_key_value_heads": 1}
        try:
            make_model(root / name, "kv32", seed=0, arch=name)
        finally:
            del presets["kv32"]
    return root


def engine(path: Path, bits: int | None, **kw: object) -> Engine:
    options = CacheOptions(**({"hot_bytes": 1 << 28, "kv_bits": bits} | kw))  # type: ignore[arg-type]
    return Engine(path, cache=options)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("name", NAMES)
def test_the_quantized_cache_gives_the_same_ids_on_every_path(models: Path, tmp_path: Path, name: str, bits: int,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    path = models / name
    solo = engine(path, bits, ssd_root=tmp_path)
    assert solo.kv_group == 32
    kinds = {type(c).__name__ for c in solo.model.make_cache()}
    assert QuantizedKV.__name__ in kinds and "KVCache" not in kinds  # every full-attention layer
    expected, fin = run(solo, greedy(n=40))
    assert len(expected) == 40 and fin is not None and fin.cached_tokens == 0

    hot, fin = run(solo, greedy(rid="hot", n=40))  # the blocks it stored: the running cache's rows
    assert hot == expected and fin is not None and fin.cached_tokens >= 64
    assert fin.cached_tokens == len(PROMPT) - 1 or name != "llama"  # its partial last block too, quantized

    ssd = engine(path, bits, hot_bytes=0, ssd_root=tmp_path)  # a new worker: only the SSD tier has them
    got, fin = run(ssd, greedy(rid="ssd", n=40))
    assert got == expected and fin is not None and fin.cached_tokens >= 64

    batch = engine(path, bits)  # joined by another request mid-prefill: the rest is the batch's
    batch.submit(greedy(rid="a", n=40))
    batch.step()
    batch.submit(greedy(rid="b", prompt=OTHER, n=10))
    got_all: dict[str, list[int]] = {}
    drive(batch, "a", got=got_all)
    assert got_all["a"] == expected and len(got_all["b"]) == 10
    assert "failed" not in caplog.text  # the batch rows' prefill checkpoints read the quantized rows too
    assert any(isinstance(c, BatchQuantizedKVCache) for c in batch.gen._generation_batch.prompt_cache) or not len(
        batch.gen._generation_batch)

    for cut in (1, 13):  # resumed after `cut` of its tokens: they join the prompt, prefilled into the quantized cache
        got, _ = run(engine(path, bits), greedy(rid="r", n=40 - cut, resume_tokens=expected[:cut]))
        assert got == expected[cut:]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("name", NAMES)
def test_drafting_rolls_the_quantized_cache_back_to_plain_decoding_s_ids(models: Path, name: str, bits: int) -> None:
    """An oracle with every fifth token wrong: drafts are rejected at known places and trimmed out of the
    QuantizedKV (a sliding window or recurrent layers: marked and fed again), in the solo and in the batch's
    lockstep drafting (BatchQuantizedKVCache trimmed, rows shifted)."""
    plain = Engine(models / name, cache=CacheOptions(kv_bits=bits))
    expected, _ = run(plain, greedy(n=40))
    other = greedy(rid="b", prompt=PROMPT[5:], n=40)
    expected_b, _ = run(plain, other)
    e = Engine(models / name, cache=CacheOptions(kv_bits=bits))
    e.speculation = Speculation("oracle", 4, oracle=partly_wrong(PROMPT + expected, len(PROMPT)))
    e.speculation.pricing.costs = e.batch_drafts.costs = FREE
    got, fin = run(e, greedy(n=40))
    assert got == expected and fin is not None and 0 < fin.accepted_tokens < fin.drafted_tokens

    e.submit(greedy(rid="a", n=40))
    got_all: dict[str, list[int]] = {}
    drive(e, "a", until=3, got=got_all)
    e.submit(other)
    drive(e, "b", until=1, got=got_all)
    e.batch_drafts.rows[e._by_rid["b"].uid].drafter = Oracle(partly_wrong(PROMPT[5:] + expected_b, len(PROMPT) - 5))
    finished = []
    while len(e):
        chunks, done = e.step()
        for chunk in chunks:
            got_all.setdefault(chunk[0], []).extend(chunk[3])
        for f in done:
            got_all.setdefault(f.rid, []).extend(f.token_ids)
        finished += done
    assert got_all["a"] == expected and got_all["b"] == expected_b
    fin_b = next(f for f in finished if f.rid == "b")
    assert 0 < fin_b.accepted_tokens < fin_b.drafted_tokens  # b drafted in the batch only, and some were rejected


def test_attention_sinks_keep_the_running_cache_full_precision(models: Path) -> None:
    e = engine(models / "gpt_oss", 8)
    assert e.kv_group is None and QuantizedKV.__name__ not in {type(c).__name__ for c in e.model.make_cache()}
    got, _ = run(e, greedy(n=10))
    assert len(got) == 10


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_a_quantized_solo_decodes_in_the_compiled_graph(models: Path, name: str) -> None:
    """decode_graph.py holds QuantizedKV layers as (weights, scales, biases) buffers: the solo's steps replay the
    graph (the parity above is then compiled solo against the uncompiled batch)."""
    e = engine(models / name, 8)
    got, _ = run(e, greedy(n=6), until=3)
    solo = e._solo
    assert len(got) >= 3 and solo is not None and solo._state is not None
    assert isinstance(solo._state.keys[0], tuple) and len(solo._state.keys[0]) == 3


def test_a_quantized_solo_never_builds_ahead_and_gives_the_same_ids(models: Path) -> None:
    """`--solo ahead` (auto on CUDA) builds a solo's next graph ahead only on caches that are all KVCache, whose undo
    is tested (solo.py): a quantized running cache decodes plain, its ids the plain solo's."""
    path = models / "llama"
    expected, _ = run(engine(path, 8), greedy(n=12))
    e = Engine(path, cache=CacheOptions(hot_bytes=1 << 28, kv_bits=8), solo="ahead")
    assert e.lane.ahead is not None
    e.submit(greedy(n=12))
    got: dict[str, list[int]] = {}
    drive(e, "a", until=2, got=got)
    assert e._solo is not None and e._solo.decoding and e._solo.ahead is None
    drive(e, "a", got=got)
    assert got["a"] == expected
