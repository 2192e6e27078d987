"""docs/architecture.md names every room: each Python module under protocol/, supervisor/ and worker/ that exists when
the test runs, by its path from the repository root (its line in *Every room, by folder*), and no module that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("protocol", "supervisor", "worker")


def _modules() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for top in PACKAGES for p in (ROOT / top).rglob("*.py")
                  if "__pycache__" not in p.parts)


def test_every_module_has_its_line() -> None:
    doc = DOC.read_text()
    missing = [m for m in _modules() if f"`{m}`" not in doc]
    assert not missing, f"docs/architecture.md does not name (add a line under 'Every room, by folder'): {missing}"


def test_every_module_line_names_a_module_that_exists() -> None:
    doc = DOC.read_text()
    named = re.findall(r"^- `((?:protocol|supervisor|worker)/[^`]+\.py)`:", doc, flags=re.M)
    assert len(named) == len(set(named)), "a module has two lines"
    gone = sorted(set(named) - set(_modules()))
    assert not gone, f"docs/architecture.md has lines for modules that are gone: {gone}"
