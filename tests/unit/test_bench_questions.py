"""bench/QUESTIONS.md, the one answer to "which result is current": each question's command names a script or module
that exists, and its current result is there, outside history/, and the newest `.json` in its folder (by the commit
that last wrote each file; a file git does not know yet counts as newest). No benchmark runs here."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
QUESTIONS = BENCH / "QUESTIONS.md"
COLUMNS = ["id", "question", "command", "current result", "ran on", "effect vs noise"]


def _rows() -> list[dict[str, str]]:
    lines = [line.strip() for line in QUESTIONS.read_text().splitlines() if line.strip().startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == COLUMNS, f"QUESTIONS.md's table has columns {header}"
    rows = []
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == len(COLUMNS), f"a row with {len(cells)} cells: {line}"
        rows.append(dict(zip(COLUMNS, cells, strict=True)))
    return rows


def _code(cell: str) -> str:
    m = re.fullmatch(r"`([^`]+)`", cell)
    assert m, f"not one code span: {cell}"
    return m.group(1)


def _entry_points(command: str) -> list[Path]:
    """The scripts and modules a command runs: `bash X.sh`, `python X.py`, `python -m MOD`."""
    words = command.split()
    found = []
    for i, w in enumerate(words):
        if w.endswith((".sh", ".py")) and i > 0 and words[i - 1] in ("bash", "python", "python3"):
            found.append(ROOT / w)
        if w == "-m" and i + 1 < len(words):
            mod = ROOT / words[i + 1].replace(".", "/")
            found.append(mod / "__main__.py" if mod.is_dir() else mod.with_suffix(".py"))
    return found


def _last_written() -> dict[str, int] | None:
    """Each path under bench/results -> the commit time of the last commit that wrote it (None: no git here)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    out = subprocess.run(["git", "log", "--format=%x00%ct", "--name-only", "--", "bench/results"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    seen: dict[str, int] = {}
    when = 0
    for line in out.splitlines():
        if line.startswith("\x00"):
            when = int(line[1:])
        elif line and line not in seen:
            seen[line] = when
    return seen


ROWS = _rows()


def test_the_table_asks_enough_questions_each_once() -> None:
    assert len(ROWS) >= 8
    ids = [r["id"] for r in ROWS]
    assert len(ids) == len(set(ids)), f"an id twice: {ids}"
    results = [r["current result"] for r in ROWS]
    assert len(results) == len(set(results)), "two questions name one result"
    for r in ROWS:
        assert re.fullmatch(r"[0-9a-f]{7,40}", r["ran on"]), f"{r['id']}: 'ran on' is not a commit: {r['ran on']}"
        assert r["effect vs noise"], f"{r['id']}: no effect size (say 'not measured')"


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_each_command_runs_a_script_or_module_that_exists(row: dict[str, str]) -> None:
    points = _entry_points(_code(row["command"]))
    assert points, f"{row['id']}: the command names no bench script or module"
    missing = [str(p.relative_to(ROOT)) for p in points if not p.is_file()]
    assert not missing, f"{row['id']}: the command runs {missing}, which is not there"


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_each_current_result_is_there_and_the_newest_in_its_folder(row: dict[str, str]) -> None:
    rel = _code(row["current result"])
    path = ROOT / rel
    assert path.is_file(), f"{row['id']}: {rel} is not there"
    assert rel.startswith("bench/results/") and "/history/" not in rel, f"{row['id']}: {rel} is not a current result"
    written = _last_written()
    if written is None:
        pytest.skip("no git checkout: the results' commit times are unknown")
    never = 2**62  # not committed yet: newer than anything committed

    def when(p: Path) -> int:
        return written.get(str(p.relative_to(ROOT)), never)

    newer = sorted(str(p.relative_to(ROOT)) for p in path.parent.glob("*.json") if when(p) > when(path))
    assert not newer, f"{row['id']}: {rel} is not the newest result in its folder; newer: {newer} (update QUESTIONS.md)"


def test_every_result_outside_history_answers_a_question() -> None:
    folders = {(ROOT / _code(r["current result"])).parent for r in ROWS}
    results = BENCH / "results"
    orphans = sorted(str(p.parent.relative_to(ROOT)) for p in results.rglob("*.json")
                     if "history" not in p.relative_to(results).parts and p.parent not in folders)
    assert not orphans, f"results no question in QUESTIONS.md names (name them, or move them to history/): {orphans}"


def test_no_bench_script_is_named_after_when_it_was_written() -> None:
    dated = sorted(p.name for p in BENCH.iterdir()
                   if p.suffix in (".sh", ".py") and re.search(r"(_s\d+|session\d*|_final|_diag_s\d)", p.stem))
    assert not dated, f"bench/ scripts named after a session or round, not a question: {dated}"
