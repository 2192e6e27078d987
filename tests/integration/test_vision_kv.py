"""A vision model's running K/V quantized (`kv_bits`, issue 53): Gemma 3's full-attention layers hold QuantizedKV
(its sliding layers rotate at full precision), and an image request's greedy ids are the same alone, again from the
hot cache, and beside another image's request in the batch. Qwen-VL's M-RoPE cache (RopeKVCache) stays full
precision. Real MLX on the CPU, make-model's tiny vision models with a head dimension of 32."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("mlx_vlm")

from tests.integration.test_vision import ask, picture, run


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from worker.mlx_engine.make_model import FAMILIES, make_model

    paths = {}
    for arch in ("gemma3_vl", "qwen3_vl"):
        presets = FAMILIES[arch].presets
        presets["kv32"] = {**presets["tiny"], "head_dim": 32}
        paths[arch] = tmp_path_factory.mktemp(arch) / "m"
        try:
            make_model(paths[arch], "kv32", arch=arch)
        finally:
            del presets["kv32"]
    return paths


@pytest.mark.parametrize("arch", ["gemma3_vl", "qwen3_vl"])
def test_an_image_request_gives_the_same_ids_alone_cached_and_batched(made: dict[str, Path], arch: str) -> None:
    from worker.mlx_engine.prompt_cache import CacheOptions
    from worker.mlx_engine.vision import vision_engine

    engine = vision_engine(made[arch], max_batch_size=4, cache=CacheOptions(hot_bytes=64 * 2**20, block_tokens=8,
                                                                             snapshot_every=8, kv_bits=8))
    try:
        kinds = {type(c).__name__ for c in engine.model.make_cache()}
        assert ("QuantizedKV" in kinds) == (arch == "gemma3_vl") and (engine.kv_group == 32) == (arch == "gemma3_vl")
        alone = run(engine, ask("a", picture(1)))["a"]
        assert len(alone) > 0
        assert run(engine, ask("b", picture(1)))["b"] == alone  # from the hot cache
        both = run(engine, ask("c", picture(2)), ask("d", picture(1)))
        assert both["d"] == alone and both["c"] != alone
    finally:
        engine.settle()
