"""The architecture families' tiny models, made once per session by `make-model`'s own code.

`family_models` is a folder of model folders named after what they are (`qwen3`, `qwen3_5-4bit`...),
made in this process (one MLX import instead of one per model); the command line itself is
tested on its own in test_make_model.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Made:
    name: str
    arch: str
    quantize: int | None = None


# Every family in its tiny preset, and quantized variants of the two Qwen families (and of gpt-oss, whose
# router keeps 8 bits under its own quantization predicate).
MODELS = [Made("llama", "llama"), Made("qwen3", "qwen3"), Made("qwen3_moe", "qwen3_moe"), Made("gemma3", "gemma3"),
          Made("gpt_oss", "gpt_oss"), Made("qwen3_5", "qwen3_5"), Made("qwen3-4bit", "qwen3", 4),
          Made("qwen3_5-4bit", "qwen3_5", 4), Made("gpt_oss-4bit", "gpt_oss", 4)]
BY_NAME = {m.name: m for m in MODELS}


@pytest.fixture(scope="session")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.mlx_engine.make_model import make_model

    root = tmp_path_factory.mktemp("families")
    for m in MODELS:
        make_model(root / m.name, "tiny", seed=0, arch=m.arch, quantize=m.quantize)
    return root
