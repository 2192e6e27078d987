"""The README's two set-up commands: one serves the demo with what serving needs, one runs the tests (and is CI's).

What `.[cpu]` pulls is read offline: pyproject.toml's dependencies and cpu extra, then each package's own
requirements from its installed metadata (this venv has them all: the test command installs `.[cpu,test]`), the
markers evaluated for this platform and no extras. `pip install --dry-run --report` says the same but takes ~40 s and
the network. And the demo's first start, its import, says what each step is doing for as long as it runs.
"""

from __future__ import annotations

import re
import time
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
# what only the tests use: none of it may come with the demo's install
TEST_ONLY = {"pytest", "playwright", "litellm", "langchain-openai", "langchain-core", "mypy", "ruff", "openai",
             "anthropic", "openai-agents", "jsonschema", "pillow", "greenlet", "tiktoken"}


def setup_commands() -> list[str]:
    section = re.search(r"^## Set-up\n(.*?)^## ", README, re.S | re.M)
    assert section, "README.md has no '## Set-up' section"
    return [block.strip() for block in re.findall(r"```sh\n(.*?)```", section.group(1), re.S)
            if "python3 -m venv" in block]


def closure(roots: list[Requirement]) -> set[str]:
    """The distributions `roots` pull, by their installed metadata (the root's own extras already applied)."""
    seen: set[tuple[str, str]] = set()  # (distribution, extra): `mlx[cpu]` pulls what mlx's cpu extra names
    todo = list(roots)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        extras = ["", *sorted(req.extras)]
        if all((name, e) in seen for e in extras):
            continue
        seen.update((name, e) for e in extras)
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:  # another platform's (mlx-metal on a Mac): nothing to follow here
            continue
        for line in requires:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras):
                todo.append(sub)
    return {name for name, _ in seen}


def demo_requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"]["cpu"]]]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": "cpu"})]


def test_the_demo_install_pulls_what_serving_needs_and_no_test_package() -> None:
    pulled = closure(demo_requirements())
    print(f"`pip install -e '.[cpu]'` pulls {len(pulled)} packages: {', '.join(sorted(pulled))}")
    assert not pulled & TEST_ONLY, sorted(pulled & TEST_ONLY)
    assert {"mlx", "mlx-lm", "uvicorn", "starlette", "gguf", "huggingface-hub"} <= pulled
    assert len(pulled) < 80  # 51 here, and mlxsup: pip's dry run says 52; `.[cpu,test]` some 120 by this count


def test_the_readme_has_two_set_up_commands_the_demo_s_light_and_ci_s_verbatim() -> None:
    demo, tests = setup_commands()
    assert demo.endswith("mlxsup serve --demo") and "-e '.[cpu]'" in demo and "test" not in demo
    assert "-e '.[cpu,test]'" in tests and tests.endswith("python -m pytest")
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert tests in ci, ".ci/run must run the README's test command verbatim"


def test_an_import_step_that_runs_long_says_so_until_it_ends(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The demo's first start took 4 min 20 s on a loaded machine: each step says it is still running."""
    from worker.mlx_engine import gguf_import

    monkeypatch.setattr(gguf_import, "TICK_S", 0.05)
    progress = gguf_import.Progress()
    progress.stage("reading the file (94 MiB)")
    time.sleep(0.3)
    progress.finish("done: here")
    time.sleep(0.2)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith("] reading the file (94 MiB)") and lines[-1].endswith("] done: here"), lines
    assert len([line for line in lines if line.endswith("] ... still reading the file (94 MiB)")]) >= 2, lines
    assert all(re.match(r"\[ *\d+\.\ds\] ", line) for line in lines), lines


def test_an_import_that_fails_stops_saying_it_is_still_running(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A failed import in a long-lived process (a test run, a caller's) once left its ticker printing "... still" for
    the rest of the process, into the next import's lines."""
    import threading

    from worker.mlx_engine import gguf_import

    monkeypatch.setattr(gguf_import, "TICK_S", 0.05)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(gguf_import.GGUFImportError, match="not a GGUF file"):
        gguf_import.import_gguf(bad, tmp_path / "out")
    for t in [t for t in threading.enumerate() if t.name == "import-progress"]:
        t.join(timeout=60)  # it ends at its next wake-up (TICK_S): the bound only keeps a hang from hanging
        assert not t.is_alive()
    capsys.readouterr()
