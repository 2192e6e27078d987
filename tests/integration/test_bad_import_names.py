"""Hostile `mlxsup import --name` values through the command line's own parser and checks (test_bad_input.py's fuzz,
for the one command that writes where a name says).

The documented rule (supervisor/cli/importer.py, README's `mlxsup import`): a model name is one folder name of 1 to
128 characters, ASCII letters, digits, `_`, `.` and `-`, that starts with a letter, a digit or `_`. Every name is
sent with `--force`. One the rule refuses gets exit 2 and one `mlxsup: --name ...` line, and the converter is never
started; one it takes starts the converter on exactly DIR/NAME, a direct child of the model folder. Nothing on disk
changes either way (the converter is a stand-in here: tests/families/test_import_names.py runs the real one).
"""

from __future__ import annotations

import os
import random
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from supervisor.cli import importer
from supervisor.cli.commands import main

RULE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
PIECES = ["..", ".", "/", "\\", "\0", " ", "\t", "\n", "~", "$HOME", "*", "?", ":", "%2F", "C:", "-", "_", "a", "Z",
          "9", "models", "kept-model", "é", "\u202e", "\u2215", "\uff0e", "\udc80", "'", '"', "`", ";", "|", "x" * 60]


def hostile_names(root: Path) -> list[str]:
    fixed = [".", "..", "../x", "../../x", "a/b", "a\\b", "/", "//", "./kept-model", "kept-model/", ".hidden",
             "..hidden", "-rf", "--force", "", " ", "a\0b", "\0", "x" * 129, "é", "model\n", "C:\\x", "~", "~/x",
             str(root), str(root / "models"), str(root / "sibling"), str(root / "models" / "kept-model"),
             "/etc/passwd", "%2e%2e", "\uff0e\uff0e", "a\u2215b", "link-out"]
    rnd = random.Random(48)
    fuzzed = ["".join(rnd.choice(PIECES) for _ in range(rnd.randint(1, 6))) for _ in range(300)]
    return fixed + fuzzed


def tree(root: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = (("link", os.readlink(p)) if p.is_symlink() else ("dir",) if p.is_dir()
                                             else p.read_bytes())
    return out


@pytest.fixture
def world(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    models = root / "models"
    (models / "kept-model").mkdir(parents=True)
    (models / "kept-model" / "config.json").write_text('{"model_type": "llama"}')
    (models / "kept-model" / "model.safetensors").write_bytes(b"kept weights")
    (models / "notes.txt").write_text("my notes")
    (root / "parent-note.txt").write_text("the parent's own file")
    (root / "sibling").mkdir()
    (root / "sibling" / "keep.txt").write_text("a sibling's file")
    (models / "link-out").symlink_to(root / "sibling")
    (tmp_path / "m.gguf").write_bytes(b"GGUF not really")
    return root


def test_hostile_import_names_are_refused_before_anything_starts(world: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture) -> None:
    models = world / "models"
    started: list[list[str]] = []

    def converter(argv: list[str], *a, **kw) -> subprocess.CompletedProcess:
        started.append(argv)
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(importer, "subprocess", SimpleNamespace(run=converter))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(world.parent / "no-config"))
    before = tree(world.parent)
    problems = []
    names = hostile_names(world)
    for name in names:
        started.clear()
        code = main(["import", str(world.parent / "m.gguf"), "--model-dir", str(models), f"--name={name}", "--force"])
        err = capsys.readouterr().err
        if RULE.fullmatch(name) and name != "link-out":
            out = Path(started[0][4]) if len(started) == 1 else None
            if code != 0 or out is None or out != models.resolve() / name or out.parent != models.resolve():
                problems.append(f"{name!r}: a good name, yet {code=} {err=} started={started}")
        elif code != 2 or started or len(err.splitlines()) != 1 or not err.startswith("mlxsup: --name "):
            problems.append(f"{name!r}: {code=} {err=} started={started}")
    assert not problems, f"{len(problems)} of {len(names)} names:\n" + "\n".join(problems[:15])
    assert tree(world.parent) == before
    assert sum(1 for n in names if not RULE.fullmatch(n)) > 250  # the fuzz is mostly hostile


def test_the_default_name_of_any_file_name_keeps_the_rule() -> None:
    rnd = random.Random(7)
    for _ in range(2000):
        stem = "".join(rnd.choice(PIECES) for _ in range(rnd.randint(0, 8))).replace("/", "").replace("\0", "")
        name = importer.default_name(Path(stem + ".gguf"))
        assert RULE.fullmatch(name), (stem, name)
    assert importer.default_name(Path("x" * 300 + ".gguf")) == "x" * 128
