"""`mlxsup import --name NAME [--force]` writes one model folder, a direct child of the model folder, and nothing else.

A name is one plain folder name (supervisor/cli/importer.py: NAME_RULE); any other (`.`, `..`, an absolute path,
`../x`, `a/b`, a link out of the model folder) is refused with exit 2 before anything is read or written.
`--force` replaces only a model folder (or an empty one), never a folder of other things, and the replacement is a
swap: a failed import leaves the old model as it was. Every test snapshots the whole tree around the model folder
(its parent, a sibling folder, another model, notes) and proves that only the named target changed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.families.test_gguf_import import write_gguf
from worker.mlx_engine import gguf_import
from worker.mlx_engine.make_model import make_model

MLXSUP = [sys.executable, "-m", "supervisor"]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gguf")
    make_model(root / "made", "tiny", seed=0, arch="llama")
    write_gguf(root / "made", root / "m.gguf", {})
    return root / "m.gguf"


def tree(root: Path) -> dict[str, object]:
    """Every entry under root: a file's bytes, a link's target, a folder as 'dir' (links are not followed)."""
    out: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            out[rel] = ("link", os.readlink(p)) if p.is_symlink() else ("dir",) if p.is_dir() else p.read_bytes()
    return out


@pytest.fixture
def world(tmp_path: Path) -> Path:
    """root/ (DIR's parent, with a note), root/models/ (DIR: notes, another model, a non-model folder),
    root/sibling/ (a folder beside DIR) and root/outside-model/ (a model folder outside DIR)."""
    root = tmp_path / "root"
    models = root / "models"
    (models / "kept-model").mkdir(parents=True)
    (models / "kept-model" / "config.json").write_text('{"model_type": "llama"}')
    (models / "kept-model" / "model.safetensors").write_bytes(b"kept weights")
    (models / "notes.txt").write_text("my notes")
    (models / "papers").mkdir()
    (models / "papers" / "draft.md").write_text("a draft")
    (root / "parent-note.txt").write_text("the parent's own file")
    (root / "sibling").mkdir()
    (root / "sibling" / "keep.txt").write_text("a sibling's file")
    (root / "outside-model").mkdir()
    (root / "outside-model" / "config.json").write_text('{"model_type": "llama"}')
    (root / "outside-model" / "model.safetensors").write_bytes(b"outside weights")
    (models / "link-out").symlink_to(root / "outside-model")
    return root


def mlxsup_import(gguf: Path, models: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CONFIG_HOME": str(models.parent / ".no-config")}
    env = {k: v for k, v in env.items() if not k.startswith("MLXSUP_")}
    return subprocess.run([*MLXSUP, "import", str(gguf), "--model-dir", str(models), *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=cwd)


def one_clear_line(run: subprocess.CompletedProcess) -> str:
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert "Traceback" not in run.stderr, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr  # refused before the import started: no progress lines either
    return lines[0]


HOSTILE = [".", "..", "../x", "a/b", "a\\b", "./kept-model", "kept-model/", ".hidden", "", "-rf", "x" * 129]


@pytest.mark.parametrize("name", HOSTILE, ids=repr)
def test_a_name_that_is_not_one_plain_folder_name_is_refused_and_nothing_is_touched(
        gguf_file: Path, world: Path, name: str) -> None:
    before = tree(world.parent)
    line = one_clear_line(mlxsup_import(gguf_file, world / "models", f"--name={name}", "--force"))
    assert line.startswith("mlxsup: --name ") and "is not a model name" in line, line
    assert "--force" not in line  # nothing to force
    assert tree(world.parent) == before


def test_an_absolute_name_is_refused_and_the_folder_it_names_is_untouched(gguf_file: Path, world: Path) -> None:
    before = tree(world.parent)
    for target in (world / "sibling", world / "models", world / "outside-model"):
        line = one_clear_line(mlxsup_import(gguf_file, world / "models", "--name", str(target), "--force"))
        assert "is not a model name" in line, line
    assert tree(world.parent) == before


def test_a_link_out_of_the_model_folder_is_never_followed_or_replaced(gguf_file: Path, world: Path) -> None:
    before = tree(world.parent)
    line = one_clear_line(mlxsup_import(gguf_file, world / "models", "--name", "link-out", "--force"))
    assert "symbolic link" in line, line
    assert tree(world.parent) == before


def test_force_never_replaces_a_folder_that_is_not_a_model(gguf_file: Path, world: Path) -> None:
    before = tree(world.parent)
    for extra in ((), ("--force",)):
        run = mlxsup_import(gguf_file, world / "models", "--name", "papers", *extra)
        assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
        assert "is not a model folder" in run.stderr and "pass --force" not in run.stderr, run.stderr
    assert tree(world.parent) == before


def test_force_replaces_a_model_folder_and_only_it(gguf_file: Path, world: Path) -> None:
    models = world / "models"
    first = mlxsup_import(gguf_file, models, "--name", "tiny-llama")
    assert first.returncode == 0, first.stderr
    (models / "tiny-llama" / "left-by-the-old-one.txt").write_text("old")
    before = {k: v for k, v in tree(world.parent).items() if not k.startswith("root/models/tiny-llama")}

    again = mlxsup_import(gguf_file, models, "--name", "tiny-llama")
    assert again.returncode == 2 and "already exists (pass --force to replace it)" in again.stderr, again.stderr
    assert (models / "tiny-llama" / "left-by-the-old-one.txt").exists()

    forced = mlxsup_import(gguf_file, models, "--name", "tiny-llama", "--force")
    assert forced.returncode == 0, forced.stderr
    assert (models / "tiny-llama" / "config.json").is_file()
    assert not (models / "tiny-llama" / "left-by-the-old-one.txt").exists()  # the old folder is gone, whole
    after = {k: v for k, v in tree(world.parent).items() if not k.startswith("root/models/tiny-llama")}
    assert after == before  # no temporary folder left, nothing else changed


def test_a_failed_swap_leaves_the_old_model_intact(gguf_file: Path, world: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The new folder cannot be renamed into place (a full disk, another process): the old model stays."""
    out = world / "models" / "kept-model"
    before = tree(world.parent)
    real_rename = os.rename

    def failing(src, dst, *a, **kw):
        if ".importing-" in os.fspath(src) and os.fspath(dst) == os.fspath(out):
            raise OSError(28, "No space left on device")
        return real_rename(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(Exception, match="No space left"):  # an OSError before, one line for the user now
        gguf_import.import_gguf(gguf_file, out, force=True)
    assert tree(world.parent) == before


def test_the_converter_itself_never_replaces_a_folder_of_models(gguf_file: Path, world: Path) -> None:
    """`python -m worker.mlx_engine.gguf_import GGUF OUT --force` with OUT a folder of other things: refused."""
    before = tree(world.parent)
    for out in (world / "models", world / "sibling", world / "models" / "link-out"):
        run = subprocess.run([sys.executable, "-m", "worker.mlx_engine.gguf_import", str(gguf_file), str(out), "--force"],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert tree(world.parent) == before


def test_a_model_folder_that_holds_model_folders_is_not_replaced(gguf_file: Path, world: Path) -> None:
    """A --model-dir may be a model folder itself and hold others: --force on it would take them too."""
    models = world / "models"
    (models / "config.json").write_text('{"model_type": "llama"}')
    (models / "model.safetensors").write_bytes(b"top weights")
    before = tree(world.parent)
    run = subprocess.run([sys.executable, "-m", "worker.mlx_engine.gguf_import", str(gguf_file), str(models), "--force"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "holds model folders of its own" in run.stderr, run.stderr
    assert tree(world.parent) == before
